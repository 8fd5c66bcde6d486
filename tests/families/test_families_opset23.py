"""Real torch.onnx opset-23 exports of Hugging Face decoder families, end to end on CPU.

For each family (tiny local config, random weights at ``export_hf_decoder``'s scale) and one
export per session:

1. the export computes what the Hugging Face model computes (prompt and decode with a past);
2. ``optimize(ep="cpu")`` turns every attention layer into GroupQueryAttention, with the
   rotary, sliding window and softcap each layer needs, and the report says so per layer
   (and why RoPE stayed outside where it did);
3. the optimized model is equivalent to the export in every scenario, with prompt and past
   lengths beyond any sliding window.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import pytest
from export_runs import assert_matches_hf, export_and_optimize

import epfuse
from epfuse.optimizer.verify import assert_equivalent
from epfuse.testing.hf_families import FAMILIES, SLIDING_WINDOW

pytestmark = pytest.mark.slow

W = SLIDING_WINDOW
NOT_ROTATED = "Q and K are not rotated by a RotaryEmbedding"


@dataclasses.dataclass(frozen=True)
class Expected:
    """What each layer should become on the CPU EP."""

    rotary: bool = True
    windows: tuple[int | None, ...] = (None, None)
    softcap: float = 0.0
    rope_reason: str | None = None
    """Substring of the report's reason when the rotation stays outside GQA."""


EXPECTED: dict[str, Expected] = {
    "llama3": Expected(),
    "llama-linear": Expected(),
    # yarn scales cos/sin by its attention factor; torch.onnx then leaves RoPE decomposed
    # (rotate_half arithmetic, the opset-18 form): canonicalize/rotate_half lifts it, and
    # rope_caches folds the attention factor into the caches.
    "llama-yarn": Expected(),
    "qwen2": Expected(),
    "mistral": Expected(windows=(W, W)),
    "gemma2": Expected(windows=(W, None), softcap=5.0),
    "qwen3": Expected(),
    "phi3": Expected(),
    "stablelm": Expected(),
    "gemma3": Expected(windows=(W, None, W, None)),
    # GLM's interleaved partial rotary is exported decomposed as well, with cos/sin's first
    # halves repeated pairwise after the head unsqueeze: rotate_half lifts it (interleaved).
    "glm": Expected(),
    "olmo2": Expected(),
    "nemotron": Expected(),  # partial rotary 0.5 of head_dim 32
    "olmo": Expected(),  # the clip_qkv Clips stay ahead of the fused rotary
    "olmo3": Expected(windows=(W, None)),
    "gemma": Expected(),
    "ernie4_5": Expected(),  # GLM's interleaved form at full width
    # HunYuan normalizes Q and K *after* RoPE: GQA would rotate after the norm, so the
    # RotaryEmbedding stays ahead of the norm, outside GQA.
    "hunyuan-dense": Expected(rotary=False, rope_reason=NOT_ROTATED),
}
assert set(EXPECTED) == set(FAMILIES)
INTERLEAVED = {"glm", "ernie4_5"}  # rotate-every-two: GQA's rotary_interleaved

PROMPT, PAST = 2 * W + 1, 2 * W  # longer than any sliding window


@dataclasses.dataclass
class _Exported:
    path: Path
    original: onnx.ModelProto
    optimized: onnx.ModelProto
    report: epfuse.Report


@pytest.fixture(scope="session")
def family_cache(tmp_path_factory) -> dict[str, _Exported]:
    return {}


@pytest.fixture
def family(request, family_cache, tmp_path_factory) -> tuple[str, _Exported]:
    name = request.param
    if name not in family_cache:
        path = tmp_path_factory.mktemp("families") / f"{name}.onnx"
        original, optimized, report = export_and_optimize(FAMILIES[name].make_config(), path, 23)
        family_cache[name] = _Exported(path, original, optimized, report)
    return name, family_cache[name]


