"""The identity-Reshape step of ``bsd_consumer``: only a Reshape that provably keeps the
(B, N, S, H) shape of the attention output may be skipped."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from epfuse.patterns._graph import Builder
from epfuse.patterns._layout import bsd_consumer, identity_reshape

N, H = 4, 16


def _graph(target_parts, allowzero=0, then_bsd=True):
    """y (batch, N, seq, H) -> Reshape(target) [-> Transpose -> Reshape(0, 0, N*H)]."""
    y = ir.Value(
        name="y", shape=ir.Shape(["batch", N, "seq", H]), type=ir.TensorType(ir.DataType.FLOAT)
    )
    ids = ir.Value(
        name="ids", shape=ir.Shape(["batch", "seq"]), type=ir.TensorType(ir.DataType.INT64)
    )
    anchor = ir.node("Identity", [ids])  # insertion point only; removed below
    graph = ir.Graph([y, ids], [], nodes=[anchor], opset_imports={"": 23})
    b = Builder(graph, anchor, "t")
    parts = []
    for part in target_parts:
        if part == "batch":
            parts.append(b.op("Shape", [ids], {"start": 0, "end": 1}))
        elif part == "seq":
            parts.append(b.op("Shape", [ids], {"start": 1, "end": 2}))
        else:
            parts.append(b.const("c", np.array([part], dtype=np.int64)))
    target = b.op("Concat", parts, {"axis": 0})
    viewed = b.op("Reshape", [y, target], {"allowzero": allowzero})
    out = viewed
    if then_bsd:
        t = b.op("Transpose", [viewed], {"perm": [0, 2, 1, 3]})
        out = b.op("Reshape", [t, b.const("bsd", np.array([0, 0, N * H], dtype=np.int64))])
    graph.outputs.append(out)
    graph.remove(anchor, safe=True)
    return graph, y, viewed, out


@pytest.mark.parametrize(
    "target",
    [
        ["batch", -1, "seq", H],
        ["batch", N, "seq", H],
        [0, -1, 0, H],
        ["batch", N, "seq", -1],
        [-1, N, "seq", H],  # every other axis matches y, so -1 can only be the batch
    ],
)
def test_identity_reshape_is_skipped(target):
    _, y, viewed, out = _graph(target)
    assert identity_reshape(y) is viewed
    assert bsd_consumer(y, N * H) is out


@pytest.mark.parametrize(
    "target",
    [
        ["seq", -1, "batch", H],  # batch and seq swapped
        ["batch", -1, "seq", 8],  # a different head size
        ["batch", 2 * N, -1, H // 2],  # heads split differently
        ["batch", -1, -1, H],  # ambiguous
        ["batch", N, "seq", H // 2, -1],  # another rank
    ],
)
def test_other_reshapes_are_not_skipped(target):
    _, y, _, _ = _graph(target)
    assert identity_reshape(y) is None
    assert bsd_consumer(y, N * H) is None


def test_allowzero_zero_is_not_a_copy():
    _, y, _, _ = _graph([0, -1, 0, H], allowzero=1)
    assert identity_reshape(y) is None


def _run(graph: ir.Graph, feeds):
    import onnxruntime as ort

    model = ir.Model(graph, ir_version=10)
    proto = ir.to_proto(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("through_transpose", [True, False])
def test_to_bsd_equals_transpose_reshape(through_transpose):
    """to_bsd of a (B, N, S, H) value is its (B, S, N*H) view; a value that is itself a
    [0, 2, 1, 3] Transpose is undone by a single Reshape of the transpose's input."""
    from epfuse.patterns._layout import to_bsd

    x = ir.Value(name="x", shape=ir.Shape([2, 3, N, H]), type=ir.TensorType(ir.DataType.FLOAT))
    anchor = ir.node("Identity", [x])
    graph = ir.Graph([x], [], nodes=[anchor], opset_imports={"": 23})
    b = Builder(graph, anchor, "t")
    normed = b.op("Neg", [x])  # stands for a per-head norm on (B, S, N, H)
    if through_transpose:
        value = b.op("Transpose", [normed], {"perm": [0, 2, 1, 3]})
    else:
        value = b.op("Neg", [b.op("Transpose", [normed], {"perm": [0, 2, 1, 3]})])
    before = len(b.nodes)
    bsd = to_bsd(b, value, N, H)
    added = [n.op_type for n in b.nodes[before:]]
    assert added == (["Reshape"] if through_transpose else ["Transpose", "Reshape"])
    graph.outputs.extend([bsd])
    graph.remove(anchor, safe=True)
    data = np.random.default_rng(0).standard_normal((2, 3, N, H)).astype(np.float32)
    (got,) = _run(graph, {"x": data})
    expected = -data if through_transpose else data
    np.testing.assert_array_equal(got, expected.reshape(2, 3, N * H))


