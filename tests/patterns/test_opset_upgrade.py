"""Raising the default opset 14..22 -> 23: every schema revision classified, conversions exact.

Three kinds of evidence: the table against the ONNX schemas (every revision of opsets 15..23
of an op that exists at 14..22 is classified, and a ``safe`` one's schema diff is exactly what
it names); the converted ops on ORT at opsets 14 and 17 against the original (bit-equal: the
same kernels run); and refusals leave the model untouched with a per-op reason.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from epfuse.patterns._opset import (
    MIN_OPSET,
    REVISIONS,
    changed_ops,
    plan_upgrade,
    require_default_opset,
    upgrade_opset,
)

TARGET = 23


def _history() -> dict[str, list[onnx.defs.OpSchema]]:
    found: dict[str, list[onnx.defs.OpSchema]] = defaultdict(list)
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx"):
            found[schema.name].append(schema)
    return {op: sorted(s, key=lambda s: s.since_version) for op, s in found.items()}


HISTORY = _history()


def _revisions_to_classify() -> list[tuple[str, int]]:
    """(op, version) of every revision in opsets MIN_OPSET+1..23 of an op an older model can hold."""
    keys = []
    for op, schemas in HISTORY.items():
        for previous, schema in itertools.pairwise(schemas):
            if MIN_OPSET < schema.since_version <= TARGET and previous.since_version < TARGET:
                keys.append((op, schema.since_version))
    return sorted(keys)


def _previous(op: str, version: int) -> onnx.defs.OpSchema:
    return onnx.defs.get_schema(op, version - 1, "")


def _types(schema: onnx.defs.OpSchema, formal) -> set[str]:
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return constraints.get(formal.type_str, {formal.type_str})


def _added_or_broken(old: onnx.defs.OpSchema, new: onnx.defs.OpSchema) -> tuple[set, list]:
    """(names added, incompatibilities) between two revisions of a schema."""
    added, broken = set(), []
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    for name, attribute in old.attributes.items():
        if name not in new.attributes:
            broken.append(f"attribute {name} removed")
        elif attribute.default_value != new.attributes[name].default_value:
            broken.append(f"attribute {name} default changed")
        elif new.attributes[name].required and not attribute.required:
            broken.append(f"attribute {name} became required")
    for name in set(new.attributes) - set(old.attributes):
        added.add(name)
        if new.attributes[name].required:
            broken.append(f"attribute {name} is new and required")
    for i, formal in enumerate(new.inputs):
        if i >= len(old.inputs):
            added.add(formal.name)
            if formal.option != optional:
                broken.append(f"input {formal.name} is new and not optional")
            continue
        before = old.inputs[i]
        if before.name != formal.name:
            broken.append(f"input {i} renamed {before.name} -> {formal.name}")
        if before.option != formal.option and formal.option != optional:
            broken.append(f"input {formal.name} option changed")
        if _types(old, before) - _types(new, formal):
            broken.append(f"input {formal.name} lost types")
    if len(old.inputs) > len(new.inputs) or len(old.outputs) != len(new.outputs):
        broken.append("inputs or outputs removed")
    for before, after in zip(old.outputs, new.outputs, strict=False):
        if _types(old, before) - _types(new, after):
            broken.append(f"output {after.name} lost types")
    return added, broken


def test_every_revision_from_opset_14_to_23_is_classified():
    expected = set(_revisions_to_classify())
    assert expected - set(REVISIONS) == set(), "unclassified ONNX revisions"
    assert set(REVISIONS) - expected == set(), "entries that are no ONNX revision"


@pytest.mark.parametrize(
    "key", sorted(k for k, r in REVISIONS.items() if r.kind == "safe"), ids=str
)
def test_safe_revisions_only_add_what_they_name(key):
    """A ``safe`` revision widens types and adds exactly the optional attributes/inputs its
    entry names (whose defaults the entry says keep the old behaviour); nothing is removed,
    renamed, made required, or given a new default."""
    op, version = key
    added, broken = _added_or_broken(_previous(op, version), onnx.defs.get_schema(op, version, ""))
    assert broken == [], f"{op} {version}: {broken}"
    assert added == set(REVISIONS[key].added), f"{op} {version} adds {sorted(added)}"


@pytest.mark.parametrize(
    "key",
    sorted(k for k, r in REVISIONS.items() if r.kind != "safe" and "ONNX Runtime" not in r.why),
    ids=str,
)
def test_converted_and_refused_revisions_do_change_the_signature_or_defaults(key):
    """Converting or refusing is only needed where the schema says something changed (a new
    attribute with a non-old default, a removed attribute, a changed default)."""
    op, version = key
    added, broken = _added_or_broken(_previous(op, version), onnx.defs.get_schema(op, version, ""))
    assert added or broken, f"{op} {version}: no change in the schema"


# --------------------------------------------------------------------------------- ORT proofs

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _proto(nodes, inputs, outputs, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [
            helper.make_tensor_value_info(*o)
            if len(o) == 3
            else helper.make_tensor_value_info(*o, None)
            for o in outputs
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)  # typed outputs


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _upgraded(proto: onnx.ModelProto, target: int = TARGET) -> onnx.ModelProto:
    model = ir.serde.deserialize_model(proto)
    assert upgrade_opset(model, target) is None
    assert model.opset_imports[""] == target
    out = ir.to_proto(model)
    onnx.checker.check_model(out)
    onnx.shape_inference.infer_shapes(out, check_type=True, strict_mode=True)
    return out


REDUCE = sorted(
    op
    for (op, v), r in REVISIONS.items()
    if v == 18 and r.kind == "convert" and op.startswith("Reduce")
)


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("axes", [[-1], [0, 2], None])
def test_reduce_axes_attribute_becomes_input(op, opset, axes):
    keepdims = 0 if axes == [0, 2] else 1
    kwargs = {"keepdims": keepdims} | ({"axes": axes} if axes is not None else {})
    proto = _proto(
        [helper.make_node(op, ["x"], ["y"], **kwargs)], [("x", F, [2, 3, 4])], [("y", F)], opset
    )
    x = RNG.uniform(0.5, 2.0, (2, 3, 4)).astype(np.float32)  # > 0 for the Log reductions
    upgraded = _upgraded(proto)
    reduce = next(n for n in upgraded.graph.node if n.op_type == op)
    assert [a.name for a in reduce.attribute if a.name == "axes"] == []
    assert len(reduce.input) == (1 if axes is None else 2)
    expected, actual = _run(proto, {"x": x}), _run(upgraded, {"x": x})
    np.testing.assert_array_equal(actual[0], expected[0])


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("with_split", [False, True])
def test_split_gets_num_outputs(opset, with_split):
    inputs = [("x", F, [2, 6])] + ([("s", TensorProto.INT64, [3])] if with_split else [])
    node = helper.make_node("Split", [i[0] for i in inputs], ["a", "b", "c"], axis=1)
    proto = _proto([node], inputs, [(n, F, ["b", "w"]) for n in "abc"], opset)
    feeds = {"x": RNG.standard_normal((2, 6)).astype(np.float32)}
    if with_split:
        feeds["s"] = np.array([1, 2, 3], np.int64)
    upgraded = _upgraded(proto)
    split = upgraded.graph.node[0]
    assert ("num_outputs" in [a.name for a in split.attribute]) is not with_split
    for a, b in zip(_run(proto, feeds), _run(upgraded, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("opset", [14, 15])
def test_roi_align_keeps_output_half_pixel(opset):
    """Converted for targets 16..21 (ORT has no RoiAlign-22 kernel, so 23 refuses it)."""
    node = helper.make_node(
        "RoiAlign", ["x", "rois", "idx"], ["y"], output_height=2, output_width=2
    )
    proto = _proto(
        [node],
        [("x", F, [1, 1, 6, 6]), ("rois", F, [2, 4]), ("idx", TensorProto.INT64, [2])],
        [("y", F, [2, 1, 2, 2])],
        opset,
    )
    feeds = {
        "x": RNG.standard_normal((1, 1, 6, 6)).astype(np.float32),
        "rois": np.array([[0.3, 0.7, 4.2, 3.9], [1.1, 0.2, 5.5, 5.1]], np.float32),
        "idx": np.zeros(2, np.int64),
    }
    assert "RoiAlign" in changed_ops(ir.serde.deserialize_model(proto), TARGET)
    upgraded = _upgraded(proto, 21)
    modes = [
        a.s for a in upgraded.graph.node[0].attribute if a.name == "coordinate_transformation_mode"
    ]
    assert modes == [b"output_half_pixel"]
    np.testing.assert_array_equal(_run(proto, feeds)[0], _run(upgraded, feeds)[0])
    # The default of opset 16 (half_pixel) would differ: the attribute is needed. And ORT
    # has no RoiAlign-22 kernel, which is why raising to 23 refuses it (re-check on upgrade).
    at_22 = onnx.ModelProto()
    at_22.CopyFrom(upgraded)
    at_22.opset_import[0].version = 22
    with pytest.raises(Exception, match="RoiAlign"):
        _run(at_22, feeds)
    default = onnx.ModelProto()
    default.CopyFrom(upgraded)
    del default.graph.node[0].attribute[:]
    default.graph.node[0].attribute.extend(proto.graph.node[0].attribute)
    assert not np.array_equal(_run(default, feeds)[0], _run(proto, feeds)[0])


@pytest.mark.parametrize("opset", [14, 17])
def test_safe_ops_of_llm_exports_compute_the_same_at_23(opset):
    """The ops Optimum's exports hold that were revised after 14 (types/options only)."""
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("LessOrEqual", ["x", "zero"], ["le"]),
        helper.make_node("GreaterOrEqual", ["x", "zero"], ["ge"]),
        helper.make_node("Where", ["le", "sq", "x"], ["w"]),
        helper.make_node("IsNaN", ["w"], ["nan"]),
        helper.make_node("Cast", ["nan"], ["nanf"], to=F),
        helper.make_node("ConstantOfShape", ["shape"], ["fill"]),
        helper.make_node("Reshape", ["w", "flat"], ["r"]),
        helper.make_node("Flatten", ["x"], ["f"]),
        helper.make_node("Identity", ["f"], ["i"]),
        helper.make_node("Cos", ["x"], ["c"]),
        helper.make_node("Sin", ["x"], ["s"]),
        helper.make_node("Equal", ["shape", "shape"], ["eq"]),
        helper.make_node("LeakyRelu", ["x"], ["lr"], alpha=0.1),
    ]
    inputs = [
        ("x", F, [2, 3]),
        ("two", F, []),
        ("zero", F, []),
        ("flat", i64, [1]),
    ]
    outputs = [(n, F) for n in ("sq", "w", "nanf", "fill", "r", "f", "i", "c", "s", "lr")]
    outputs += [("le", TensorProto.BOOL), ("ge", TensorProto.BOOL), ("eq", TensorProto.BOOL)]
    proto = _proto(nodes, inputs, outputs, opset)
    assert changed_ops(ir.serde.deserialize_model(proto), TARGET) == []
    feeds = {
        "x": RNG.standard_normal((2, 3)).astype(np.float32),
        "two": np.array(2.0, np.float32),
        "zero": np.array(0.0, np.float32),
        "flat": np.array([-1], np.int64),
    }
    for a, b in zip(_run(proto, feeds), _run(_upgraded(proto), feeds), strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------- refusals, bookkeeping


def _model(op_types: list[str], opset: int = 18) -> ir.Model:
    nodes = [helper.make_node(op, ["x"], [f"y{i}"]) for i, op in enumerate(op_types)]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None)
            for i in range(len(nodes))
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize(
    ("op", "opset"),
    [("GroupNormalization", 18), ("GridSample", 16), ("DFT", 17), ("RoiAlign", 16)],
)
def test_semantic_changes_refuse_with_the_op_and_why(op, opset):
    model = _model(["Relu", op, "Softmax", "Cast"], opset)
    assert changed_ops(model, TARGET) == [op]
    reason = require_default_opset(model, TARGET, {})
    assert reason is not None and op in reason and REVISIONS[(op, _refused(op))].why in reason
    assert model.opset_imports[""] == opset


