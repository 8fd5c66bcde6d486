"""Experts written out per expert -> the batched experts form, then -> com.microsoft::MoE.

The graphs are real TorchScript traces (torch.onnx ``dynamo=False``, opset 18, what Hugging
Face Optimum runs) of the two forms transformers 4.57 has as Optimum patches them: Qwen3-MoE's
sparse block, a loop over every expert (``where`` of the expert's one-hot mask, the routed
rows, the expert's SwiGLU MLP times the routing weight, ``index_add_``), and GPT-OSS's dense
experts (every expert on every token, clamped interleaved SwiGLU with biases, times the dense
top-k routing matrix, summed over the experts). Known answer: the torch module at inputs other
than the trace's; the lifted and the lowered graph must equal it on ORT CPU."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.experts import (
    DenseExpertsToBatchedExperts,
    ExpertLoopToBatchedExperts,
)
from epfuse.patterns.canonicalize.identity_ops import SameTypeCast
from epfuse.patterns.lower.moe import ExpertsToMoE
from epfuse.tolerances import tolerance_for

H, INTER, E, K = 16, 8, 4, 2
LIMIT, ALPHA = 0.9, 1.702  # a clamp the random activations reach


class _MLP(nn.Module):
    def __init__(self, act=nn.functional.silu):
        super().__init__()
        self.gate_proj = nn.Linear(H, INTER, bias=False)
        self.up_proj = nn.Linear(H, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, H, bias=False)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LoopMoE(nn.Module):
    """transformers 4.57's Qwen3MoeSparseMoeBlock.forward as Optimum patches it (a loop over
    every expert); ``skip`` leaves experts out, as an unpatched trace over ``expert_hit`` does
    when its input routes no token to them."""

    def __init__(self, renormalize=False, skip=(), odd=None, first_slot=False):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        acts = [nn.functional.relu if e == odd else nn.functional.silu for e in range(E)]
        self.experts = nn.ModuleList(_MLP(a) for a in acts)
        self.renormalize, self.skip, self.first_slot = renormalize, set(skip), first_slot

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        routing = nn.functional.softmax(self.gate(hidden_states), dim=1, dtype=torch.float)
        routing, selected = torch.topk(routing, K, dim=-1)
        if self.renormalize:
            routing /= routing.sum(dim=-1, keepdim=True)
        routing = routing.to(hidden_states.dtype)
        final = torch.zeros((batch * seq, hidden), dtype=hidden_states.dtype)
        mask = nn.functional.one_hot(selected, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            if e in self.skip:
                continue
            idx, top_x = torch.where(mask[e].squeeze(0))
            current = hidden_states[None, top_x].reshape(-1, hidden)
            slot = torch.zeros_like(idx) if self.first_slot else idx
            out = self.experts[e](current) * routing[top_x, slot, None]
            final.index_add_(0, top_x, out.to(hidden_states.dtype))
        return final.reshape(batch, seq, hidden)


class DenseMoE(nn.Module):
    """GPT-OSS's router and the experts' forward Optimum patches in (every expert on every
    token, weighted by the scattered top-k softmax)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.router_w = nn.Parameter(torch.randn(E, H, generator=g) / 4)
        self.router_b = nn.Parameter(torch.randn(E, generator=g) / 4)
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * INTER, generator=g) / 3)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * INTER, generator=g) / 3)
        self.down_proj = nn.Parameter(torch.randn(E, INTER, H, generator=g) / 3)
        self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g) / 3)

    def forward(self, hidden_states):
        batch = hidden_states.shape[0]
        flat = hidden_states.reshape(-1, H)
        logits = nn.functional.linear(flat, self.router_w, self.router_b)
        top, indices = torch.topk(logits, K, dim=-1)
        top = nn.functional.softmax(top, dim=1, dtype=top.dtype)
        scores = torch.zeros_like(logits).scatter_(1, indices, top)
        rows = flat.repeat(E, 1).view(E, -1, H)
        gate_up = torch.bmm(rows, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=LIMIT)
        up = up.clamp(min=-LIMIT, max=LIMIT)
        glu = gate * torch.sigmoid(gate * ALPHA)
        out = torch.bmm((up + 1) * glu, self.down_proj) + self.down_proj_bias[..., None, :]
        out = out.view(E, batch, -1, H)
        out = out * scores.transpose(0, 1).view(E, batch, -1)[..., None]
        return out.sum(dim=0)


def _trace(module: nn.Module) -> onnx.ModelProto:
    torch.manual_seed(0)
    for p in module.parameters():
        if p.dim() == 2 and not isinstance(module, DenseMoE):
            nn.init.normal_(p, std=0.3)
    buffer = io.BytesIO()
    dims = {0: "batch", 1: "seq"}
    torch.onnx.export(
        module.eval(),
        (torch.randn(2, 5, H),),
        buffer,
        dynamo=False,
        opset_version=18,
        input_names=["hidden"],
        output_names=["out"],
        dynamic_axes={"hidden": dims, "out": dims},
    )
    return onnx.load_from_string(buffer.getvalue())


