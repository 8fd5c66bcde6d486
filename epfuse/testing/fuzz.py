"""``epfuse fuzz``'s engine: hypothesis draws in-contract scenarios for one pair of models,
both run on ORT CPU (:class:`epfuse.optimizer.verify.Comparator`, loaded once), and a failure
is shrunk to a minimal scenario list that replays as an ``epfuse verify`` command line.

Derandomized by default (the same examples on every run: a CI job is reproducible); ``seed``
draws fresh ones. ``budget`` bounds the search in seconds: once it is spent no new example
runs (they pass trivially), except while a failure is being shrunk, which gets as long again.
Imports hypothesis: load it only where the ``fuzz`` extra is installed.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.errors
from hypothesis import HealthCheck, Phase, assume, given, settings

from epfuse.optimizer.verify import Comparator, Scenario, VerificationResult

from .strategies import ModelSignature, scenario_lists, seeds


@dataclasses.dataclass
class FuzzFailure:
    scenarios: list[Scenario]
    seed: int
    result: VerificationResult

    def replay(self, original: str, optimized: str) -> str:
        """The ``epfuse verify`` command line that reruns exactly this example."""
        parts = ["epfuse", "verify", original, optimized]
        for scenario in self.scenarios:
            parts += ["--scenario", scenario.name]
        parts += ["--seed", str(self.seed)]
        return shlex.join(parts)

    def worst(self) -> str:
        """The worst failing output (or the error) of the failing run."""
        worst = self.result.worst_failure()
        if worst is None or isinstance(worst, str):
            return worst or "no comparison failed"
        note = f" ({worst.note})" if worst.note else ""
        return (
            f"{worst.output}{note} in {worst.scenario}: max abs {worst.max_abs_err:.3g}, "
            f"max rel {worst.max_rel_err:.3g}, ratio {worst.ratio:.3g} (pass if <= 1)"
        )


@dataclasses.dataclass
class FuzzResult:
    passed: bool
    examples: int
    """Examples that ran both models (not counting those past the budget)."""
    rejected: int
    """Drawn examples the ORIGINAL model could not run (out of its contract)."""
    seconds: float
    signature: ModelSignature
    limits: str
    failure: FuzzFailure | None = None
    budget_spent: bool = False

    def to_dict(self, original: str = "ORIGINAL", optimized: str = "OPTIMIZED") -> dict:
        data: dict[str, Any] = {
            "passed": self.passed,
            "examples": self.examples,
            "rejected": self.rejected,
            "seconds": round(self.seconds, 3),
            "budget_spent": self.budget_spent,
            "limits": self.limits,
            "signature": dataclasses.asdict(self.signature),
        }
        if self.failure is not None:
            data["failure"] = {
                "scenarios": [s.name for s in self.failure.scenarios],
                "seed": self.failure.seed,
                "replay": self.failure.replay(original, optimized),
                "worst": self.failure.worst(),
                "failed_scenarios": self.failure.result.failed_scenarios(),
            }
        return data


class _Failed(AssertionError):
    pass


def fuzz_models(
    original: Any,
    optimized: Any,
    *,
    examples: int = 100,
    seed: int | None = None,
    budget: float | None = None,
    max_len: int | None = None,
    progress: Callable[[str], None] | None = None,
    pair: Comparator | None = None,
) -> FuzzResult:
    """Fuzz ``optimized`` against ``original`` (paths, ModelProtos or onnx_ir Models)."""
    pair = pair or Comparator(original, optimized)
    signature = ModelSignature.of_comparator(pair, max_len)
    start = time.monotonic()
    state = {"ran": 0, "rejected": 0, "failed_at": None, "last_progress": start, "spent": False}
    failures: list[FuzzFailure] = []

    def over_budget() -> bool:
        if budget is None:
            return False
        now = time.monotonic() - start
        if state["failed_at"] is not None:  # shrinking gets as long again
            return now > state["failed_at"] + budget
        return now > budget

    @settings(
        max_examples=examples,
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=(Phase.generate, Phase.shrink),
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(cases=scenario_lists(signature, min_size=1, max_size=3), token_seed=seeds())
    def property_(cases: list[Scenario], token_seed: int) -> None:
        if over_budget():
            state["spent"] = True
            return
        result = pair.run(cases, token_seed)
        if any(s.error and s.error.startswith("original model failed") for s in result.scenarios):
            state["rejected"] += 1
            assume(False)
        state["ran"] += 1
        now = time.monotonic()
        if progress is not None and now - state["last_progress"] >= 5:
            state["last_progress"] = now
            phase = "shrinking" if failures else "searching"
            progress(f"fuzz: {state['ran']} examples in {now - start:.0f}s ({phase})")
        if not result.passed:
            if state["failed_at"] is None:
                state["failed_at"] = now - start
            failures.append(FuzzFailure(list(cases), token_seed, result))
            raise _Failed(result.failed_scenarios())

    if seed is not None:
        property_ = hypothesis.seed(seed)(property_)
    passed = True
    try:
        property_()
    except _Failed:
        passed = False
    except hypothesis.errors.Unsatisfiable:
        raise ValueError("the original model ran none of the drawn scenarios on ORT CPU") from None
    return FuzzResult(
        passed=passed,
        examples=state["ran"],
        rejected=state["rejected"],
        seconds=time.monotonic() - start,
        signature=signature,
        limits=pair.limits.describe(),
        failure=failures[-1] if failures else None,
        budget_spent=state["spent"],
    )


__all__ = ["FuzzFailure", "FuzzResult", "fuzz_models"]