def _refused(op: str) -> int:
    return next(v for (o, v), r in REVISIONS.items() if o == op and r.kind == "refuse")


def test_a_refusal_converts_nothing():
    proto = _proto(
        [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]),
            helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=1),
        ],
        [("x", F, [1, 2, 3]), ("s", F, [1]), ("b", F, [1])],
        [("m", F), ("y", F)],
        18,
    )
    proto.opset_import[0].version = 18
    model = ir.serde.deserialize_model(proto)
    assert upgrade_opset(model, TARGET) is not None
    assert ir.to_proto(model).graph == proto.graph


def test_below_14_refuses():
    model = _model(["Relu"], 13)
    reason = require_default_opset(model, TARGET, {})
    assert reason is not None and "opset 13 is below 14" in reason
    assert model.opset_imports[""] == 13


def test_opset_14_export_ops_no_longer_refuse():
    """The four ops named when Optimum's --opset 14 exports were refused."""
    model = _model(["LessOrEqual", "Pow", "ReduceMean", "Where"], 14)
    assert changed_ops(model, TARGET) == []
    plan = plan_upgrade(model, TARGET)
    assert [(n.op_type, r.version) for n, r in plan.conversions] == [("ReduceMean", 18)]


def test_raises_and_memoizes():
    model = _model(["Relu", "Cast", "Reshape", "Softmax", "Cos"])
    cache: dict = {}
    assert require_default_opset(model, TARGET, cache) is None
    assert model.opset_imports[""] == TARGET and model.graph.opset_imports[""] == TARGET
    assert require_default_opset(model, TARGET, cache) is None
    assert len(cache) == 1