def _gqa_attrs(model: onnx.ModelProto) -> list[dict]:
    return [
        {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        for n in model.graph.node
        if n.op_type == "GroupQueryAttention"
    ]


def _ops(model: onnx.ModelProto, op: str) -> int:
    return sum(n.op_type == op for n in model.graph.node)


FAMILY_PARAMS = pytest.mark.parametrize("family", list(FAMILIES), indirect=True)


@FAMILY_PARAMS
def test_export_matches_hugging_face(family):
    """The exported graph itself is the HF model: prompt, then one decode step on its past."""
    name, exported = family
    assert_matches_hf(FAMILIES[name].make_config(), exported.original, PROMPT, decode=True)


@FAMILY_PARAMS
def test_every_layer_becomes_gqa_as_expected(family):
    name, exported = family
    expected = EXPECTED[name]
    report, optimized = exported.report, exported.optimized
    layers = len(expected.windows)
    assert len(report.layers) == layers, report.summary()
    assert report.fused_layers == layers, report.summary()
    assert _ops(optimized, "Attention") == 0
    attrs = _gqa_attrs(optimized)
    assert len(attrs) == layers
    for i, (layer, a) in enumerate(zip(report.layers, attrs, strict=True)):
        details = "; ".join(layer.notes + layer.reasons)
        assert layer.result == f"GroupQueryAttention(do_rotary={int(expected.rotary)})", details
        assert a["do_rotary"] == int(expected.rotary)
        assert a.get("rotary_interleaved", 0) == int(name in INTERLEAVED and expected.rotary)
        assert a.get("local_window_size", -1) == (expected.windows[i] or -1), details
        assert a.get("softcap", 0.0) == pytest.approx(expected.softcap)
        assert ("sliding window" in details) == (expected.windows[i] is not None), details
        if expected.softcap:
            assert f"softcap {expected.softcap:g}" in details
        if expected.rope_reason:
            assert expected.rope_reason in details
    if expected.rotary:
        # the rotation moved into GQA entirely: no run-time cos/sin remain
        for op in ("RotaryEmbedding", "Cos", "Sin"):
            assert _ops(optimized, op) == 0, op
        # and GQA reads Q/K/V in the exporter's (B, S, N*H) layout (through q/k norms too):
        # no Transpose is left on activations (a tied lm_head weight may keep its own)
        weights = {i.name for i in optimized.graph.initializer}
        moved = [n.input[0] for n in optimized.graph.node if n.op_type == "Transpose"]
        assert all(name in weights for name in moved), moved


@FAMILY_PARAMS
def test_optimized_is_equivalent_beyond_the_window(family):
    _, exported = family
    assert_equivalent(
        exported.original,
        exported.optimized,
        prompt_len=PROMPT,
        decode_past_len=PAST,
        chunk_past_len=PAST,
        chunk_len=3,
        padded_lens=(PROMPT, W - 1),
    )


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)
def test_gemma2_final_logit_softcap_stays(family):
    """The attention softcaps move into GQA; the final logit softcap (Tanh on the logits)
    is not attention and stays in the graph."""
    _, exported = family
    layers = len(EXPECTED["gemma2"].windows)
    assert _ops(exported.original, "Tanh") == layers + 1
    assert _ops(exported.optimized, "Tanh") == 1
    producers = {o: n for n in exported.optimized.graph.node for o in n.output}
    node = producers["logits"]
    seen = []
    while node is not None and node.op_type != "Tanh" and len(seen) < 4:
        seen.append(node.op_type)
        node = producers.get(node.input[0])
    assert node is not None and node.op_type == "Tanh", seen


@pytest.mark.parametrize("family", ["qwen3", "olmo2"], indirect=True)
def test_qk_norm_stays_ahead_of_gqa(family):
    """The CPU GQA has no q/k-norm inputs: the per-head (Qwen3) or full-width (OLMo-2)
    RMSNorm on Q and K stays in the graph, ahead of the fused rotary."""
    _, exported = family
    graph = exported.optimized.graph
    producers = {o: n for n in graph.node for o in n.output}

    def normed(value: str) -> bool:
        # Walk back from a GQA input to its projection MatMul, looking for the norm.
        node = producers.get(value)
        while node is not None and node.op_type != "MatMul":
            if node.op_type == "RMSNormalization":
                return True
            node = producers.get(node.input[0])
        return False

    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(normed(n.input[0]) and normed(n.input[1]) for n in gqa)
    assert all(len(n.input) <= 14 or not n.input[14] for n in gqa)  # no q_norm_weight
    assert all("q_norm_weight" not in a for a in _gqa_attrs(exported.optimized))


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
def test_fused_qkv_split_needs_no_layout_ops(family):
    """Phi-3 slices Q, K, V out of one qkv_proj MatMul (already the (B, S, N*H) layout GQA
    takes) and re-views the attention output as (B, -1, S, H) before transposing it back:
    both sides are recognized, so no Transpose is left or inserted."""
    _, exported = family
    assert _ops(exported.optimized, "Transpose") == 0
    gqa = [n for n in exported.optimized.graph.node if n.op_type == "GroupQueryAttention"]
    producers = {o: n for n in exported.optimized.graph.node for o in n.output}
    for node in gqa:
        assert [producers[i].op_type for i in node.input[:3]] == ["Slice"] * 3


@pytest.mark.parametrize("family", ["gemma2", "mistral", "gemma3"], indirect=True)
def test_default_verify_and_fuzz_catch_a_lost_window(family, tmp_path, capsys):
    """The defect peers ship (mobius' cpu builds of Gemma-2/Gemma-3): the window dropped from
    every sliding layer, here GQA's ``local_window_size`` set to -1 in the epfuse output. The
    default ``epfuse verify`` reads the window from the export's evaluated mask and runs past
    it; ``epfuse fuzz`` passes the honest rewrite and shrinks the defect to a replay."""
    from epfuse.optimizer.cli import main
    from epfuse.optimizer.verify import compare_models
    from epfuse.optimizer.verify.scenarios import parse_scenario
    from epfuse.testing.fuzz import fuzz_models

    _, exported = family
    mutant = onnx.ModelProto.FromString(exported.optimized.SerializeToString())
    touched = 0
    for node in mutant.graph.node:
        for a in node.attribute:
            if node.op_type == "GroupQueryAttention" and a.name == "local_window_size":
                touched += a.i > 0
                a.i = -1
    assert touched
    onnx.save(mutant, tmp_path / "mutant.onnx")
    onnx.save(exported.optimized, tmp_path / "honest.onnx")
    assert main(["verify", str(exported.path), str(tmp_path / "honest.onnx")]) == 0
    assert main(["verify", str(exported.path), str(tmp_path / "mutant.onnx")]) == 4
    out = capsys.readouterr().out
    assert f"sliding window {W}" in out
    assert "FAIL (prompt" in out.splitlines()[-1]

    assert fuzz_models(exported.original, exported.optimized, examples=40, budget=50).passed
    caught = fuzz_models(exported.original, mutant, budget=50)
    assert not caught.passed
    failure = caught.failure
    assert len(failure.scenarios) == 1  # shrunk
    cases = [parse_scenario(s.name) for s in failure.scenarios]
    assert not compare_models(exported.original, mutant, scenarios=cases, seed=failure.seed)
