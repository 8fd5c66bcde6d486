"""Every lowering rule declares what it emits in the one emission table, and is selected
(``requires()``) only where the EP's record has all of it."""

from __future__ import annotations

import pytest

from epfuse.capabilities import all_eps
from epfuse.capabilities.emissions import Capability
from epfuse.patterns import RULES, Stage

LOWERING = [r for r in RULES if r.stage in (Stage.LOWER, Stage.FINALIZE)]

ALTERNATIVES = {"mrope"}
"""Rules selected even without their emission (they have a fallback form, see the rule)."""


@pytest.mark.parametrize("rule", LOWERING, ids=lambda r: r.name)
def test_lowering_rule_declares_emits_in_the_table(rule):
    assert rule.emits, f"{rule.name} declares no emits"
    assert all(isinstance(c, Capability) for c in rule.emits), rule.emits


@pytest.mark.parametrize("rule", LOWERING, ids=lambda r: r.name)
def test_selected_only_where_the_record_has_what_it_emits(rule):
    for ep in all_eps():
        for dtype, ops in ep.dtypes.items():
            reason = rule.requires(ops, ep)
            lacking = [c for c in rule.emits if not c.supported_by(ops)]
            if lacking and rule.name not in ALTERNATIVES and "itself" not in (reason or ""):
                assert reason == lacking[0].lacking(ep.name), (ep.name, dtype, reason)
            if reason is not None:
                assert reason.startswith(ep.name), reason
