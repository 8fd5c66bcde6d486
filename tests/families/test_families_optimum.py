"""Hugging Face Optimum exports (TorchScript exporter, Optimum's default opset 18 and
``--opset 14``) fuse like dynamo exports, per layer, and stay equal to the export in every
scenario.

Optimum's graphs build the mask with ``Where(bool, 0, -inf)`` and a NaN guard after the
softmax (proven inert by evaluating the mask), shapes through ``Shape``/``Gather``/``Concat``
chains of ``Constant`` nodes (derived by ``analysis.shapes``), repeat_kv through
``Expand``/``Reshape`` of those, and the KV cache as ``Concat(past, new)``. Each export is first
checked against the Hugging Face model it came from (transformers 4.57), then the optimized
model against the export with prompts and pasts longer than the sliding window. At opset 14 the export is raised to opset 23 first (ReduceMean's axes
attribute, ops revised since 14) and must fuse exactly as the opset-18 export does, with no
reason citing the opset.

One export per family, two layers (Gemma-3: four, to have both layer types twice): CI has 2
cores. Expectations are the dynamo tables', except where Optimum's interface differs:
Gemma (1, 2, 3) and Nemotron exports have no ``position_ids`` input (the rotation reads
``arange(past, past + seq)`` computed in the graph from the cache length): evaluation proves
them fused rotary's when given to GroupQueryAttention as ``position_ids`` (not GQA's own, which
continue a padded row at its length), so they fuse with ``do_rotary=1`` and stay equal even
in the decode after a padded prompt that verify skips for them; and transformers 4.x's sdpa
attention drops Gemma-2's softcap (see ``test_families_transformers4``).
"""

from __future__ import annotations

import onnx
import pytest
from export_runs import assert_prompt_matches_hf, padded_decode_logits_diff
from families.test_families_opset18 import EXPECTED as EXPECTED_18

import epfuse
from epfuse.optimizer.verify import compare_models
from epfuse.testing.hf_families import ALL_FAMILIES, SLIDING_WINDOW
from epfuse.tolerances import tolerance_for

pytestmark = [pytest.mark.slow, pytest.mark.optimum]

W = SLIDING_WINDOW
PROMPT, PAST = 2 * W + 1, 2 * W  # longer than any sliding window
# Rotated at positions computed in the graph (no position_ids input), fed to GQA as such.
COMPUTED_POSITIONS = {"gemma", "gemma2", "gemma3", "nemotron"}

# family -> (do_rotary per layer, window per layer, softcap)
EXPECTED: dict[str, tuple[tuple[int, ...], tuple[int | None, ...], float]] = {
    name: ((EXPECTED_18[name][0],) * len(EXPECTED_18[name][1]), EXPECTED_18[name][1], 0.0)
    for name in ("llama3", "qwen2", "mistral", "phi3", "qwen3")
}
EXPECTED.update(
    {
        "granite": ((1, 1), (None, None), 0.0),
        "smollm3": ((1, 0), (None, None), 0.0),  # layer 1 is NoPE: nothing to rotate
        "cohere": ((1, 1), (None, None), 0.0),  # interleaved rotary
        "phi2": ((1, 1), (None, None), 0.0),  # partial rotary, LayerNorm, parallel MLP
        "gemma2": ((1, 1), (W, None), 0.0),
        "gemma3": ((1, 1, 1, 1), (W, None, W, None), 0.0),
        "olmo": ((1, 1), (None, None), 0.0),  # weightless LayerNorm, clip_qkv
        "gemma": ((1, 1), (None, None), 0.0),  # Gemma 1: no position_ids input, as Gemma-2/3
        # transformers 4.57 slices their masks to key_states.shape[-2]: layer 1's mask reads
        # layer 0's output by shape (cut at the key's inferred shape, analysis.mask_proof).
        "stablelm": ((1, 1), (None, None), 0.0),  # partial rotary, LayerNorm, biases
        "nemotron": ((1, 1), (None, None), 0.0),  # no position_ids input, partial rotary
    }
)
# Not in optimum-onnx 0.1.0 (main_export: "Trying to export a olmo3 model, that is a custom or
# unsupported architecture, but no custom onnx configuration was passed"): OLMo-3, Ernie 4.5,
# HunYuan dense.
INTERLEAVED = {"cohere"}
# Optimum's Phi config reads no num_key_value_heads (its dummy past has num_attention_heads
# heads), so Phi-2 is exported as the multi-head model Phi-2 is.
MULTI_HEAD = {"phi2"}
NOPE = {("smollm3", 1)}
# None is Optimum's default (18 for these families); 14 is the lowest opset Optimum exports.
OPSETS = (None, 14)
CASES = [(name, opset) for opset in OPSETS for name in EXPECTED]


