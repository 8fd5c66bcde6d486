"""Typed facts in the report: a fused layer's ``AttentionFacts`` (in the JSON stored in the
model, read back by ``read_report``) and conformance ``Violation`` records, which the refusal
of a re-targeted model reads instead of parsing lines."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.capabilities import get_ep
from epfuse.capabilities.conformance import Violation
from epfuse.optimizer.api import _vendor_op_refusal
from epfuse.optimizer.genai import genai_config
from epfuse.optimizer.report import Report
from epfuse.patterns import AttentionFacts


def test_fused_layer_facts_in_the_report_json():
    cfg = DecoderConfig(layers=2, sliding_window=5, softcap=30.0, interleaved=True)
    optimized, report = epfuse.optimize_with_report(build_decoder(cfg), "cpu")
    assert report.fused_layers == 2
    expected = AttentionFacts(
        op="com.microsoft::GroupQueryAttention",
        num_heads=cfg.heads,
        kv_num_heads=cfg.kv_heads,
        head_size=cfg.head_dim,
        do_rotary=True,
        rotary_dim=cfg.head_dim,
        rotary_interleaved=True,
        rotary_cache_rows=4096,  # max_seq_len rows
        local_window_size=5,
        softcap=30.0,
    )
    assert [layer.facts for layer in report.layers] == [expected, expected]
    stored = json.loads(dict((p.key, p.value) for p in optimized.metadata_props)["epfuse.report"])
    assert stored["layers"][1]["facts"]["local_window_size"] == 5
    assert stored["layers"][1]["facts"]["num_heads"] == cfg.heads
    assert epfuse.read_report(optimized).layers[0].facts == expected
    # the facts are what the graph holds
    (gqa, *_) = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = {a.name: a for a in gqa.attribute}
    assert attrs["num_heads"].i == expected.num_heads
    assert attrs["local_window_size"].i == expected.local_window_size
    assert attrs["softcap"].f == pytest.approx(expected.softcap)


def test_kept_layer_has_no_facts():
    _, report = epfuse.optimize_with_report(build_decoder(DecoderConfig(layers=2)), "default")
    assert report.fused_layers == 0
    assert all(layer.facts is None for layer in report.layers)


def test_genai_reads_heads_and_context_from_the_facts():
    cfg = DecoderConfig(layers=2, heads=8, kv_heads=2)
    optimized, report = epfuse.optimize_with_report(build_decoder(cfg), "cpu", max_seq_len=512)
    graph_only, _ = genai_config(ir.from_proto(optimized), None, "cpu")
    with_report, _ = genai_config(ir.from_proto(optimized), report, "cpu")
    assert with_report == graph_only  # the report's facts agree with the graph
    decoder = with_report["model"]["decoder"]
    assert (decoder["num_attention_heads"], with_report["model"]["context_length"]) == (8, 512)
    # the facts are the source where the report has them
    facts = report.layers[0].facts
    stated = Report.from_dict(report.to_dict())
    for layer in stated.layers:
        layer.facts = AttentionFacts(**{**facts.__dict__, "rotary_cache_rows": 256})
    config, _ = genai_config(ir.from_proto(optimized), stated, "cpu")
    assert config["model"]["context_length"] == 256


def test_violation_fields_and_text():
    found = Violation("attn/GQA", "com.microsoft", "GroupQueryAttention", ("gqa",))
    assert str(found) == "attn/GQA (com.microsoft::GroupQueryAttention) needs ['gqa']"
    assert found.vendor and not Violation("a", "ai.onnx", "Attention", ("attention",)).vendor
    report = Report(ep="dml", dtype="float16", options={}, violations=[found])
    assert Report.from_dict(json.loads(report.to_json())).violations == [found]


def test_vendor_refusal_is_built_from_the_fields():
    record = get_ep("dml")
    violations = [
        Violation("a", "ai.onnx", "Attention", ("attention",)),
        Violation("g1", "com.microsoft", "GroupQueryAttention", ("gqa",)),
        Violation("g2", "com.microsoft", "GroupQueryAttention", ("gqa",)),
        Violation("m", "com.microsoft", "MoE", ("moe",)),
    ]
    refusal = _vendor_op_refusal(violations, record, "float16")
    assert refusal.startswith("cannot re-target this model to dml (float16): dml does not run ")
    assert "com.microsoft::GroupQueryAttention, com.microsoft::MoE in the form" in refusal
    assert _vendor_op_refusal(violations[:1], record, "float16") is None
