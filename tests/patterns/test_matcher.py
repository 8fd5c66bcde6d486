"""``epfuse.patterns.matcher``: what a declared op tree accepts and binds, and that matching
only walks the anchor's producer cone."""

import numpy as np
import onnx_ir as ir
import pytest

from epfuse.patterns.matcher import (
    ABSENT,
    ANY,
    Const,
    In,
    Ints,
    Or,
    Scalar,
    Var,
    match,
    match_value,
    op,
)


def _value(name: str) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))


def _const(name: str, array) -> ir.Value:
    array = np.asarray(array)
    return ir.Value(
        name=name,
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        shape=ir.Shape(array.shape),
        const_value=ir.tensor(array, name=name),
    )


def _n(op_type: str, *inputs, domain: str = "", num_outputs: int = 1, **attributes) -> ir.Node:
    return ir.node(op_type, list(inputs), attributes, domain=domain, num_outputs=num_outputs)


def test_a_var_met_twice_must_be_one_value():
    x, y = _value("x"), _value("y")
    pattern = op.Mul(Var("a"), Var("a"))
    square = _n("Mul", x, x)
    found = match(pattern, square)
    assert found is not None and found["a"] is x and found.nodes == [square]
    assert match(pattern, _n("Mul", x, y)) is None


def test_commute_tries_both_operand_orders():
    x, y = _value("x"), _value("y")
    neg = _n("Neg", y)
    pattern = op.Add(Var("x"), op.Neg(Var("y"), bind="neg"), commute=True)
    for add in (_n("Add", x, neg.outputs[0]), _n("Add", neg.outputs[0], x)):
        found = match(pattern, add)
        assert found is not None
        assert found["x"] is x and found["y"] is y and found.node("neg") is neg
    assert match(op.Add(Var("x"), op.Neg(Var("y"))), _n("Add", neg.outputs[0], x)) is None


def test_a_later_failure_retries_earlier_choices():
    """The first operand order binds ``x`` to the wrong value; only the second order lets
    the sibling ``Mul(x, c)`` match, and the search must go back for it."""
    a, c = _value("a"), _value("c")
    relu = _n("Relu", a)
    left = _n("Mul", relu.outputs[0], a)  # commutes: x is a (not relu) so that right matches
    right = _n("Mul", a, c)
    add = _n("Add", left.outputs[0], right.outputs[0])
    pattern = op.Add(op.Mul(Var("x"), ANY, commute=True), op.Mul(Var("x"), Var("c")))
    found = match(pattern, add)
    assert found is not None and found["x"] is a and found["c"] is c


def test_or_falls_back_to_later_alternatives_and_where_backtracks():
    x = _value("x")
    neg, relu = _n("Neg", x), _n("Relu", x)
    pattern = op.Add(
        Or(op.Neg(Var("x"), bind="neg"), op.Relu(Var("x"), bind="relu")), ANY, commute=True
    )
    add = _n("Add", neg.outputs[0], relu.outputs[0])
    assert match(pattern, add).node("neg") is neg  # the first alternative, first order
    # where refuses the Neg alternative: the search goes on to the Relu one
    found = match(pattern, add, where=lambda m: "relu" in m)
    assert found is not None and found.node("relu") is relu and "neg" not in found
    assert match(pattern, add, where=lambda m: False) is None


def test_a_failed_choice_leaves_no_binding_behind():
    """The first alternative binds ``a`` and then fails on the sibling; the second must see
    ``a`` unbound (and the match must not report the first alternative's nodes)."""
    x, y = _value("x"), _value("y")
    neg = _n("Neg", x)
    add = _n("Add", neg.outputs[0], y)
    pattern = op.Add(Or(op.Neg(Var("a"), bind="first"), op.Neg(Var("b"), bind="second")), Var("a"))
    found = match(pattern, add)
    assert found is not None and found["a"] is y and found["b"] is x
    assert "first" not in found and found.node("second") is neg and found.nodes == [add, neg]


def test_attribute_predicates_literal_in_and_callable():
    x = _value("x")
    concat = _n("Concat", x, x, axis=-1)
    assert match(op.Concat(ANY, ANY, axis=-1), concat) is not None
    assert match(op.Concat(ANY, ANY, axis=In(3, -1)), concat) is not None
    assert match(op.Concat(ANY, ANY, axis=lambda a: a is not None and a < 0), concat)
    assert match(op.Concat(ANY, ANY, axis=0), concat) is None
    # an absent attribute reads None
    assert match(op.Relu(ANY, alpha=In(None)), _n("Relu", x)) is not None