@pytest.mark.parametrize(
    ("name", "opset"), CASES, ids=[f"{n}-opset{o or 'default'}" for n, o in CASES]
)
def test_optimum_export_fuses_and_stays_equal(name, opset, tmp_path):
    from epfuse.testing.optimum_export import export_optimum_decoder

    config = ALL_FAMILIES[name].make_config()
    if name in MULTI_HEAD:
        config.num_key_value_heads = config.num_attention_heads
    original = onnx.load(str(export_optimum_decoder(config, tmp_path / name, opset=opset)))
    if opset is not None:
        assert original.opset_import[0].version == opset
    assert_prompt_matches_hf(config, original, PROMPT)

    optimized, report = epfuse.optimize_with_report(original, "cpu")
    reasons = [r for rule in report.rules for r in rule.kept_reasons]
    reasons += [r for layer in report.layers for r in layer.reasons]
    assert not [r for r in reasons if "opset" in r], report.summary()
    rotary, windows, softcap = EXPECTED[name]
    assert len(report.layers) == len(windows), report.summary()
    for index, (layer, do_rotary, window) in enumerate(
        zip(report.layers, rotary, windows, strict=True)
    ):
        assert layer.fused, report.summary()
        assert layer.result == f"GroupQueryAttention(do_rotary={do_rotary})", report.summary()
        mask = "causal + padding" + (f" + sliding window {window}" if window else "")
        note = layer.notes[0].split("; ")
        assert note[0] == mask, report.summary()
        if not do_rotary:
            assert (name, index) in NOPE, report.summary()
            assert any("not rotated" in part for part in note[1:]), report.summary()
        if name in COMPUTED_POSITIONS:
            assert any("fed as position_ids" in part for part in note[1:]), report.summary()
        assert not layer.codes, report.summary()
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    for node, do_rotary, window in zip(gqa, rotary, windows, strict=True):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == do_rotary
        assert attrs.get("rotary_interleaved", 0) == int(name in INTERLEAVED and do_rotary)
        assert attrs.get("local_window_size", -1) == (window if window else -1)
        assert attrs.get("softcap", 0.0) == pytest.approx(softcap)
    ops = {n.op_type for n in optimized.graph.node}
    assert not ops & {"Softmax", "IsNaN"}, sorted(ops)
    assert {o.domain: o.version for o in optimized.opset_import}[""] == 23
    if all(rotary):
        assert not ops & {"Cos", "Sin"}, sorted(ops)

    graph_inputs = {value.name for value in optimized.graph.input}
    for node, do_rotary in zip(gqa, rotary, strict=True):
        fed = node.input[9] if len(node.input) > 9 else ""  # position_ids
        if not do_rotary:
            assert not fed, node.input  # nothing to rotate
        elif name in COMPUTED_POSITIONS:  # computed in the graph, proven, fed as position_ids
            assert fed and fed not in graph_inputs, node.input
        else:  # the export's own position_ids input
            assert fed in graph_inputs, node.input
        if name == "nemotron":  # partial rotary: the cache covers half of head_dim
            cos = next(i for i in optimized.graph.initializer if i.name == node.input[7])
            assert list(cos.dims)[1] * 2 < config.head_dim, list(cos.dims)

    result = compare_models(original, optimized, prompt_len=PROMPT, decode_past_len=PAST)
    assert result.passed, str(result)
    if name in COMPUTED_POSITIONS and not any(windows):
        # verify skips this scenario (the export's rows differ from the rows run alone); the fed
        # positions keep it equal. (A sliding window over the concat cache's slots, padding
        # holes included, differs from GQA's compact cache whatever the positions.)
        diff = padded_decode_logits_diff(original, optimized, [PROMPT, 3])
        assert diff <= tolerance_for("float32").atol, diff


