"""The pass manager as a driver: its stages are onnx-ir passes run in a fixed order (each can
run alone, a failed rewrite reaches the caller as itself), its rule set is an argument, a
stage that never converges is reported, and a failed shape inference is a report warning,
not a traceback on stderr."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
import pytest

import epfuse
from epfuse import get_ep
from epfuse.optimizer.manager import (
    MAX_SWEEPS,
    Canonicalize,
    Lower,
    PassManager,
    RewriteFailure,
    RunState,
    Select,
    StageResult,
)
from epfuse.patterns import OptimizeOptions, Rewritten, Rule, Stage


def _relu_chain() -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    node = ir.Node("", "Relu", [x], num_outputs=1, name="relu")
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 23}, name="g")
    return ir.Model(graph, ir_version=10)


class _OnRelu(Rule):
    """The test rules' common part: each is offered the one Relu of :func:`_relu_chain`
    (in canonicalize unless it says otherwise)."""

    anchor = ("", "Relu")
    stage = Stage.CANONICALIZE


class _FlipFlop(_OnRelu):
    """Relu <-> Relu forever: a rule that always claims a rewrite never reaches a fixed point."""

    name = "test-flip-flop"
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


# ------------------------------------------------------------------ stages as onnx-ir passes


class _Recorder(_OnRelu):
    """Records the stage it ran in (once per sweep over the one Relu) and changes nothing."""

    description = "records when it is offered a node"

    def __init__(self, stage: Stage, log: list[str]):
        self.stage, self.name, self.log = stage, f"test-record-{stage.value}", log

    def apply(self, node, ctx):
        self.log.append(self.stage.value)
        return None


class _RenameOnce(_OnRelu):
    """One rewrite, then a fixed point: the stage reports that it changed the graph."""

    name = "test-rename-once"
    description = "renames the Relu once"

    def apply(self, node, ctx):
        if node.name == "renamed":
            return None
        node.name = "renamed"
        return Rewritten("renamed")


class _Raises(_OnRelu):
    name = "test-raises"
    stage = Stage.LOWER
    description = "fails while rewriting"

    def apply(self, node, ctx):
        raise ValueError("broken rewrite")


def _recorders(log: list[str]) -> tuple[Rule, ...]:
    # Given in reverse stage order: the stages, not the rule set's order, decide when each runs.
    return tuple(
        _Recorder(stage, log)
        for stage in (Stage.LEGALIZE, Stage.FINALIZE, Stage.LOWER, Stage.CANONICALIZE)
    )


def test_stages_are_onnx_ir_passes_run_in_order():
    log: list[str] = []
    model = _relu_chain()
    rules = _recorders(log)
    state = RunState.begin(model, get_ep("cpu"), "float32", OptimizeOptions(), rules)
    pipeline = PassManager(rules).pipeline(state)
    assert isinstance(pipeline, ir.passes.PassBase) and pipeline.in_place
    assert [str(stage) for stage in pipeline.passes] == [
        "infer-types",
        "canonicalize",
        "precision",
        "select",
        "lower",
        "finalize",
        "legalize",
        "quantize-int4",
        "check-conformance",
        "check-acyclic",
        "cleanup",
        "summarize",
    ]
    assert all(isinstance(stage, ir.passes.InPlacePass) for stage in pipeline.passes)
    result = pipeline(model)
    assert isinstance(result, StageResult) and isinstance(result, ir.passes.PassResult)
    assert result.model is model and result.report is state.report
    assert result.modified is False  # the recorders never rewrite
    assert log == ["canonicalize", "lower", "finalize", "legalize"]
    assert [r.name for r in result.report.rules] == [r.name for r in rules]


def test_a_stage_runs_alone():
    log: list[str] = []
    model = _relu_chain()
    rules = (_RenameOnce(), *_recorders(log))
    state = RunState.begin(model, get_ep("cpu"), "float32", OptimizeOptions(), rules)
    result = Canonicalize(state)(model)
    assert isinstance(result, StageResult) and result.modified is True
    assert model.graph.node(0).name == "renamed"
    assert state.rule_reports["test-rename-once"].rewritten == 1
    # Offered the Relu only in the second (fixed-point) sweep: in the first, the rename came
    # first and a rewritten node is offered to no later rule in that sweep.
    assert log == ["canonicalize"]
    assert Lower(state)(model).modified is False and log == ["canonicalize"]  # none selected
    Select(state)(model)
    Lower(state)(model)
    assert log == ["canonicalize", "lower"]


def test_a_stage_refuses_another_model():
    state = RunState.begin(_relu_chain(), get_ep("cpu"), "float32", OptimizeOptions(), ())
    with pytest.raises(ir.passes.PreconditionError):
        Canonicalize(state)(_relu_chain())


def test_a_failed_rewrite_reaches_the_caller_unwrapped():
    # onnx-ir's Sequential would wrap it in PassError; the API rolls back on RewriteFailure.
    with pytest.raises(RewriteFailure) as failure:
        PassManager((_Raises(),)).run(_relu_chain(), get_ep("cpu"), "float32", OptimizeOptions())
    assert failure.value.rule == "test-raises"
    assert "ValueError" in failure.value.why


def test_reference_run_lowers_nothing():
    log: list[str] = []
    rules = _recorders(log)
    report = PassManager(rules).run(
        _relu_chain(), get_ep("cpu"), "float32", OptimizeOptions(), lower=False
    )
    assert log == ["canonicalize"]
    assert report.layers == [] and report.nodes_after == 1


def test_a_layer_whose_attention_is_not_lifted_is_still_a_layer():
    """Three layers, the middle one's softmax over the wrong axis (not attention the lifts
    know): the report lists all three, numbered by the KV cache each reads, the middle one
    not fused with the lift's reason, and the model stays equal to the original."""
    from epfuse.optimizer.manager import NOT_LIFTED
    from epfuse.optimizer.verify import compare_models
    from epfuse.patterns.reasons import ReasonCode
    from epfuse.testing.model_builder import DecoderConfig, build_decoder

    original = build_decoder(DecoderConfig(layers=3, style="torch18"))
    softmax = [n for n in original.graph.node if n.op_type == "Softmax"]
    next(a for a in softmax[1].attribute if a.name == "axis").i = 2
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    assert [layer.layer for layer in report.layers] == [0, 1, 2], report.summary()
    assert [layer.fused for layer in report.layers] == [True, False, True], report.summary()
    middle = report.layers[1]
    assert middle.result == NOT_LIFTED and ReasonCode.FORM in middle.codes, report.summary()
    assert any("softmax over axis 2" in r for r in middle.reasons), report.summary()
    assert report.fused_layers == 2 and "2 of 3 attention layers" in report.summary()
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert [n.input[3] for n in gqa] == ["past_key_values.0.key", "past_key_values.2.key"]
    with pytest.raises(epfuse.UnsupportedModelError, match="1 of 3 attention layers not fused"):
        epfuse.optimize(original, "cpu", require_fusion=True)
    assert compare_models(original, optimized).passed