def _apply(model: ir.Model, rule, op_type: str) -> list:
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions())
    outcomes = []
    for node in list(model.graph):
        if node.op_type == op_type and node.graph is model.graph:
            outcome = rule.apply(node, ctx)
            if outcome is not None:
                outcomes.append(outcome)
    return outcomes


def _lift(proto: onnx.ModelProto, rule, op_type: str):
    """``rule`` on the trace after ``same-type-cast`` (as canonicalization runs: the trace's
    float32 -> float32 Cast of the softmax would hide it from experts-to-moe)."""
    model = ir.serde.deserialize_model(proto)
    _infer_types(model)
    _apply(model, SameTypeCast(), "Cast")
    return model, _apply(model, rule, op_type)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"hidden": x})[0]


def _inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.standard_normal(s).astype(np.float32) for s in ((1, 1, H), (1, 7, H), (3, 4, H))]


CASES = {
    "qwen3moe-loop": (lambda: LoopMoE(), ExpertLoopToBatchedExperts(), "Add", 0),
    "qwen3moe-loop-renormalized": (
        lambda: LoopMoE(renormalize=True),
        ExpertLoopToBatchedExperts(),
        "Add",
        1,
    ),
    "gptoss-dense": (lambda: DenseMoE(), DenseExpertsToBatchedExperts(), "ReduceSum", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_experts_lift_then_lower_to_moe_and_equal_the_module(case):
    make, rule, anchor, normalized = CASES[case]
    module = make()
    original = _trace(module)
    lifted, outcomes = _lift(original, rule, anchor)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Rewritten), outcomes
    lifted_proto = ir.to_proto(lifted)
    onnx.checker.check_model(lifted_proto)
    ops = [n.op_type for n in lifted_proto.graph.node]
    # The loop's per-expert branches, or the tokens tiled once per expert, are gone.
    gone = {"Tile"} if anchor == "ReduceSum" else {"NonZero", "ScatterElements", "OneHot"}
    assert not gone & set(ops), ops
    assert ops.count("GatherND") >= 2 and ops.count("TopK") == 1, ops

    lowered = _apply(lifted, ExpertsToMoE(), "ReduceSum")
    assert len(lowered) == 1 and isinstance(lowered[0], Rewritten), lowered
    lowered_proto = ir.to_proto(lifted)
    moe = [n for n in lowered_proto.graph.node if n.op_type == "MoE"]
    assert len(moe) == 1
    assert not {"TopK", "GatherND", "ScatterElements"} & {
        n.op_type for n in lowered_proto.graph.node
    }
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in moe[0].attribute}
    assert attrs["k"] == K and attrs["normalize_routing_weights"] == normalized
    if case == "gptoss-dense":
        assert attrs["swiglu_limit"] == pytest.approx(LIMIT)
        assert attrs["activation_alpha"] == pytest.approx(ALPHA)
        assert attrs["activation_beta"] == pytest.approx(1.0)

    tol = tolerance_for("float32")
    for x in _inputs():
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        for proto in (original, lifted_proto, lowered_proto):
            np.testing.assert_allclose(_run(proto, x), want, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (LoopMoE(skip=(2,)), "no branch for experts [2] of 4"),
        (LoopMoE(odd=1), "activations differ"),
    ],
    ids=["loop-missing-an-expert", "experts-with-different-activations"],
)
def test_loops_the_batched_form_cannot_state_are_kept(module, reason):
    original = _trace(module)
    lifted, outcomes = _lift(original, ExpertLoopToBatchedExperts(), "Add")
    assert len(outcomes) == 1 and isinstance(outcomes[0], Kept), outcomes
    assert reason in outcomes[0].message, outcomes[0].message
    assert "NonZero" in {n.op_type for n in ir.to_proto(lifted).graph.node}


def test_a_loop_with_the_wrong_routing_weight_is_caught_by_the_evaluation():
    """Each branch multiplies by the routing weight of the first slot whatever slot routed the
    token (``routing[top_x, 0]``): the same pieces in the same places, so matching accepts it;
    only the evaluation sees that it is not what the batched form computes, and refuses."""
    original = _trace(LoopMoE(first_slot=True))
    lifted, outcomes = _lift(original, ExpertLoopToBatchedExperts(), "Add")
    assert len(outcomes) == 1 and isinstance(outcomes[0], Kept), outcomes
    assert "does not compute what the experts compute" in outcomes[0].message
    assert "NonZero" in {n.op_type for n in ir.to_proto(lifted).graph.node}
