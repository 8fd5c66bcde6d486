"""The capability probe: schemas of the installed ORT, known-answer runs on the CPU EP."""

from __future__ import annotations

import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.capabilities import all_eps, get_ep, known_answers
from epfuse.capabilities import probe as probe_module
from epfuse.capabilities.probe import (
    Emission,
    known_answer,
    probe,
    probed_record,
    schema_mismatches,
)
from epfuse.optimizer.cli import main
from epfuse.optimizer.verify import assert_equivalent


@pytest.fixture(scope="module")
def cpu_report():
    return probe(get_ep("cpu"))


def test_builtin_records_agree_with_installed_ort(cpu_report):
    assert cpu_report.installed and not cpu_report.mismatches
    assert len(cpu_report.observed) == 36  # 18 flags x float32/float16
    # int8 past/present with per-channel scales: exact on power-of-two scales, both dtypes
    assert cpu_report.observed[("float32", "gqa.kv_cache_int8")]
    assert cpu_report.observed[("float16", "gqa.kv_cache_int8")]
    assert cpu_report.observed[("float32", "gqa.softcap")]
    assert cpu_report.observed[("float16", "gqa.head_sink")]  # GPT-OSS sinks, with a window
    assert cpu_report.observed[("float32", "moe")]  # interleaved, clamped SwiGLU experts
    assert cpu_report.observed[("float16", "gqa.local_window")]
    assert not cpu_report.observed[("float32", "gqa.qk_norm")]  # CPU rejects q/k-norm inputs
    for record in all_eps():
        report = probe(record)
        assert not report.schema, report.schema


def _wrong_cpu():
    return get_ep("cpu").variant("cpu-wrong", gqa={"qk_norm": True, "softcap": False})


def test_probe_catches_a_wrong_record_and_corrects_it():
    wrong = _wrong_cpu()
    report = probe(wrong)
    text = "\n".join(report.mismatches)
    assert "float32 gqa.qk_norm: record says yes, but it fails to run" in text
    assert "float16 gqa.softcap: record says no, but it works" in text
    fixed = probed_record(wrong, report)
    for dtype in ("float32", "float16"):
        assert fixed.ops(dtype).gqa.softcap and not fixed.ops(dtype).gqa.qk_norm


def test_schema_check_catches_a_missing_attribute(monkeypatch):
    assert schema_mismatches("gqa.softcap", "float16") == []
    monkeypatch.setitem(
        probe_module.EMISSIONS,
        "gqa.softcap",
        (Emission("com.microsoft", "GroupQueryAttention", attributes=("soft_cap",)),),
    )
    assert "no attribute(s) ['soft_cap']" in schema_mismatches("gqa.softcap", "float16")[0]
    monkeypatch.setitem(
        probe_module.EMISSIONS,
        "gqa.softcap",
        (Emission("com.microsoft", "GroupQueryAttention", inputs=((14, "k_norm_weight"),)),),
    )
    assert "input 14 is 'q_norm_weight'" in schema_mismatches("gqa.softcap", "float16")[0]


def test_known_answer_detects_a_wrong_result(monkeypatch):
    assert known_answer("skip_simplified_layer_norm", "float32", "CPUExecutionProvider") is None

    def wrong(dtype, provider):
        got, ref = known_answers._norm_case(dtype, provider, "SimplifiedLayerNormalization")
        return got * 1.01, ref

    monkeypatch.setitem(probe_module.KNOWN_ANSWERS, "simplified_layer_norm", wrong)
    why = known_answer("simplified_layer_norm", "float32", "CPUExecutionProvider")
    assert why is not None and why.startswith("wrong answer")


def test_optimize_trusts_the_probe_over_the_record():
    wrong = _wrong_cpu()
    # softcap: the wrong record keeps the layer as Attention; the probe lets GQA carry it.
    gemma = build_decoder(DecoderConfig(style="mobius", softcap=5.0, sliding_window=4))
    _, plain = epfuse.optimize_with_report(gemma, wrong)
    assert plain.fused_layers == 0
    optimized, probed = epfuse.optimize_with_report(gemma, wrong, probe=True)
    assert probed.fused_layers == 2
    assert any("probe overrides the record" in a for a in probed.assumptions)
    assert_equivalent(gemma, optimized, prompt_len=9, decode_past_len=7)
    # q/k norm: the wrong record fuses it into GQA (which CPU rejects); the probe keeps it.
    qwen3 = build_decoder(DecoderConfig(style="mobius", qk_norm=True))
    bad = epfuse.optimize(qwen3, wrong)
    assert any(n.op_type == "GroupQueryAttention" and len(n.input) > 14 for n in bad.graph.node)
    good = epfuse.optimize(qwen3, wrong, probe=True)
    assert_equivalent(qwen3, good)


def test_cli_probe(capsys):
    assert main(["capabilities", "--ep", "cpu", "--probe"]) == 0
    out = capsys.readouterr().out
    assert "cpu: schema checked; 36 known-answer runs" in out
    assert "record agrees" in out


def test_head_sink_known_answer_would_catch_an_ignored_sink(monkeypatch):
    """The head_sink case's reference differs from plain attention by far more than the
    tolerance, so a kernel that ignored the input would fail it."""
    got, with_sink = known_answers._gqa_case("float32", "CPUExecutionProvider", sink=True, window=3)
    _, without = known_answers._gqa_case("float32", "CPUExecutionProvider", window=3)
    assert abs(with_sink - without).max() > 0.1
    assert abs(got - with_sink).max() < 1e-4
