"""The pass manager as a driver: its rule set is an argument, a stage that never converges is
reported, and a failed shape inference is a report warning, not a traceback on stderr."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from epfuse import get_ep
from epfuse.optimizer.manager import MAX_SWEEPS, PassManager
from epfuse.patterns import OptimizeOptions, Rewritten, Rule, Stage


def _relu_chain() -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    node = ir.Node("", "Relu", [x], num_outputs=1, name="relu")
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 23}, name="g")
    return ir.Model(graph, ir_version=10)


class _FlipFlop(Rule):
    """Relu <-> Relu forever: a rule that always claims a rewrite never reaches a fixed point."""

    name = "test-flip-flop"
    anchor = ("", "Relu")
    stage = Stage.CANONICALIZE
    description = "renames the Relu each time (never converges)"

    def apply(self, node, ctx):
        node.name = "relu-a" if node.name != "relu-a" else "relu-b"
        return Rewritten("renamed")


def test_a_stage_without_fixed_point_is_reported():
    report = PassManager((_FlipFlop(),)).run(
        _relu_chain(), get_ep("cpu"), "float32", OptimizeOptions()
    )
    assert report.rules[0].rewritten == MAX_SWEEPS
    assert len(report.warnings) == 1
    assert "canonicalize reached no fixed point" in report.warnings[0]
    assert "test-flip-flop" in report.warnings[0]
    assert "warnings:" in report.summary()


def test_converging_run_has_no_warnings():
    report = PassManager(()).run(_relu_chain(), get_ep("cpu"), "float32", OptimizeOptions())
    assert report.warnings == []


def test_failed_shape_inference_is_a_warning_not_a_logged_traceback(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("inference exploded\nsecond line")

    # onnx-ir's pass catches this itself and logs it with a traceback.
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", broken)
    with caplog.at_level(logging.WARNING):
        report = PassManager(()).run(_relu_chain(), get_ep("cpu"), "float32", OptimizeOptions())
    assert report.warnings == [
        "ONNX shape inference failed (inference exploded); rules saw only the exported types"
    ]
    assert not [r for r in caplog.records if "Shape inference failed" in r.getMessage()]


def test_chunked_prefill_assumption_comes_from_the_record():
    from epfuse.optimizer.manager import _assumptions

    gqa = ir.Node("com.microsoft", "GroupQueryAttention", [], num_outputs=1)
    graph = ir.Graph([], gqa.outputs, nodes=[gqa], opset_imports={"": 23}, name="g")
    cpu = _assumptions(graph, get_ep("cpu"), "float32", OptimizeOptions())
    cuda = _assumptions(graph, get_ep("cuda"), "float16", OptimizeOptions())
    assert any("needs batch 1" in note for note in cpu)
    assert get_ep("cuda").ops("float16").gqa.chunked_prefill_needs_batch1 is False
    assert not any("needs batch 1" in note for note in cuda)
