"""The hypothesis profile choice: `ci` by default, and `--hypothesis-profile` beats both the
environment variable and conftest's own load_profile call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

TESTS = Path(__file__).parent


def test_report_loaded_profile():
    """Prints the loaded profile for the subprocess runs below (and checks it exists)."""
    print(f"\nLOADED_PROFILE={settings._current_profile} max_examples={settings().max_examples}")
    assert settings._current_profile in ("ci", "dev", "thorough")


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, None, "ci max_examples=25"),
        ("thorough", "dev", "thorough max_examples=300"),
    ],
)
def test_cli_flag_wins(flag, env, expected):
    if os.environ.get("EPFUSE_PROFILE_PROBE"):
        pytest.skip("already inside a probe run")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        f"{__file__}::test_report_loaded_profile",
    ]
    if flag:
        command.append(f"--hypothesis-profile={flag}")
    environ = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    environ["EPFUSE_PROFILE_PROBE"] = "1"
    if env:
        environ["HYPOTHESIS_PROFILE"] = env
    out = subprocess.run(
        command, cwd=TESTS.parent, env=environ, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"LOADED_PROFILE={expected}" in out.stdout
