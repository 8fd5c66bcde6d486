"""Shape facts of TorchScript-style graphs: run-time reshape targets evaluated symbolically,
dims inference leaves anonymous derived (``analysis.shapes``), and what a subgraph reads of
the graph inputs by value versus by shape (``_evaluate.value_dependencies``)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from epfuse.optimizer.manager import _infer_types
from epfuse.patterns._evaluate import value_dependencies
from epfuse.patterns._graph import shape_vector
from epfuse.patterns.analysis.shapes import refine_shapes


def _torchscript_graph() -> ir.Model:
    """ids -> embedding (batch, seq, 64) -> q_proj -> Reshape(Concat(Shape[0], Shape[1], -1,
    16)) -> Transpose; a residual Add of the embedding with a Slice of the projection (ONNX
    inference names the Slice's dims anew); torch's expand target Where(v == -1, 1, v)."""
    i64 = np.int64
    inits = [
        numpy_helper.from_array(np.zeros((256, 64), np.float32), "emb"),
        numpy_helper.from_array(np.zeros((64, 128), np.float32), "w"),
        numpy_helper.from_array(np.array(0, i64), "c0"),
        numpy_helper.from_array(np.array(1, i64), "c1"),
        numpy_helper.from_array(np.array([0], i64), "axes0"),
        numpy_helper.from_array(np.array([-1], i64), "m1"),
        numpy_helper.from_array(np.array([16], i64), "h16"),
        numpy_helper.from_array(np.array([2], i64), "r2"),
        numpy_helper.from_array(np.array([64], i64), "end64"),
        numpy_helper.from_array(np.array([2], i64), "axis2"),
        numpy_helper.from_array(np.array(-1, i64), "neg1"),
    ]
    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "ids"], ["x"]),
        n("MatMul", ["x", "w"], ["y"]),
        n("Shape", ["x"], ["sh"]),
        n("Gather", ["sh", "c0"], ["b"], axis=0),
        n("Gather", ["sh", "c1"], ["s"], axis=0),
        n("Unsqueeze", ["b", "axes0"], ["b1"]),
        n("Unsqueeze", ["s", "axes0"], ["s1"]),
        n("Slice", ["y", "axes0", "end64", "axis2"], ["y64"]),
        n("Concat", ["b1", "s1", "m1", "h16"], ["target"], axis=0),
        n("Reshape", ["y64", "target"], ["r"]),
        n("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
        n("Add", ["x", "y64"], ["residual"]),
        n("Concat", ["b1", "r2", "s1", "h16"], ["v"], axis=0),
        n("Shape", ["v"], ["vlen"]),
        n(
            "ConstantOfShape",
            ["vlen"],
            ["ones"],
            value=helper.make_tensor("", TensorProto.INT64, [1], [1]),
        ),
        n("Mul", ["ones", "neg1"], ["minus"]),
        n("Equal", ["v", "minus"], ["is_minus"]),
        n("Where", ["is_minus", "ones", "v"], ["expand_to"]),
        # Graph outputs keep their declared shapes; the values under test are inner ones.
        n("Identity", ["t"], ["t_out"]),
        n("Identity", ["residual"], ["residual_out"]),
        n("Identity", ["expand_to"], ["expand_out"]),
        n("Add", ["x", "z"], ["mixed"]),
        n("Identity", ["mixed"], ["mixed_out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "ts",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["other", "seq", 64]),
        ],
        [
            helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("residual_out", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("expand_out", TensorProto.INT64, None),
            helper.make_tensor_value_info("mixed_out", TensorProto.FLOAT, None),
        ],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return ir.serde.deserialize_model(proto)


def _values(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for node in model.graph for v in node.outputs}


def _dims(value: ir.Value) -> list:
    return [d if isinstance(d, int) else d.value for d in value.shape]


def test_reshape_target_and_slice_dims_are_derived():
    model = _torchscript_graph()
    _infer_types(model)  # ONNX inference, then refine_shapes
    values = _values(model)
    assert _dims(values["r"]) == ["batch", "seq", 4, 16]  # -1 = 64 / 16 by cancelling B, S
    assert _dims(values["y64"])[:2] == ["batch", "seq"]
    assert _dims(values["residual"])[:2] == ["batch", "seq"]


def test_refine_writes_only_proven_dims():
    model = _torchscript_graph()
    mixed = _values(model)["mixed"]
    mixed.shape = ir.Shape([None, None, 64])
    refine_shapes(model.graph)
    # batch vs other: either may be 1 at run time, so the broadcast size is unknown.
    assert mixed.shape[0].value is None
    assert mixed.shape[1].value == "seq"


def test_torch_expand_idiom_evaluates_symbolically():
    model = _torchscript_graph()
    _infer_types(model)
    got = shape_vector(_values(model)["expand_to"])
    assert got is not None and got[1] == 2 and got[3] == 16
    assert got[0] == ("sym", "batch") and got[2] == ("sym", "seq")


def test_shape_of_an_embedding_reads_the_ids_by_shape_only():
    model = _torchscript_graph()
    by_value, by_shape = value_dependencies(_values(model)["target"])
    assert by_value == set() and {v.name for v in by_shape} == {"ids"}
    by_value, _ = value_dependencies(_values(model)["y"])
    assert {v.name for v in by_value} == {"ids"}


def _experts_graph(declare: str = "other") -> ir.Model:
    """transformers 4.x's traced experts (GPT-OSS, Optimum): tokens flattened with
    ``view(-1, 64)`` (batch*seq), routed by TopK/ScatterElements, repeated per expert (Tile),
    ``view(E, -1, 64)``, clamped, ``view(E, batch, -1, 64)`` and summed over experts; a
    residual Add with the input. Beside it ``arange(past, past + seq)`` (Range) and the KV
    cache ``Concat(past, new)`` on the sequence axis. ``declare`` names the extra input's dim
    (a declared name equal to a sum's text must not be written as that sum)."""
    i64, E = np.int64, 4
    inits = [
        numpy_helper.from_array(np.zeros((256, 64), np.float32), "emb"),
        numpy_helper.from_array(np.zeros((E, 64), np.float32), "router"),
        numpy_helper.from_array(np.array([-1, 64], i64), "flat"),
        numpy_helper.from_array(np.array([2], i64), "k"),
        numpy_helper.from_array(np.array([E, 1], i64), "repeats"),
        numpy_helper.from_array(np.array([E, -1, 64], i64), "per_expert"),
        numpy_helper.from_array(np.array([E], i64), "e"),
        numpy_helper.from_array(np.array([-1, 64], i64), "tail"),
        numpy_helper.from_array(np.array([0], i64), "axes0"),
        numpy_helper.from_array(np.array(0, i64), "c0"),
        numpy_helper.from_array(np.array(2, i64), "c2"),
        numpy_helper.from_array(np.array(1, i64), "c1"),
        numpy_helper.from_array(np.array(7.0, np.float32), "limit"),
    ]
    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "ids"], ["x"]),
        n("Reshape", ["x", "flat"], ["tokens"]),  # (batch*seq, 64)
        n("Gemm", ["tokens", "router"], ["logits"], transB=1),
        n("TopK", ["logits", "k"], ["top", "index"]),
        n("Shape", ["logits"], ["logits_shape"]),
        n("ConstantOfShape", ["logits_shape"], ["zeros"]),
        n("ScatterElements", ["zeros", "index", "top"], ["scores"], axis=1),
        n("Tile", ["tokens", "repeats"], ["tiled"]),  # (4*batch*seq, 64)
        n("Reshape", ["tiled", "per_expert"], ["routed"]),  # (4, batch*seq, 64)
        n("Clip", ["routed", "", "limit"], ["clipped"]),
        n("Shape", ["x"], ["x_shape"]),
        n("Gather", ["x_shape", "c0"], ["b"], axis=0),
        n("Unsqueeze", ["b", "axes0"], ["b1"]),
        n("Concat", ["e", "b1", "tail"], ["unflat"], axis=0),
        n("Reshape", ["clipped", "unflat"], ["experts"]),  # (4, batch, seq, 64)
        n("ReduceSum", ["experts", "axes0"], ["summed"], keepdims=0),
        n("Add", ["x", "summed"], ["residual"]),
        n("Shape", ["past"], ["past_shape"]),
        n("Gather", ["past_shape", "c2"], ["past_len"], axis=0),
        n("Gather", ["x_shape", "c1"], ["seq_len"], axis=0),
        n("Add", ["past_len", "seq_len"], ["end"]),
        n("Range", ["past_len", "end", "c1"], ["positions"]),  # (seq,)
        n("Concat", ["past", "new"], ["cache"], axis=2),  # (batch, 2, past + seq, 16)
        n("Concat", ["extra", "new"], ["declared_sum"], axis=2),
    ]
    outputs = ["residual", "scores", "positions", "cache", "declared_sum"]
    nodes += [n("Identity", [name], [f"{name}_out"]) for name in outputs]
    graph = helper.make_graph(
        nodes,
        "experts",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch", 2, "past", 16]),
            helper.make_tensor_value_info("new", TensorProto.FLOAT, ["batch", 2, "seq", 16]),
            helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["batch", 2, "past", 16]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", declare]),
        ],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None) for name in outputs],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return ir.serde.deserialize_model(proto)


