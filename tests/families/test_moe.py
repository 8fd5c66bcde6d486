"""Mixture-of-experts decoders (tiny Mixtral and Qwen3-MoE, 2 layers, transformers'
``batched_mm`` experts) exported by torch.onnx at opset 23, end to end on CPU: the export is
the Hugging Face model; on cpu every layer's attention becomes GroupQueryAttention and every
layer's experts one com.microsoft::MoE with the router semantics the family has (Mixtral
renormalizes its top 2, Qwen3-MoE with norm_topk_prob=False does not); with the loop preferred
at their size (the cpu float32 record does so from a decode-weight threshold real Mixtral
blocks pass), the loop over the experts. Both are equivalent in every scenario. GPT-OSS's
clamped-SwiGLU experts are checked in test_gpt_oss. PhiMoE (opsets 18 and 23) fuses its
attention; ORT's use_sparse_mixer MoE does not compute its sparsemixer router, so the
evaluation refuses MoE (NOT_PROVEN), and on cpu float32 the loop, which keeps the graph's own
router, takes its experts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from export_runs import assert_prompt_matches_hf, export_and_optimize, run_cpu

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns.reasons import ReasonCode
from epfuse.testing.hf_export import hf_reference
from epfuse.testing.hf_families import KEPT_EXPERTS_FAMILIES, MOE_FAMILIES
from epfuse.tolerances import tolerance_for

pytestmark = pytest.mark.slow

PROMPT, PAST = 9, 8
CPU_LOOP = get_ep("cpu").variant("cpu-loop", experts_loop_min_decode_weights=0)
MOE_ONLY = get_ep("cpu").variant("cpu-moe-only", experts_loop_min_decode_weights=None)
RENORMALIZED = {"mixtral": 1, "qwen3-moe": 0}


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def exported(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("moe") / f"{name}.onnx"
    original, optimized, report = export_and_optimize(MOE_FAMILIES[name].make_config(), path, 23)
    return name, original, optimized, report


def test_export_matches_hugging_face(exported):
    name, original, _, _ = exported
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, PROMPT), dtype=np.int64)
    mask = np.ones((2, PROMPT), dtype=np.int64)
    pos = np.tile(np.arange(PROMPT, dtype=np.int64), (2, 1))
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    for i in original.graph.input:
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((2, 2, 0, 16), np.float32)
    got = run_cpu(original, feeds)
    ref, _ = hf_reference(MOE_FAMILIES[name].make_config(), 0, ids, mask, pos, None)
    tol = tolerance_for("float32")
    np.testing.assert_allclose(got[0], ref, atol=tol.atol, rtol=tol.rtol)


def test_attention_and_experts_fuse(exported):
    """These tiny experts are far below the cpu record's decode-weight threshold for the
    loop: each layer's experts become one MoE."""
    name, _, optimized, report = exported
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    moe = [n for n in optimized.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2
    for node in moe:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["k"] == 2 and attrs["activation_type"] == b"swiglu"
        assert attrs["normalize_routing_weights"] == RENORMALIZED[name]
        assert attrs["activation_alpha"] == 1.0 and attrs["activation_beta"] == 0.0
        assert "swiglu_limit" not in attrs
    for op in ("TopK", "GatherND", "NonZero"):
        assert not any(n.op_type == op for n in optimized.graph.node), op
    rules = {r.name: r for r in report.rules}
    assert rules["experts-to-moe"].rewritten == 2 and not rules["experts-to-moe"].kept
    assert rules["legalize-experts-to-loop"].rewritten == 0


def _experts(config) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def test_with_the_loop_preferred_the_experts_become_the_loop(exported):
    """Where the record prefers the loop at these experts' size (threshold 0 here; real
    Mixtral blocks are past the cpu threshold), experts-to-moe leaves them to the loop."""
    name, original, _, _ = exported
    optimized, report = epfuse.optimize_with_report(original, CPU_LOOP)
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "MoE" not in ops, sorted(set(ops))
    assert ops.count("NonZero") == 2 * _experts(MOE_FAMILIES[name].make_config()), ops
    for op in ("GatherND", "Tile"):
        assert op not in ops, op
    rules = {r.name: r for r in report.rules}
    assert rules["legalize-experts-to-loop"].rewritten == 2, report.summary()
    assert rules["experts-to-moe"].rewritten == 0 and not rules["experts-to-moe"].kept
    assert_equivalent(
        original, optimized, prompt_len=PROMPT, decode_past_len=PAST, chunk_past_len=PAST
    )


def test_optimized_is_equivalent(exported):
    _, original, optimized, _ = exported
    assert_equivalent(
        original, optimized, prompt_len=PROMPT, decode_past_len=PAST, chunk_past_len=PAST
    )


def test_an_ep_without_moe_keeps_the_experts(exported):
    _, original, _, _ = exported
    no_moe = get_ep("cpu").variant("cpu-no-moe", moe=False)
    optimized, report = epfuse.optimize_with_report(original, no_moe)
    assert not any(n.op_type == "MoE" for n in optimized.graph.node)
    rule = next(r for r in report.rules if r.name == "experts-to-moe")
    assert not rule.selected


@pytest.fixture(scope="module", params=[18, 23])
def phimoe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("phimoe") / f"phimoe-{request.param}.onnx"
    config = KEPT_EXPERTS_FAMILIES["phimoe"].make_config()
    return export_and_optimize(config, path, request.param)


def test_phimoe_attention_fuses_and_experts_become_the_loop(phimoe):
    """Both layers' sparsemixer routers are recognized (not FORM) and refused by evaluation for
    MoE; on cpu float32 the loop, which keeps the graph's own router, takes them instead. A
    record with MoE and no loop (as GPU EPs) keeps them as exported."""
    original, optimized, report = phimoe
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("GroupQueryAttention") == 2, report.summary()
    assert "MoE" not in ops and "GatherND" not in ops, sorted(set(ops))
    rules = {r.name: r for r in report.rules}
    moe = rules["experts-to-moe"]
    assert moe.rewritten == 0 and moe.kept == 2, moe
    assert set(moe.kept_codes) == {ReasonCode.NOT_PROVEN.value}, moe
    assert rules["legalize-experts-to-loop"].rewritten == 2, report.summary()
    assert_equivalent(
        original, optimized, prompt_len=PROMPT, decode_past_len=PAST, chunk_past_len=PAST
    )
    kept, report = epfuse.optimize_with_report(original, MOE_ONLY)
    ops = {n.op_type for n in kept.graph.node}
    assert "MoE" not in ops and "NonZero" not in ops and "GatherND" in ops, sorted(ops)
    rule = next(r for r in report.rules if r.name == "experts-to-moe")
    assert rule.rewritten == 0 and rule.kept == 2, rule


def test_phimoe_export_matches_hugging_face(phimoe):
    config = KEPT_EXPERTS_FAMILIES["phimoe"].make_config()
    assert_prompt_matches_hf(config, phimoe[0], PROMPT)
