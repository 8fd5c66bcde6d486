"""Shared test set-up: import path for the test helpers, hypothesis profiles, fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # `import model_builder` from any test folder

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=12,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=25, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def example_model() -> Path:
    from epfuse.examples import EXAMPLE_MODEL

    return EXAMPLE_MODEL
