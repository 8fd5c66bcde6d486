"""RULES is discovered from the rule packages: a new rule is its file, nothing else."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from epfuse.patterns import RULES, Stage, discover_rules

_RULE_FILE = """
from epfuse.patterns.base import Rule, Stage


class _SharedBase(Rule, stage=Stage.CANONICALIZE):
    '''A base without a name: not a rule of its own.'''


class Late(_SharedBase, name="z-late", anchor="Relu"):
    '''late'''


class Early(_SharedBase, name="a-early", anchor="Relu"):
    '''early'''


class First(_SharedBase, name="m-first", anchor="Relu", benefit=3):
    '''first'''


class Lowering(Rule, name="b-lower", stage=Stage.LOWER, anchor="Relu"):
    '''lower'''
"""


def _package(tmp_path, name: str, files: dict[str, str]):
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    for file, text in files.items():
        (root / file).write_text(textwrap.dedent(text))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_new_file_is_a_new_rule_in_stage_benefit_name_order(tmp_path):
    package = _package(tmp_path, "epfuse_discovery_pkg", {"new_rule.py": _RULE_FILE})
    rules = discover_rules((package,))
    assert [rule.name for rule in rules] == ["m-first", "a-early", "z-late", "b-lower"]
    assert [rule.stage for rule in rules] == [Stage.CANONICALIZE] * 3 + [Stage.LOWER]


def test_two_rules_of_one_name_are_refused(tmp_path):
    clash = 'from epfuse.patterns.base import Rule, Stage\n\nclass Again(Rule, name="a-early", stage=Stage.LOWER, anchor="Relu"):\n    """again"""\n'
    package = _package(tmp_path, "epfuse_discovery_clash", {"one.py": _RULE_FILE, "two.py": clash})
    with pytest.raises(TypeError, match="two rules are named 'a-early'"):
        discover_rules((package,))


def test_the_built_in_rules_are_found_once_each():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    # A rule from each package, including two sharing one file and a base class.
    for name in (
        "single-input-concat",
        "same-type-cast",
        "attention-to-gqa",
        "legalize-attention-to-primitives",
        "legalize-skip-simplified-layer-norm",
    ):
        assert name in names


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("remove-repeat-kv", "kv-concat-to-attention-past"),
        ("qk-norm-into-gqa", "pack-qkv"),
        ("skip-simplified-layer-norm", "rms-norm-to-simplified-layer-norm"),
    ],
)
def test_rules_that_would_hide_each_others_shape_run_in_declared_order(first, then):
    by_name = {rule.name: (index, rule) for index, rule in enumerate(RULES)}
    (i, a), (j, b) = by_name[first], by_name[then]
    assert (a.stage, a.anchor) == (b.stage, b.anchor)
    assert i < j
