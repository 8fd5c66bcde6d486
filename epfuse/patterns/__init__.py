"""Rewrite rules, in three layers: ``canonicalize`` (exporter idioms -> standard ONNX),
``lower`` (standard ONNX -> what the chosen EP runs best) and ``legalize`` (whatever the EP's
record still does not take -> an op it does, or primitives).

``RULES`` is found, not listed: every concrete rule (a :class:`Rule` subclass naming itself
with ``name=``) defined in a module of those three packages is in it, ordered by stage, then
by declared benefit, then by name. Adding a rule is adding its file (and its test, and an
emission-table entry for an op it is the first to emit); no registry to edit.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

from . import canonicalize, legalize, lower
from .base import AttentionFacts, Kept, OptimizeOptions, RewriteContext, Rewritten, Rule, Stage
from .reasons import ReasonCode

_STAGE_ORDER = {stage: index for index, stage in enumerate(Stage)}


def discover_rules(
    packages: tuple[ModuleType, ...] = (canonicalize, lower, legalize),
) -> tuple[Rule, ...]:
    """One instance of every concrete rule defined in ``packages``' modules, in run order:
    stage (:class:`Stage`'s order), then higher ``benefit`` first, then name. Within a
    stage only rules on the same anchor ever compete for a node, so only there does the
    order matter (``Rule.benefit``)."""
    found: dict[str, type[Rule]] = {}
    for package in packages:
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ != module.__name__ or not issubclass(cls, Rule):
                    continue
                if "name" not in vars(cls):
                    continue  # a shared base (its subclasses name themselves)
                if found.setdefault(cls.name, cls) is not cls:
                    raise TypeError(
                        f"two rules are named {cls.name!r}: {found[cls.name]} and {cls}"
                    )
    ordered = sorted(
        found.values(), key=lambda cls: (_STAGE_ORDER[cls.stage], -cls.benefit, cls.name)
    )
    return tuple(cls() for cls in ordered)


RULES: tuple[Rule, ...] = discover_rules()

__all__ = [
    "RULES",
    "AttentionFacts",
    "Kept",
    "OptimizeOptions",
    "ReasonCode",
    "RewriteContext",
    "Rewritten",
    "Rule",
    "Stage",
    "discover_rules",
]