def _if_model(body_nodes, opset: int) -> ir.Model:
    inner = helper.make_graph(
        body_nodes, "body", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)]
    )
    outer = helper.make_node("If", ["cond"], ["out"], then_branch=inner, else_branch=inner)
    graph = helper.make_graph(
        [outer],
        "g",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["r", "c"])],
    )
    return ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    )


def test_subgraph_ops_are_checked():
    model = _if_model([helper.make_node("GridSample", ["a", "a"], ["c"])], 18)
    assert changed_ops(model, TARGET) == ["GridSample"]


def test_subgraph_ops_are_converted():
    model = _if_model([helper.make_node("ReduceMean", ["a"], ["c"], axes=[1])], 14)
    assert upgrade_opset(model, TARGET) is None
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    cond, a = np.array(True), RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(
        _run(proto, {"cond": cond, "a": a})[0], a.mean(axis=1, keepdims=True), rtol=1e-6
    )


def test_functions_are_converted_with_their_own_opset():
    body = [helper.make_node("ReduceMax", ["x"], ["y"], axes=[-1], keepdims=1)]
    function = helper.make_function(
        "local", "RowMax", ["x"], ["y"], body, [helper.make_opsetid("", 14)]
    )
    graph = helper.make_graph(
        [helper.make_node("RowMax", ["x"], ["y"], domain="local")],
        "g",
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, None)],
    )
    proto = helper.make_model(
        graph,
        functions=[function],
        opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("local", 1)],
    )
    model = ir.serde.deserialize_model(proto)
    assert upgrade_opset(model, TARGET) is None
    out = ir.to_proto(model)
    assert [o.version for o in out.functions[0].opset_import if o.domain == ""] == [TARGET]
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(_run(out, {"x": x})[0], _run(proto, {"x": x})[0])