def test_flattened_tokens_are_a_product_that_cancels_back():
    """batch*seq through the experts' reshapes, Gemm, TopK, ScatterElements, Tile and Clip:
    the residual after them is (batch, seq, 64) again, so a later layer's shapes are known."""
    model = _experts_graph()
    _infer_types(model)
    values = _values(model)
    assert _dims(values["tokens"]) == ["batch*seq", 64]
    assert _dims(values["logits"]) == ["batch*seq", 4]
    assert _dims(values["top"]) == ["batch*seq", 2]
    assert _dims(values["scores"]) == ["batch*seq", 4]
    assert _dims(values["tiled"]) == ["4*batch*seq", 64]
    assert _dims(values["routed"]) == [4, "batch*seq", 64]
    assert _dims(values["clipped"]) == [4, "batch*seq", 64]
    assert _dims(values["experts"]) == [4, "batch", "seq", 64]
    assert _dims(values["residual"]) == ["batch", "seq", 64]


def test_range_and_cache_concat_lengths():
    model = _experts_graph()
    _infer_types(model)
    values = _values(model)
    assert _dims(values["positions"]) == ["seq"]  # arange(past, past + seq)
    assert _dims(values["cache"]) == ["batch", 2, "past+seq", 16]
    assert _dims(values["declared_sum"]) == ["batch", 2, "past+seq", 16]


def test_a_declared_name_is_never_written_as_a_sum():
    """A declared dim means what its inputs say (ONNX: equal names, equal sizes): a derived
    sum whose text is a declared name stays anonymous rather than claim that equality."""
    model = _experts_graph(declare="past+seq")
    _infer_types(model)
    assert _values(model)["cache"].shape[2].value != "past+seq"
