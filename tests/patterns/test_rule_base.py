"""The rule protocol: a rule declares itself in its class header and ``Rule.apply`` drives
match -> check -> rewrite, so a failed match or check never reaches the edit."""

from __future__ import annotations

import onnx_ir as ir

from epfuse import get_ep
from epfuse.capabilities.emissions import Capability
from epfuse.patterns import RULES, Kept, OptimizeOptions, RewriteContext, Rewritten, Rule, Stage
from epfuse.patterns.reasons import ReasonCode


def _relu_ctx() -> tuple[ir.Node, RewriteContext]:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    node = ir.Node("", "Relu", [x], num_outputs=1, name="relu")
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 23}, name="g")
    ctx = RewriteContext(
        ir.Model(graph, ir_version=10), get_ep("cpu"), "float32", OptimizeOptions()
    )
    return node, ctx


class _Renamer(
    Rule, name="test-renamer", stage=Stage.LOWER, anchor="Relu", emits=(Capability.GQA,)
):
    """Renames a Relu

    (only when it is called relu and the check allows it)."""

    def __init__(self, allow: bool = True):
        self.allow = allow
        self.rewrites = 0

    def match(self, node, ctx):
        if node.name == "kept":
            return Kept(ReasonCode.FORM, "named kept")
        return node if node.name == "relu" else None

    def check(self, node, ctx):
        return None if self.allow else Kept(ReasonCode.NOT_PROVEN, "not allowed")

    def rewrite(self, node, ctx):
        self.rewrites += 1
        node.name = "renamed"
        return Rewritten("renamed")


class _Vendor(_Renamer, name="test-vendor", anchor=("com.microsoft", "Relu")):
    pass


def test_the_class_header_declares_the_rule():
    assert _Renamer.name == "test-renamer"
    assert _Renamer.stage is Stage.LOWER
    assert _Renamer.anchor == ("", "Relu")
    assert _Renamer.emits == (Capability.GQA,)
    assert _Renamer.description == "Renames a Relu"  # the docstring's first paragraph


def test_a_subclass_inherits_what_it_does_not_declare():
    assert _Vendor.anchor == ("com.microsoft", "Relu")
    assert _Vendor.stage is Stage.LOWER and _Vendor.emits == (Capability.GQA,)
    assert _Vendor.description == _Renamer.description  # no docstring of its own
    assert _Renamer.name == "test-renamer"  # the subclass did not change its base


def test_apply_runs_match_then_check_then_rewrite():
    node, ctx = _relu_ctx()
    rule = _Renamer()
    assert isinstance(rule.apply(node, ctx), Rewritten)
    assert node.name == "renamed" and rule.rewrites == 1
    assert rule.apply(node, ctx) is None  # no longer its shape


def test_a_failed_match_or_check_never_rewrites():
    node, ctx = _relu_ctx()
    refusing = _Renamer(allow=False)
    outcome = refusing.apply(node, ctx)
    assert isinstance(outcome, Kept) and outcome.code is ReasonCode.NOT_PROVEN
    assert node.name == "relu" and refusing.rewrites == 0
    node.name = "kept"
    outcome = _Renamer().apply(node, ctx)
    assert isinstance(outcome, Kept) and outcome.code is ReasonCode.FORM


def test_every_rule_is_declared():
    for rule in RULES:
        assert rule.name and isinstance(rule.stage, Stage) and rule.description, rule
        assert isinstance(rule.anchor, tuple) and len(rule.anchor) == 2, rule
        assert "apply" not in type(rule).__dict__, f"{rule.name} bypasses match/check/rewrite"
