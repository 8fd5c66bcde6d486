"""Results of a comparison, and the element-wise rule that decides them (valid rows only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epfuse.tolerances import Tolerance


@dataclass
class OutputComparison:
    """One compared output of one scenario.

    ``max_rel_err`` is ``max |d| / (|expected| + atol)`` (atol keeps near-zero elements from
    dominating); ``ratio`` is ``max |d| / (atol + rtol * |expected|)``: the comparison passes
    when ``ratio <= 1`` (and nothing is NaN/inf where the original is finite).
    """

    scenario: str
    output: str
    kind: str  # "logits", "kv" or "state" (a hybrid stack's conv/recurrent state)
    shape: tuple[int, ...]
    max_abs_err: float
    max_rel_err: float
    ratio: float
    passed: bool
    note: str = ""


@dataclass
class ScenarioResult:
    name: str
    comparisons: list[OutputComparison] = field(default_factory=list)
    skipped: str | None = None  # reason
    error: str | None = None  # an exception while running a model

    @property
    def passed(self) -> bool:
        if self.skipped is not None:
            return True
        return self.error is None and all(c.passed for c in self.comparisons)


@dataclass
class VerificationResult:
    dtype: str
    tolerance: Tolerance
    scenarios: list[ScenarioResult]
    roles: tuple[str, str] = ("", "")
    """What each model's inputs and outputs were matched to (original, optimized)."""
    limits: str = ""
    """The windows, thresholds and position limit read from both graphs."""

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.scenarios)

    def __bool__(self) -> bool:
        return self.passed

    def scenario(self, name: str) -> ScenarioResult:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)

    def failed_scenarios(self) -> list[str]:
        return [s.name for s in self.scenarios if not s.passed]

    def worst_failure(self) -> str | OutputComparison | None:
        """What to name when the run fails: the first scenario's error (``"SCENARIO: error"``),
        else the failing comparison furthest over its tolerance, else None."""
        worst = None
        for scenario in self.scenarios:
            if scenario.error:
                return f"{scenario.name}: {scenario.error}"
            for c in scenario.comparisons:
                if not c.passed and (worst is None or c.ratio > worst.ratio):
                    worst = c
        return worst

    def __str__(self) -> str:
        from .table import format_result

        return format_result(self)


def _compare(
    scenario: str,
    output: str,
    kind: str,
    expected: np.ndarray,
    actual: np.ndarray,
    tol: Tolerance,
    shape: tuple[int, ...] | None = None,
) -> OutputComparison:
    """Element-wise comparison of two (already sliced) arrays; ``shape`` is only reported."""
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual, dtype=np.float64)
    shape = tuple(expected.shape) if shape is None else shape
    if expected.shape != actual.shape:
        note = f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        return OutputComparison(
            scenario, output, kind, shape, math.inf, math.inf, math.inf, False, note
        )
    if expected.size == 0:
        return OutputComparison(scenario, output, kind, shape, 0.0, 0.0, 0.0, True)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(actual - expected)
        # Identical non-finite values (inf == inf, NaN where the original has NaN) agree.
        same_nonfinite = ~np.isfinite(expected) & (
            (actual == expected) | (np.isnan(actual) & np.isnan(expected))
        )
        diff = np.where(same_nonfinite, 0.0, diff)
        diff = np.where(np.isnan(diff), math.inf, diff)
        ref = np.where(np.isfinite(expected), np.abs(expected), 0.0)
        max_abs = float(diff.max())
        max_rel = float((diff / (ref + tol.atol)).max())
        ratio = float((diff / (tol.atol + tol.rtol * ref)).max())
    return OutputComparison(
        scenario, output, kind, shape, max_abs, max_rel, ratio, bool(ratio <= 1.0)
    )


def _compare_valid(
    scenario: str,
    name: str,
    kind: str,
    ref: np.ndarray,
    opt: np.ndarray,
    tol: Tolerance,
    valid_rows: Any,
    axis: int,
    offset: int,
) -> OutputComparison:
    """Compare the valid rows of ``ref`` and ``opt`` (whole tensors when shapes differ)."""
    if ref.shape != opt.shape:
        return _compare(scenario, name, kind, ref, opt, tol)
    return _compare(
        scenario,
        name,
        kind,
        valid_rows(ref, axis, offset),
        valid_rows(opt, axis, offset),
        tol,
        shape=tuple(ref.shape),
    )
