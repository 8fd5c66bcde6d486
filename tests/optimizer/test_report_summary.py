"""The printed report: rule outcomes line up whatever the rule names' lengths."""

from epfuse.optimizer.report import Report, RuleReport


def test_rule_outcomes_start_in_one_column():
    report = Report(ep="cpu", dtype="float32", options={})
    report.rules = [
        RuleReport("short", "lower", True, rewritten=2),
        RuleReport("a-rule-name-longer-than-thirty-characters", "lower", False, "cpu lacks it"),
    ]
    lines = [
        line for line in report.summary().splitlines() if "short" in line or "cpu lacks" in line
    ]
    assert len(lines) == 2
    assert lines[0].index("rewrote 2") == lines[1].index("not selected: cpu lacks it")
