"""Attention with per-head sinks -> Attention * Sigmoid(LogSumExp(scores) - sink): small
graphs in GPT-OSS's exported form run on ORT before and after the rule; a sink column that is
not one constant per head, or reads data, is refused; a Slice that keeps the sink is not
matched."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from proto_graph import ProtoGraph, run_unoptimized

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.attention_sinks import AttentionSinksToAttention
from epfuse.tolerances import tolerance_for

B, N, S, T, H = 2, 4, 3, 5, 8
SINKS = np.array([2.5, -1.0, 0.3, 6.0], np.float32)


@dataclasses.dataclass
class Variant:
    # "expand" (shape from input_ids) | "query-shape" (from Q's shape, Q computed from an
    # input by value) | "per-query" (varies along S) | "data" (reads v)
    column: str = "expand"
    max_shift: bool = True
    drop: str = "last"  # "last" | "first" (keeps the sink column)
    dtype: int = TensorProto.FLOAT


def _graph(v: Variant) -> onnx.ModelProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(v.dtype)
    g = ProtoGraph(const_dtype=np_dtype)
    const, op, nodes, inits = g.const, g.op, g.nodes, g.inits

    inputs = [
        helper.make_tensor_value_info("q", v.dtype, [B, N, S, H]),
        helper.make_tensor_value_info("k", v.dtype, [B, N, T, H]),
        helper.make_tensor_value_info("v", v.dtype, [B, N, T, H]),
        helper.make_tensor_value_info("keep", TensorProto.BOOL, [B, 1, S, T]),
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    i64 = np.int64
    q = "q"
    if v.column == "query-shape":
        # Q + CumSum(0 * min(input_ids)): Q's shape reads input_ids by value through an op
        # value_dependencies does not know the shape rule of, as a later layer's Q reaches
        # the previous layers' value-routed experts (TopK, ScatterElements).
        ids = op(
            "Cast", [op("ReduceMin", ["input_ids"], "ids_min", keepdims=1)], "ids_f", to=v.dtype
        )
        zero = op("CumSum", [op("Mul", [ids, const("zf", 0.0)], "zero"), const("a0", 0, i64)], "cs")
        q = op("Add", ["q", zero], "q_plus")
    kt = op("Transpose", ["k"], "kt", perm=[0, 1, 3, 2])
    scores = op("Mul", [op("MatMul", [q, kt], "qk"), const("sc", 1 / math.sqrt(H))], "qk_s")
    bias = op("Where", ["keep", const("z", 0.0), const("mn", np.finfo(np_dtype).min)], "bias")
    scores = op("Add", [scores, bias], "scores")
    # The sink column's shape (B, N, S, 1) from the input_ids shape, as the export takes it.
    ids_shape = op("Shape", [q if v.column == "query-shape" else "input_ids"], "ids_shape")
    batch = op("Slice", [ids_shape, const("z0", [0], i64), const("o1", [1], i64)], "b")
    at = 2 if v.column == "query-shape" else 1  # Q is (B, N, S, H), input_ids (B, S)
    seq = op("Slice", [ids_shape, const("at", [at], i64), const("o2", [at + 1], i64)], "s")
    target = op("Concat", [batch, const("n", [N], i64), seq, "o1"], "target", axis=0)
    if v.column == "per-query":
        sink_const = const("sinks", np.arange(S, dtype=np_dtype).reshape(1, 1, S, 1))
    else:
        sink_const = const("sinks", SINKS.astype(np_dtype).reshape(1, N, 1, 1))
    column = op("Expand", [sink_const, target], "column")
    if v.column == "data":
        first = op("Slice", ["v", "z0", "o1", const("ax3", [3], i64)], "v0")
        first = op("Slice", [first, "z0", const("s3", [S], i64), const("ax2", [2], i64)], "v0s")
        column = op("Add", [column, first], "column_data")
    combined = op("Concat", [scores, column], "combined", axis=-1)
    const("m1", [-1], i64)
    if v.max_shift:
        peak = op("ReduceMax", [combined, "m1"], "peak", keepdims=1)
        combined = op("Sub", [combined, peak], "shifted")
    probs = op("Softmax", [combined], "probs", axis=-1)
    if v.drop == "last":
        probs = op("Slice", [probs, "z0", "m1", "m1", "o1"], "dropped")
    else:
        probs = op("Slice", [probs, "o1", const("big", [2**62], i64), "m1", "o1"], "dropped")
    op("MatMul", [probs, "v"], "y")
    graph = helper.make_graph(
        nodes, "sinks", inputs, [helper.make_tensor_value_info("y", v.dtype, None)], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _feeds(seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    keep = rng.random((B, 1, S, T)) < 0.7
    keep[..., 0] = True
    keep[1, :, 1] = False  # one fully masked row: the sink takes everything, output 0
    return {
        "q": (2 * rng.standard_normal((B, N, S, H))).astype(dtype),
        "k": (2 * rng.standard_normal((B, N, T, H))).astype(dtype),
        "v": rng.standard_normal((B, N, T, H)).astype(dtype),
        "keep": keep,
        "input_ids": np.zeros((B, S), np.int64),
    }


def _apply(model: onnx.ModelProto, dtype: str = "float32"):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, get_ep("cpu"), dtype, OptimizeOptions())
    softmax = next(n for n in ir_model.graph if n.op_type == "Softmax")
    return ir_model, AttentionSinksToAttention().apply(softmax, ctx)


@pytest.mark.parametrize(
    "v",
    [
        Variant(),
        Variant(max_shift=False),
        Variant(dtype=TensorProto.FLOAT16),
        Variant(column="query-shape"),
    ],
    ids=["max-shifted", "plain-softmax", "float16", "query-shape-column"],
)
def test_sinks_become_attention_with_an_exact_correction(v):
    original = _graph(v)
    dtype = "float16" if v.dtype == TensorProto.FLOAT16 else "float32"
    lifted, outcome = _apply(original, dtype)
    assert isinstance(outcome, Rewritten), outcome
    proto = ir.to_proto(lifted)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Attention") == 1 and "Softmax" not in ops and "Concat" not in ops[-6:]
    attention = next(n for n in proto.graph.node if n.op_type == "Attention")
    attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["qk_matmul_output_mode"] == 2
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    sub = next(n for n in proto.graph.node if n.op_type == "Sub")
    np.testing.assert_array_equal(
        inits[sub.input[1]].reshape(-1), SINKS.astype(inits[sub.input[1]].dtype)
    )
    feeds = _feeds(dtype=np.float16 if dtype == "float16" else np.float32)
    tol = tolerance_for(dtype)
    got, ref = run_unoptimized(proto, feeds), run_unoptimized(original, feeds)
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), **vars(tol))
    assert np.abs(ref[1, :, 1]).max() < 1e-3  # the fully masked row is ~0 in both


def test_the_sink_changes_the_answer():
    """The correction is not a no-op on these inputs (so the equality above means something)."""
    original = _graph(Variant())
    lifted, _ = _apply(original)
    proto = ir.to_proto(lifted)
    for init in proto.graph.initializer:
        if init.name.endswith("head_sinks"):
            init.CopyFrom(
                numpy_helper.from_array(np.full((1, N, 1, 1), -30, np.float32), init.name)
            )
    feeds = _feeds()
    assert np.abs(run_unoptimized(proto, feeds) - run_unoptimized(original, feeds)).max() > 0.05


@pytest.mark.parametrize(
    "v, reason",
    [
        (Variant(column="per-query"), "vary with batch or query position"),
        (Variant(column="data"), "reads model inputs by value"),
    ],
    ids=["per-query-column", "data-column"],
)
def test_unproven_sinks_are_kept(v, reason):
    original = _graph(v)
    lifted, outcome = _apply(original)
    assert isinstance(outcome, Kept) and reason in outcome.message, outcome
    assert [n.op_type for n in ir.to_proto(lifted).graph.node] == [
        n.op_type for n in original.graph.node
    ]


def test_a_slice_that_keeps_the_sink_is_not_this_form():
    _, outcome = _apply(_graph(Variant(drop="first")))
    assert outcome is None
