"""Shared test set-up: import path for the test helpers, hypothesis profiles, fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # `import model_builder` from any test folder

# Hypothesis profiles. "ci" is the default: derandomized (the same examples on every run, so CI
# is reproducible) and bounded so the property suite stays within a few minutes on 2 cores.
# "dev" draws fresh random examples; "thorough" is for a long hunt before a release.
# Choose one with `pytest --hypothesis-profile=NAME` (hypothesis's pytest plugin) or the
# HYPOTHESIS_PROFILE environment variable; the command-line flag wins.
_COMMON_PROFILE = dict(deadline=None, print_blob=True)
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **_COMMON_PROFILE,
)
settings.register_profile(
    "dev", max_examples=25, suppress_health_check=[HealthCheck.too_slow], **_COMMON_PROFILE
)
settings.register_profile(
    "thorough", max_examples=300, suppress_health_check=[HealthCheck.too_slow], **_COMMON_PROFILE
)
DEFAULT_PROFILE = "ci"


def selected_profile(cli_profile: str | None) -> str:
    """The profile to load: the --hypothesis-profile flag, else $HYPOTHESIS_PROFILE, else ci."""
    return cli_profile or os.environ.get("HYPOTHESIS_PROFILE") or DEFAULT_PROFILE


# Loaded at import so that a bare `import` of a test module sees a profile too; pytest_configure
# below re-applies the choice so that the command-line flag wins whatever the hook order.
settings.load_profile(selected_profile(None))


def pytest_configure(config: pytest.Config) -> None:
    try:
        cli = config.getoption("--hypothesis-profile")
    except ValueError:  # hypothesis's pytest plugin disabled (-p no:hypothesispytest)
        cli = None
    settings.load_profile(selected_profile(cli))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``optimum`` need optimum-onnx, whose transformers 4.57 pin conflicts with
    the ``export`` extra; where it is not installed they are deselected (``.ci/run`` runs them
    in a second venv with ``-m optimum``), and the terminal summary says how many."""
    from epfuse.testing.optimum_export import optimum_available

    if optimum_available():
        return
    deselected = [item for item in items if item.get_closest_marker("optimum")]
    if deselected:
        items[:] = [item for item in items if not item.get_closest_marker("optimum")]
        config.hook.pytest_deselected(items=deselected)
        config.stash[_OPTIMUM_DESELECTED] = len(deselected)


_OPTIMUM_DESELECTED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    count = config.stash.get(_OPTIMUM_DESELECTED, 0)
    if count:
        terminalreporter.write_line(
            f"{count} optimum-marked tests deselected: optimum-onnx is not installed here "
            "(.ci/run runs them in the optimum venv)"
        )


@pytest.fixture(scope="session")
def example_model() -> Path:
    from epfuse.examples import EXAMPLE_MODEL

    return EXAMPLE_MODEL
