"""Raising the default opset 18 -> 23 only when no op present changes meaning."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from epfuse.patterns._opset import TYPE_ONLY_UPDATES, changed_ops, require_default_opset


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


@pytest.mark.parametrize("op", sorted(TYPE_ONLY_UPDATES))
def test_type_only_updates_keep_old_attributes_and_defaults(op):
    """Mechanical support for the changelog reading: every attribute of the opset-18 schema
    still exists at 23 with the same default, and attributes added since are optional."""
    old = onnx.defs.get_schema(op, 18, "")
    new = onnx.defs.get_schema(op, 23, "")
    for name, attribute in old.attributes.items():
        assert name in new.attributes, f"{op}.{name} disappeared"
        before, after = attribute.default_value, new.attributes[name].default_value
        assert before == after, f"{op}.{name} default changed"
    for name in set(new.attributes) - set(old.attributes):
        assert not new.attributes[name].required, f"{op}.{name} is new and required"
    assert [i.name for i in new.inputs][: len(old.inputs)] == [i.name for i in old.inputs]


def test_semantic_changes_refuse():
    model = _model(["Relu", "GroupNormalization", "Softmax", "Cast"])
    assert changed_ops(model, 23) == ["GroupNormalization"]
    cache: dict = {}
    reason = require_default_opset(model, 23, cache)
    assert reason is not None and "GroupNormalization" in reason
    assert model.opset_imports[""] == 18


def test_raises_and_memoizes():
    model = _model(["Relu", "Cast", "Reshape", "Softmax", "Cos"])
    cache: dict = {}
    assert require_default_opset(model, 23, cache) is None
    assert model.opset_imports[""] == 23 and model.graph.opset_imports[""] == 23
    assert require_default_opset(model, 23, cache) is None
    assert len(cache) == 1


def test_subgraph_ops_are_checked():
    inner = helper.make_graph(
        [helper.make_node("GridSample", ["a", "b"], ["c"])],
        "body",
        [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
    )
    outer = helper.make_node("If", ["cond"], ["out"], then_branch=inner, else_branch=inner)
    graph = helper.make_graph(
        [outer],
        "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    model = ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    )
    assert changed_ops(model, 23) == ["GridSample"]
