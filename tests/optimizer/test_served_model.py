"""Every EP gets a served model (issue: an EP that can fuse nothing exited 1 with "no attention
found"): exit 0, per-layer reasons in the report, an output the EP's record takes; strict mode
(``--require-fusion``) refuses with exit 1; a model without attention keeps its clear error."""

from __future__ import annotations

import json

import onnx
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.capabilities.conformance import check
from epfuse.optimizer.cli import main

NO_FUSION_EPS = ["dml", "webgpu", "qnn", "trt-rtx", "openvino", "coreml"]


@pytest.fixture(scope="module", params=["torch23", "torch18"])
def gemma2(request, tmp_path_factory):
    cfg = DecoderConfig(style=request.param, softcap=5.0, sliding_window=4)
    path = tmp_path_factory.mktemp("gemma2") / f"gemma2-{request.param}.onnx"
    onnx.save(build_decoder(cfg), str(path))
    return path


@pytest.mark.parametrize("ep", NO_FUSION_EPS)
def test_softcap_export_is_served_on_every_ep(gemma2, ep, tmp_path, capsys):
    out, report_path = tmp_path / "o.onnx", tmp_path / "r.json"
    argv = ["optimize", str(gemma2), "--ep", ep, "-o", str(out), "--report", str(report_path)]
    rc = main([*argv, "--precision", "fp32"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "0 of 2 attention layers fused" in captured.out
    report = epfuse.Report.from_dict(json.loads(report_path.read_text()))
    for layer in report.layers:
        assert not layer.fused and layer.runs_on_ep
        assert layer.reasons, layer  # why attention was not fused
        assert any("expanded to its ONNX function body" in n for n in layer.notes), layer.notes
    model = onnx.load(str(out))
    assert not check(model, epfuse.get_ep(ep), "float32").violations


@pytest.mark.parametrize("ep", ["dml", "trt-rtx"])
def test_require_fusion_refuses_with_one_line(gemma2, ep, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    argv = ["optimize", str(gemma2), "--ep", ep, "-o", str(out), "--require-fusion"]
    rc = main([*argv, "--precision", "fp32"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert "require_fusion: 2 of 2 attention layers not fused" in err
    assert not out.exists()


def test_require_fusion_passes_when_every_layer_fuses(gemma2, tmp_path):
    assert main(["optimize", str(gemma2), "-o", str(tmp_path / "o.onnx"), "--require-fusion"]) == 0


def test_require_fusion_api():
    model = build_decoder(DecoderConfig(style="mobius", softcap=5.0))
    with pytest.raises(epfuse.UnsupportedModelError, match="layer 0: "):
        epfuse.optimize(model, "qnn", require_fusion=True)
    assert epfuse.optimize_with_report(model, "cpu", require_fusion=True)[1].fused_layers == 2


def test_require_fusion_counts_the_inputs_own_gqa_as_fused():
    """A re-targeted optimized model: its layers are GroupQueryAttention already, flagged
    ``from_input`` in the report (not read off the result's wording), and strict mode passes."""
    optimized = epfuse.optimize(build_decoder(DecoderConfig(style="mobius")), "cpu")
    again, report = epfuse.optimize_with_report(optimized, "cpu", require_fusion=True)
    assert [(layer.from_input, layer.fused) for layer in report.layers] == [(True, False)] * 2
    assert all(n.op_type != "Attention" for n in again.graph.node)