@pytest.mark.parametrize(
    ("norm", "axis", "moved"),
    [
        ("RMSNormalization", -1, True),
        ("LayerNormalization", 3, True),
        ("RMSNormalization", 2, False),
    ],
)
def test_to_bsd_moves_a_last_axis_norm_before_the_transpose(norm, axis, moved):
    """q/k norm on (B, N, S, H) after the transpose (Gemma-3): normalizing the last axis
    commutes with [0, 2, 1, 3], so the norm runs on the untransposed input and no Transpose
    is added. A norm over more axes does not commute and gets the plain Transpose+Reshape."""
    from epfuse.patterns._layout import to_bsd

    x = ir.Value(name="x", shape=ir.Shape([2, 3, N, H]), type=ir.TensorType(ir.DataType.FLOAT))
    anchor = ir.node("Identity", [x])
    graph = ir.Graph([x], [], nodes=[anchor], opset_imports={"": 23})
    b = Builder(graph, anchor, "t")
    rng = np.random.default_rng(1)
    scale_shape = (H,) if axis in (-1, 3) else (3, H)  # axis 2 of (B, N, S, H): (S, H)
    inputs = [b.op("Transpose", [x], {"perm": [0, 2, 1, 3]})]
    inputs.append(b.const("scale", (1 + 0.1 * rng.standard_normal(scale_shape)).astype("f4")))
    if norm == "LayerNormalization":
        inputs.append(b.const("bias", (0.1 * rng.standard_normal(scale_shape)).astype("f4")))
    value = b.op(norm, inputs, {"axis": axis, "epsilon": 1e-5})
    reference = b.op(
        "Reshape",
        [
            b.op("Transpose", [value], {"perm": [0, 2, 1, 3]}),
            b.const("s", np.array([0, 0, N * H], dtype=np.int64)),
        ],
    )
    before = len(b.nodes)
    bsd = to_bsd(b, value, N, H)
    added = [n.op_type for n in b.nodes[before:]]
    assert added == ([norm, "Reshape"] if moved else ["Transpose", "Reshape"])
    graph.outputs.extend([bsd, reference])
    graph.remove(anchor, safe=True)
    data = rng.standard_normal((2, 3, N, H)).astype(np.float32)
    got, ref = _run(graph, {"x": data})
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("swap", [True, False])
def test_bsd_consumer_rejects_swapped_batch_and_sequence(swap):
    """The final Reshape to (B, S, N*H) must keep batch and sequence in place: a target
    built as (seq, batch, -1) has the right size but is another tensor."""
    _, y, _, _ = _graph(["batch", N, "seq", H], then_bsd=False)
    graph = y.graph
    anchor = ir.node("Identity", [y])
    graph.append(anchor)
    b = Builder(graph, anchor, "u")
    ids = graph.inputs[1]
    seq = b.op("Shape", [ids], {"start": 1, "end": 2})
    batch = b.op("Shape", [ids], {"start": 0, "end": 1})
    width = b.const("w", np.array([N * H], dtype=np.int64))
    y2 = graph.outputs[0]  # the identity view of y
    t = b.op("Transpose", [y2], {"perm": [0, 2, 1, 3]})
    t.shape = ir.Shape(["batch", "seq", N, H])
    parts = [seq, batch, width] if swap else [batch, seq, width]
    out = b.op("Reshape", [t, b.op("Concat", parts, {"axis": 0})])
    graph.outputs[0] = out
    graph.remove(anchor, safe=True)
    assert bsd_consumer(y, N * H) is (None if swap else out)


@pytest.mark.parametrize("known", ["query", "swapped", None])
def test_anonymous_attention_dims_are_read_from_the_query(known):
    """TorchScript leaves the attention output's batch and sequence anonymous (unk__N) while
    the exporter's Reshape target names the declared ones: the query's (batch, seq), which
    an Attention's output has, prove that the Reshape keeps them; swapped terms do not."""
    _, y, _, _ = _graph(["batch", N, "seq", H], then_bsd=False)
    graph = y.graph
    anchor = ir.node("Identity", [y])
    graph.append(anchor)
    b = Builder(graph, anchor, "u")
    ids = graph.inputs[1]
    batch = b.op("Shape", [ids], {"start": 0, "end": 1})
    seq = b.op("Shape", [ids], {"start": 1, "end": 2})
    t = b.op("Transpose", [graph.outputs[0]], {"perm": [0, 2, 1, 3]})
    t.shape = ir.Shape(["unk__1", "unk__2", N, H])
    width = b.const("w", np.array([N * H], dtype=np.int64))
    out = b.op("Reshape", [t, b.op("Concat", [batch, seq, width], {"axis": 0})])
    graph.outputs[0] = out
    graph.remove(anchor, safe=True)
    terms = {
        "query": (("sym", "batch"), ("sym", "seq")),
        "swapped": (("sym", "seq"), ("sym", "batch")),
    }
    assert bsd_consumer(y, N * H, terms.get(known)) is (out if known == "query" else None)
