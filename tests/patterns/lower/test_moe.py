"""Router + top-k + batched SwiGLU experts -> com.microsoft::MoE, on small graphs in the form
transformers' ``batched_mm`` experts export to (Mixtral/Qwen3-MoE: softmax, top-k, optional
renormalization, [gate | up] halves; GPT-OSS: top-k on the logits, then softmax, interleaved
clamped SwiGLU with biases). Each runs on ORT before and after, including tokens whose router
logits tie at the k-th place; routers MoE cannot express are kept with the reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from proto_graph import ProtoGraph

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.lower.moe import ExpertsToMoE
from epfuse.tolerances import tolerance_for

H, INTER, E, K = 16, 8, 4, 2
LIMIT, ALPHA = 0.9, 1.702


@dataclasses.dataclass
class Variant:
    style: str = "mixtral"  # "mixtral" ([gate|up], softmax first) | "gptoss" (interleaved)
    renormalize: bool = True  # mixtral style only (Qwen3-MoE's norm_topk_prob)
    router: str = "softmax"  # "softmax" | "sigmoid" (not expressible) | "smallest"


def _graph(v: Variant) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    f32 = np.float32
    g = ProtoGraph(const_dtype=np.int64)
    const, op, nodes, inits = g.const, g.op, g.nodes, g.inits

    router_bias = np.array([0.5, 0.5, 0.5, 0.0], f32)  # a zero token ties 3 experts for 2 places
    logits = op(
        "Add",
        [
            op("MatMul", ["x", const("wr", rng.standard_normal((H, E)) / 2, f32)], "rl"),
            const("br", router_bias, f32),
        ],
        "logits",
    )
    k = const("k", [K])
    largest = 0 if v.router == "smallest" else 1
    if v.style == "gptoss":
        top, idx = op("TopK", [logits, k], "top", 2, axis=-1, largest=largest, sorted=1)
        weights = op("Softmax", [top], "w", axis=1)
    else:
        scores = op("Sigmoid" if v.router == "sigmoid" else "Softmax", [logits], "p")
        top, idx = op("TopK", [scores, k], "top", 2, axis=-1, largest=largest, sorted=1)
        weights = top
        if v.renormalize:
            weights = op("Div", [top, op("ReduceSum", [top, const("a1", [1])], "ts")], "w")
    rep = op(
        "Expand", [op("Unsqueeze", ["x", const("u1", [1])], "xu"), const("ek", [1, K, 1])], "xe"
    )
    rep = op("Reshape", [rep, const("flat_h", [-1, H])], "xrep")
    gi = op(
        "Unsqueeze", [op("Reshape", [idx, const("flat", [-1])], "idxf"), const("um1", [-1])], "gi"
    )
    wf = op("Reshape", [weights, "flat"], "wf")
    if v.style == "gptoss":
        w1 = const("w1", rng.standard_normal((E, H, 2 * INTER)) / 3, f32)
        b1 = const("b1", 0.3 * rng.standard_normal((E, 2 * INTER)), f32)
        h = op(
            "MatMul", [op("Unsqueeze", [rep, "u1"], "xr1"), op("GatherND", [w1, gi], "w1g")], "h"
        )
        h = op("Add", [op("Squeeze", [h, "u1"], "hs"), op("GatherND", [b1, gi], "b1g")], "hb")
        end = const("end", [2**62])
        gate = op("Slice", [h, const("z", [0]), end, "um1", const("two", [2])], "gate")
        up = op("Slice", [h, const("o", [1]), end, "um1", "two"], "up")
        gate = op("Clip", [gate, "", const("lim", LIMIT, f32)], "gc")
        up = op("Clip", [up, const("nlim", -LIMIT, f32), "lim"], "uc")
        glu = op(
            "Mul",
            [gate, op("Sigmoid", [op("Mul", [gate, const("al", ALPHA, f32)], "ga")], "sg")],
            "glu",
        )
        act = op("Mul", [op("Add", [up, const("one", 1.0, f32)], "up1"), glu], "act")
        w2 = const("w2", rng.standard_normal((E, INTER, H)) / 3, f32)
        b2 = const("b2", 0.3 * rng.standard_normal((E, H)), f32)
        y = op(
            "MatMul", [op("Unsqueeze", [act, "u1"], "a1u"), op("GatherND", [w2, gi], "w2g")], "y"
        )
        y = op("Add", [op("Squeeze", [y, "u1"], "ys"), op("GatherND", [b2, gi], "b2g")], "yb")
    else:
        w1 = const("w1", rng.standard_normal((E, 2 * INTER, H)) / 3, f32)
        h = op(
            "MatMul", [op("GatherND", [w1, gi], "w1g"), op("Unsqueeze", [rep, "um1"], "xr1")], "h"
        )
        gate, up = op(
            "Split", [op("Squeeze", [h, "um1"], "hs")], "halves", 2, axis=1, num_outputs=2
        )
        act = op("Mul", [op("Mul", [gate, op("Sigmoid", [gate], "sg")], "silu"), up], "act")
        w2 = const("w2", rng.standard_normal((E, H, INTER)) / 3, f32)
        y = op(
            "MatMul", [op("GatherND", [w2, gi], "w2g"), op("Unsqueeze", [act, "um1"], "au")], "y"
        )
        y = op("Squeeze", [y, "um1"], "yb")
    weighted = op("Mul", [y, op("Unsqueeze", [wf, "um1"], "wu")], "weighted")
    per_slot = op("Reshape", [weighted, const("tkh", [-1, K, H])], "per_slot")
    op("ReduceSum", [per_slot, "u1"], "out", keepdims=0)
    graph = helper.make_graph(
        nodes,
        "experts",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", H])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


# The cpu record prefers the loop over the experts in float32 from a decode-weight threshold
# these tiny experts are far below; the tests are about the MoE lowering, whatever it becomes.
CPU_MOE = get_ep("cpu").variant("cpu-moe", experts_loop_min_decode_weights=None)


def _apply(model):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, CPU_MOE, "float32", OptimizeOptions())
    node = next(n for n in ir_model.graph if n.outputs[0].name == "out")
    return ir_model, ExpertsToMoE().apply(node, ctx)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize(
    "v",
    [Variant(), Variant(renormalize=False), Variant(style="gptoss")],
    ids=["mixtral-renormalized", "qwen3moe-plain-topk", "gptoss-clamped-swiglu"],
)
def test_experts_become_moe_and_compute_the_same(v):
    original = _graph(v)
    fused, outcome = _apply(original)
    assert isinstance(outcome, Rewritten), outcome
    proto = ir.to_proto(fused)
    onnx.checker.check_model(proto)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MoE") == 1 and not {"TopK", "GatherND", "ReduceSum"} & set(ops), ops
    moe = next(n for n in proto.graph.node if n.op_type == "MoE")
    attrs = {a.name: helper.get_attribute_value(a) for a in moe.attribute}
    assert attrs["normalize_routing_weights"] == int(v.style == "gptoss" or v.renormalize)
    if v.style == "gptoss":
        assert attrs["swiglu_limit"] == pytest.approx(LIMIT)
        assert attrs["activation_alpha"] == pytest.approx(ALPHA)
        assert attrs["activation_beta"] == pytest.approx(1.0)
    x = np.random.default_rng(5).standard_normal((9, H)).astype(np.float32)
    x[3] = 0.0  # router logits = bias: experts 0, 1, 2 tie for two places
    tol = tolerance_for("float32")
    np.testing.assert_allclose(_run(proto, x), _run(original, x), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize(
    "v, reason",
    [
        (Variant(router="sigmoid"), "no MoE candidate"),
        (Variant(router="smallest"), "smallest"),
    ],
    ids=["sigmoid-router", "smallest-k"],
)
def test_routers_moe_cannot_express_are_kept(v, reason):
    original = _graph(v)
    fused, outcome = _apply(original)
    assert isinstance(outcome, Kept) and reason in outcome.message, outcome
    assert len(ir.to_proto(fused).graph.node) == len(original.graph.node)


def test_ties_decide_the_expert_order():
    """ORT's MoE gives exact ties to the higher expert index, ONNX TopK to the lower: with
    three experts tied for two places only the reversed order matches the exported region,
    which is why the rule proves the order by evaluation and gathers the logits in reverse."""
    from epfuse.patterns._evaluate import SubgraphEvaluator
    from epfuse.patterns.lower import moe

    ir_model = ir.serde.deserialize_model(_graph(Variant()))
    _infer_types(ir_model)
    node = next(n for n in ir_model.graph if n.outputs[0].name == "out")
    experts = moe._match(node)
    region = SubgraphEvaluator(
        ir_model.graph, [node.outputs[0]], inputs=[experts.tokens, experts.logits]
    )
    x = np.random.default_rng(2).standard_normal((3, H)).astype(np.float32)
    logits = np.tile(np.array([0.5, 0.5, 0.5, 0.0], np.float32), (3, 1))
    (want,) = region({experts.tokens.name: x, experts.logits.name: logits})
    got = {}
    for reverse in (False, True):
        session = moe._candidate_session(experts, 1, reverse, TensorProto.FLOAT, np.float32)
        got[reverse] = session.run(None, {"x": x, "r0": logits})[0]
    assert np.abs(got[True] - want).max() < 1e-4
    assert np.abs(got[False] - want).max() > 1e-2


@pytest.mark.parametrize(
    "v",
    [Variant(), Variant(renormalize=False), Variant(style="gptoss"), Variant(router="sigmoid")],
    ids=["mixtral-renormalized", "qwen3moe-plain-topk", "gptoss-clamped-swiglu", "sigmoid-router"],
)
def test_without_moe_the_experts_become_a_loop_over_the_experts(v):
    """An EP without MoE gets one branch per expert (the rows routed to it, its MLP, ScatterND
    add) in place of the batched form's per-(token, slot) weight gathers; the graph's own
    top-k index and weights are reused, so even a router MoE cannot express (sigmoid) stays
    as it is, ties included."""
    from epfuse.patterns.lower.moe import ExpertsToLoop

    cpu = get_ep("cpu")
    rule = ExpertsToLoop()
    assert rule.requires(CPU_MOE.dtypes["float32"], CPU_MOE) == "cpu-moe runs com.microsoft::MoE"
    assert rule.requires(cpu.dtypes["float16"], cpu) == "cpu runs com.microsoft::MoE"
    assert rule.requires(cpu.dtypes["float32"], cpu) is None  # the cost threshold needs it
    no_moe = cpu.variant("cpu-no-moe", moe=False)
    assert rule.requires(no_moe.dtypes["float32"], no_moe) is None
    original = _graph(v)
    ir_model = ir.serde.deserialize_model(original)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, no_moe, "float32", OptimizeOptions())
    node = next(n for n in ir_model.graph if n.outputs[0].name == "out")
    outcome = rule.apply(node, ctx)
    assert isinstance(outcome, Rewritten) and not outcome.fused, outcome
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("NonZero") == E and ops.count("ScatterND") == E, ops
    assert "GatherND" not in ops, ops
    assert next(n for n in proto.graph.node if "out" in n.output).op_type == "ScatterND"
    tol = tolerance_for("float32")
    for tokens in (1, 9):
        x = np.random.default_rng(tokens).standard_normal((tokens, H)).astype(np.float32)
        x[tokens // 2] = 0.0  # router logits = bias: experts 0, 1, 2 tie for two places
        np.testing.assert_allclose(_run(proto, x), _run(original, x), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("opset", [18, 15])
def test_the_loop_is_chosen_from_the_decode_weight_threshold(opset):
    """Where the record measured the loop faster than MoE from some decode weights per expert
    (``experts_loop_min_decode_weights``, ORT CPU float32), experts-to-moe leaves experts at or
    above it to legalize-experts-to-loop and lowers those below it, except where the loop
    cannot be emitted (ScatterND add needs opset 16): MoE takes them whatever the threshold."""
    from epfuse.patterns.lower.moe import ExpertsToLoop

    cpu = get_ep("cpu")
    assert cpu.ops("float32").experts_loop_min_decode_weights == 450_000
    assert cpu.ops("float16").experts_loop_min_decode_weights is None
    original = _graph(Variant(style="gptoss"))  # no Split: valid at opset 15 too
    original.opset_import[0].version = opset
    work = K * (2 * INTER * H + H * INTER) // E  # top k x weights per expert / experts
    for threshold, cheaper in ((work, True), (work + 1, False)):
        record = cpu.variant("cpu-threshold", experts_loop_min_decode_weights=threshold)
        ir_model = ir.serde.deserialize_model(original)
        _infer_types(ir_model)
        ctx = RewriteContext(ir_model, record, "float32", OptimizeOptions())
        node = next(n for n in ir_model.graph if n.outputs[0].name == "out")
        moe = ExpertsToMoE().apply(node, ctx)
        if cheaper and opset >= 16:
            assert moe is None, moe
            outcome = ExpertsToLoop().apply(node, ctx)
            assert isinstance(outcome, Rewritten), outcome
            assert f"measured faster than MoE on cpu-threshold float32 at {work} " in outcome.note
            want = "ScatterND"
        else:
            assert isinstance(moe, Rewritten), moe
            want = "MoE"
        proto = ir.to_proto(ir_model)
        assert next(n for n in proto.graph.node if "out" in n.output).op_type == want
        tol = tolerance_for("float32")
        x = np.random.default_rng(3).standard_normal((7, H)).astype(np.float32)
        got, expected = _run(proto, x), _run(original, x)
        np.testing.assert_allclose(got, expected, atol=tol.atol, rtol=tol.rtol)


def test_decode_weights_per_expert_of_real_blocks():
    """The threshold's measure at real blocks (weights as zero-copy views of their shapes):
    Qwen3-30B-A3B's stays below the cpu threshold (its MoE decoded 1.18-1.25x faster than the
    loop, benchmarks/moe_shapes.py), as does the same width with 96 experts (0.92-1.01x); 64
    experts (1.04-1.08x), Mixtral-8x7B's and GPT-OSS-20B's are above it."""
    from types import SimpleNamespace

    from epfuse.patterns.lower.moe import decode_weights_per_expert

    def block(hidden, inter, experts, k):
        def weight(*shape):
            return SimpleNamespace(weight=np.broadcast_to(np.float32(0), shape))

        fc1, fc2 = weight(experts, 2 * inter, hidden), weight(experts, hidden, inter)
        return decode_weights_per_expert(SimpleNamespace(k=k, fc1=fc1, fc2=fc2))

    threshold = get_ep("cpu").ops("float32").experts_loop_min_decode_weights
    assert block(2048, 768, 128, 8) == 294_912 < threshold  # Qwen3-30B-A3B
    assert block(2048, 768, 96, 8) == 393_216 < threshold
    assert block(2048, 768, 64, 8) == 589_824 > threshold
    assert block(4096, 14336, 8, 2) == 44_040_192  # Mixtral-8x7B
    assert block(2880, 2880, 32, 4) == 3_110_400  # GPT-OSS-20B