def test_constant_predicates():
    x = _value("x")
    axes, scale = _const("axes", np.array([1], np.int64)), _const("s", np.float32(0.5))
    unsq, mul = _n("Unsqueeze", x, axes), _n("Mul", x, scale)
    assert match(op.Unsqueeze(ANY, Ints([-3], [1])), unsq) is not None
    assert match(op.Unsqueeze(ANY, Ints([0])), unsq) is None
    assert match(op.Unsqueeze(ANY, Ints([1])), _n("Unsqueeze", x, x)) is None  # not constant
    found = match(op.Mul(Var("x"), Scalar(lambda s: s == 0.5, name="s"), commute=True), mul)
    assert found is not None and found["s"] is scale
    assert match(op.Mul(ANY, Scalar(lambda s: s > 1)), mul) is None
    big = Const(lambda a: a.dtype == np.int64 and a.size == 1)
    assert match(op.Unsqueeze(ANY, big), unsq) is not None


def test_input_counts_extra_and_optional_trailing_inputs():
    x = _value("x")
    starts, ends = _const("s", np.array([0])), _const("e", np.array([2]))
    three = _n("Slice", x, starts, ends)
    assert match(op.Slice(Var("x")), three) is None  # more inputs than the pattern
    assert match(op.Slice(Var("x"), extra_inputs=True), three)["x"] is x
    # a missing trailing input matches only an optional Var (which binds None)
    found = match(op.Slice(ANY, ANY, ANY, Var("axes", optional=True)), three)
    assert found is not None and found.get("axes") is None and "axes" in found
    assert match(op.Slice(ANY, ANY, ANY, Var("axes")), three) is None
    # ABSENT: only a missing input (a given one fails unless another alternative takes it)
    steps = Or(Ints([1]), ABSENT)
    by_two = _n("Slice", x, starts, ends, ends, ends)  # steps [2]
    assert match(op.Slice(ANY, ANY, ANY, ANY, steps), by_two) is None
    assert match(op.Slice(ANY, ANY, ANY, ANY, steps), _n("Slice", x, starts, ends, ends))
    assert match(op.Slice(ANY, ANY, ANY, ABSENT), three) is not None
    unit = _const("one", np.array([1]))
    assert match(op.Slice(ANY, ANY, ANY, ANY, steps), _n("Slice", x, starts, ends, ends, unit))
    assert match(op.Slice(ANY, ANY, ABSENT), three) is None


def test_output_index_domain_and_node_checks():
    x = _value("x")
    split = _n("Split", x, num_outputs=2, axis=0)
    add = _n("Add", split.outputs[1], split.outputs[0])
    pattern = op.Add(op.Split(Var("x"), output=1, bind="s"), op.Split(Var("x"), bind="s"))
    found = match(pattern, add)
    assert found is not None and found.nodes == [add, split]  # one node, met twice
    assert match(op.Add(op.Split(ANY), ANY), add) is None  # output 1 is not output 0
    rms = _n("RMSNormalization", x, x)
    assert match(op.RMSNormalization(ANY, ANY, domain="ai.onnx"), rms) is not None
    fused = _n("SkipLayerNormalization", x, x, domain="com.microsoft")
    assert match(op.SkipLayerNormalization(ANY, ANY), fused) is None
    assert match(op.SkipLayerNormalization(ANY, ANY, domain="com.microsoft"), fused)
    checked = op.Relu(ANY, check=lambda n: n.name == "keep")
    assert match(checked, ir.node("Relu", [x], name="keep")) is not None
    assert match(checked, ir.node("Relu", [x], name="other")) is None


def test_var_check_and_match_value():
    x = _value("x")
    relu = _n("Relu", x)
    ranked = op.Relu(Var("x", check=lambda v: v.shape is not None and len(v.shape) == 2))
    assert match_value(ranked, relu.outputs[0])["x"] is x
    assert match_value(op.Relu(Var("x", check=lambda v: False)), relu.outputs[0]) is None
    assert match_value(op.Relu(ANY), x) is None  # a graph input has no producer
    assert match_value(Var("v"), None) is None


def test_only_the_producer_cone_is_visited(monkeypatch):
    """Matching reads only producers, never a value's uses, and checks only the nodes it
    steps to: the cost of a match does not grow with the graph around the anchor."""
    x = _value("x")
    relu = _n("Relu", x)
    neg = _n("Neg", relu.outputs[0])
    for _ in range(50):  # other readers of relu's output, never looked at
        _n("Abs", relu.outputs[0])

    def no_uses(self):
        raise AssertionError("the matcher read a value's uses")

    monkeypatch.setattr(ir.Value, "uses", no_uses)
    seen: list[str] = []
    pattern = op.Neg(op.Relu(Var("x"), check=lambda n: seen.append(n.op_type) or True))
    found = match(pattern, neg)
    assert found is not None and found.nodes == [neg, relu] and seen == ["Relu"]


def test_commute_needs_two_inputs():
    with pytest.raises(ValueError, match="two inputs"):
        op.Sum(ANY, ANY, ANY, commute=True)
