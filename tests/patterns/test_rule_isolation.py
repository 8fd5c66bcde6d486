"""Rules talk through public functions and analyses only: no rule module imports another
rule module's private names (issue #17: GQA called rotate-half's private ``_match``)."""

from __future__ import annotations

import ast
from pathlib import Path

import epfuse.patterns as patterns

_ROOT = Path(patterns.__file__).parent
_RULE_PACKAGES = ("canonicalize", "lower", "legalize")


def _private_imports(path: Path) -> list[str]:
    """``package.module.name`` for each private name ``path`` imports from a rule module (a
    public module of a rule package) other than itself. Private helper modules
    (``legalize/_common.py``) exist to be shared and may be imported."""
    own = path.parent.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        parts = node.module.split(".")
        if node.level == 0 and parts[:2] == ["epfuse", "patterns"]:
            parts = parts[2:]
        elif node.level == 1:
            parts = [own, *parts]
        elif node.level != 2:
            continue
        if len(parts) != 2 or parts[0] not in _RULE_PACKAGES or parts[1].startswith("_"):
            continue
        if parts == [own, path.stem]:
            continue
        for alias in node.names:
            if alias.name.startswith("_"):
                found.append(f"{'.'.join(parts)}.{alias.name}")
    return found


def test_no_rule_imports_another_packages_private_code():
    files = [p for pkg in _RULE_PACKAGES for p in (_ROOT / pkg).glob("*.py")]
    files += list((_ROOT / "analysis").glob("*.py"))
    assert len(files) > 20
    offending = [f"{path.name}: {hit}" for path in files for hit in _private_imports(path)]
    assert offending == []


def test_the_check_sees_a_private_import(tmp_path):
    rule = tmp_path / "lower" / "x.py"
    rule.parent.mkdir()
    rule.write_text(
        "from ..canonicalize.rotate_half import _ROPE, match_rotate_half\n"
        "from .gqa import _RopePlan\n"
        "from ._helpers import _shared\n"
        "from epfuse.patterns.legalize.expand import _ExpandToPrimitives\n"
    )
    assert _private_imports(rule) == [
        "canonicalize.rotate_half._ROPE",
        "lower.gqa._RopePlan",
        "legalize.expand._ExpandToPrimitives",
    ]