def test_gpt_oss_fuses_every_layer_with_its_sinks(tmp_path):
    """Optimum's GPT-OSS (transformers 4.57 eager attention with sinks; its softmax is cast
    back to float32 before the sink column is dropped, a Cast ``same-type-cast`` removes):
    both layers become GroupQueryAttention with head_sink, the sliding one with its window,
    and the model stays equal to the export. The full layer's sink column and mask read the
    shapes of its Q and K, computed after the first layer's experts (tokens flattened to
    batch*seq and routed by value): ``analysis.shapes`` derives them back to input dims, and
    the proofs cut there (``ShapeCut``). Q and K are rotated by constant-cache
    RotaryEmbedding nodes at positions computed in the graph, as in Optimum's Gemma exports:
    GroupQueryAttention takes the rotation (do_rotary=1) with those positions fed as
    position_ids."""
    from epfuse.testing.hf_families import SINK_FAMILIES
    from epfuse.testing.optimum_export import export_optimum_decoder

    config = SINK_FAMILIES["gpt-oss"].make_config()
    path = export_optimum_decoder(config, tmp_path)
    original = onnx.load(str(path))
    assert_prompt_matches_hf(config, original, PROMPT)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    windows = (W, None)  # layer_types: sliding, full
    assert len(report.layers) == len(windows), report.summary()
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == report.fused_layers == len(windows), report.summary()
    for layer, node, window in zip(report.layers, gqa, windows, strict=True):
        assert layer.fused and layer.result.startswith("GroupQueryAttention"), report.summary()
        mask = "causal + padding" + (f" + sliding window {window}" if window else "")
        assert layer.notes[0].split("; ")[0] == mask, report.summary()
        assert "attention sinks as head_sink" in layer.notes[0], report.summary()
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("local_window_size", -1) == (window or -1)
        assert len(node.input) > 11 and node.input[11]  # head_sink
        # Q/K's half-width rotation (two Slices of chunk()) is lifted to RotaryEmbedding; its
        # positions are arange(past, past + seq) computed in the graph (no position_ids), fed
        # to GQA as position_ids.
        assert attrs["do_rotary"] == 1 and "fed as position_ids" in layer.notes[0]
        assert node.input[9], list(node.input)
    sinks = next(r for r in report.rules if r.name == "attention-sinks-to-attention")
    assert sinks.rewritten == len(windows) and not sinks.kept_codes, report.summary()
    ops = [n.op_type for n in optimized.graph.node]
    assert not set(ops) & {"Attention", "ReduceLogSumExp", "IsNaN", "Cos", "Sin"}, sorted(ops)
    assert "RotaryEmbedding" not in ops, sorted(ops)
    result = compare_models(original, optimized, prompt_len=PROMPT, decode_past_len=PAST)
    assert result.passed, str(result)


# Optimum patches transformers 4.57's experts for export: Qwen3-MoE's sparse block loops over
# every expert (not only the experts the trace input routes to), GPT-OSS's experts run every
# expert on every token; canonicalization lifts either to the batched experts form.
MOE_OPTIMUM = {
    "qwen3-moe": ("expert-loop-to-batched", 0),
    "gpt-oss": ("dense-experts-to-batched", 1),
}


@pytest.mark.parametrize("name", list(MOE_OPTIMUM))
def test_optimum_experts_are_lifted_and_lowered(name, tmp_path):
    """Every layer's experts are lifted to the batched form, then on cpu (these tiny experts
    are below its decode-weight threshold for the loop) become one com.microsoft::MoE (router
    semantics proven: Qwen3-MoE's softmax top-k as is, GPT-OSS's top-k then softmax, i.e.
    renormalized, with its clamped SwiGLU); with the loop preferred (as real Qwen3-235B or
    GPT-OSS blocks on cpu float32), and on an EP without MoE, the loop over the experts. Each
    stays equal to the export."""
    from epfuse.testing.hf_families import MOE_FAMILIES, SINK_FAMILIES
    from epfuse.testing.optimum_export import export_optimum_decoder

    config = {**MOE_FAMILIES, **SINK_FAMILIES}[name].make_config()
    original = onnx.load(str(export_optimum_decoder(config, tmp_path)))
    assert_prompt_matches_hf(config, original, PROMPT)
    lift, normalized = MOE_OPTIMUM[name]
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    cpu = epfuse.get_ep("cpu")
    no_moe = cpu.variant("cpu-no-moe", moe=False)
    loop = cpu.variant("cpu-loop", experts_loop_min_decode_weights=0)
    for record in (loop, no_moe):
        looped, report = epfuse.optimize_with_report(original, record)
        rules = {r.name: r for r in report.rules}
        assert rules[lift].rewritten == 2 and not rules[lift].kept, report.summary()
        assert rules["legalize-experts-to-loop"].rewritten == 2, report.summary()
        ops = [n.op_type for n in looped.graph.node]
        assert ops.count("NonZero") == 2 * experts, sorted(set(ops))
        assert "MoE" not in ops and "GatherND" not in ops, sorted(set(ops))
        result = compare_models(original, looped, prompt_len=PROMPT, decode_past_len=PAST)
        assert result.passed, str(result)

    optimized, report = epfuse.optimize_with_report(original, cpu)
    rules = {r.name: r for r in report.rules}
    assert rules["experts-to-moe"].rewritten == 2, report.summary()
    moe = [n for n in optimized.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2, report.summary()
    for node in moe:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["k"] == 2 and attrs["normalize_routing_weights"] == normalized
        assert ("swiglu_limit" in attrs) == (name == "gpt-oss")
    ops = {n.op_type for n in optimized.graph.node}
    assert not ops & {"NonZero", "OneHot", "TopK", "Tile"}, sorted(ops)
    result = compare_models(original, optimized, prompt_len=PROMPT, decode_past_len=PAST)
    assert result.passed, str(result)
