"""Optimum exports at ``--opset 17`` are raised to opset 23 and fuse as the default-opset (18)
export does, staying equal to the export in every scenario (``--opset 14`` of every family is
in ``test_families_optimum``).

Below 18 ReduceMean takes its axes as an attribute (converted in place by ``_opset``), and
ops revised after 14 (LessOrEqual, Pow, Where, ...) must keep their meaning at 23. Llama and
one sliding-window family (Mistral, lengths past the window) are exported with Optimum and run
through the optimizer; RMSNorm and RoPE must be lifted, every attention layer fused into
GroupQueryAttention with the rotation and the family's mask, no reason may cite the opset, and
the result must compute what the export computes (logits and present K/V on valid rows).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

import epfuse
from epfuse.optimizer.verify import compare_models
from epfuse.testing.hf_families import ALL_FAMILIES, SLIDING_WINDOW

pytestmark = [pytest.mark.slow, pytest.mark.optimum]

W = SLIDING_WINDOW
CASES = [(name, opset) for name in ("llama3", "mistral") for opset in (17,)]


@pytest.mark.parametrize(("name", "opset"), CASES, ids=[f"{n}-opset{o}" for n, o in CASES])
def test_low_opset_export_is_raised_and_stays_equal(name, opset, tmp_path):
    from epfuse.testing.optimum_export import export_optimum_decoder

    config = ALL_FAMILIES[name].make_config()
    path = export_optimum_decoder(config, tmp_path / name, opset=opset)
    original = onnx.load(str(path))
    assert original.opset_import[0].version == opset

    model, report = epfuse.optimize_with_report(ir.serde.deserialize_model(original), "cpu")
    assert model.opset_imports[""] == 23, report.summary()
    reasons = [r for rule in report.rules for r in rule.kept_reasons]
    reasons += [r for layer in report.layers for r in layer.reasons]
    assert not [r for r in reasons if "opset" in r], report.summary()
    ops = [n.op_type for n in model.graph]
    layers = config.num_hidden_layers
    norms = ops.count("RMSNormalization") + ops.count("SkipSimplifiedLayerNormalization")
    assert norms == 2 * layers + 1, report.summary()  # residual Adds fused into the latter
    assert "ReduceMean" not in ops
    assert len(report.layers) == layers, report.summary()
    window = ALL_FAMILIES[name].window
    mask = "causal + padding" + (f" + sliding window {window}" if window else "")
    for layer in report.layers:
        assert layer.fused, report.summary()
        assert layer.result == "GroupQueryAttention(do_rotary=1)", report.summary()
        assert layer.notes[:1] == [mask], report.summary()

    result = compare_models(original, model, prompt_len=2 * W + 1, decode_past_len=2 * W)
    assert result.passed, str(result)


def test_phi2_with_equal_head_counts_fuses_without_a_cycle(tmp_path):
    """Phi's mask is sliced to ``key_states.shape[-2]``, a Shape of the concatenated K: the
    KV-concat lift once read it off the Attention's own present and the run crashed ("Graph
    contains a cycle"; the rule's own test is ``test_kv_cache``). Fused, nothing disabled."""
    from epfuse.testing.optimum_export import export_optimum_decoder

    config = ALL_FAMILIES["phi2"].make_config()
    config.num_key_value_heads = config.num_attention_heads  # Optimum's Phi export needs it
    original = onnx.load(str(export_optimum_decoder(config, tmp_path / "phi2")))
    model, report = epfuse.optimize_with_report(ir.serde.deserialize_model(original), "cpu")
    assert not report.warnings, report.summary()
    assert report.fused_layers == len(report.layers) == config.num_hidden_layers, report.summary()
    result = compare_models(original, model, prompt_len=9, decode_past_len=8)
    assert result.passed, str(result)
