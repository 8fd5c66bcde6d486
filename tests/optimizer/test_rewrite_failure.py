"""A rule whose rewrite fails must not crash the optimizer nor corrupt its output.

Two defective rules are added to the real ones: one edits the graph and then raises, one makes
the graph cyclic (what kv-concat-to-attention-past did on Optimum's Phi-2). The API must return
the model optimized by the other rules, equal to the original, with the defective rule named
in the report, and leave its input untouched.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

import epfuse
from epfuse.optimizer.manager import has_cycle
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns import RULES, Rewritten, Rule, Stage


class EditsThenRaises(Rule):
    name = "test-edits-then-raises"
    stage = Stage.CANONICALIZE
    anchor = ("", "Attention")

    def apply(self, node, ctx):
        node.replace_input_with(0, node.inputs[1])  # half-written: Q replaced by K
        raise RuntimeError("boom\nsecond line")


class MakesACycle(Rule):
    name = "test-makes-a-cycle"
    stage = Stage.LOWER
    anchor = ("", "RMSNormalization")

    def apply(self, node, ctx):
        if ctx.cache.get(self.name):
            return None
        ctx.cache[self.name] = True
        loop = ir.node("Identity", [node.outputs[0]])
        ctx.graph.insert_after(node, loop)
        node.replace_input_with(0, loop.outputs[0])
        return Rewritten("cycle")


@pytest.mark.parametrize("bad", [EditsThenRaises, MakesACycle])
def test_a_failed_rewrite_is_dropped_and_named(bad, example_model):
    original = onnx.load(str(example_model))
    before = original.SerializeToString()
    optimized, report = epfuse.optimize_with_report(original, "cpu", rules=(*RULES, bad()))
    assert original.SerializeToString() == before
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    assert any(w.startswith(f"{bad.name} disabled: its rewrite of") for w in report.warnings)
    rule = next(r for r in report.rules if r.name == bad.name)
    assert not rule.selected and "epfuse bug" in rule.not_selected_because
    if bad is EditsThenRaises:
        assert "raised RuntimeError: boom" in rule.not_selected_because
    else:
        assert "made the graph cyclic" in rule.not_selected_because
    assert not has_cycle(ir.serde.deserialize_model(optimized).graph)
    assert_equivalent(original, optimized, prompt_len=9)


def test_has_cycle():
    graph = ir.Graph([], [], nodes=[], name="g")
    a = ir.node("Identity", [ir.Value(name="x")])
    b = ir.node("Identity", [a.outputs[0]])
    graph.extend([a, b])
    assert not has_cycle(graph)
    a.replace_input_with(0, b.outputs[0])
    assert has_cycle(graph)
