"""epfuse.testing.strategies: importable strategies, used by the project's property suite and
by users' suites (the README's pytest example runs here as a user would run it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import onnx
from hypothesis import given, settings
from hypothesis import strategies as st

import epfuse
from epfuse.testing.model_builder import DecoderConfig, build_decoder
from epfuse.testing.strategies import (
    ModelSignature,
    decoder_configs,
    scenario_lists,
    scenarios,
)

README = Path(__file__).parents[2] / "README.md"
W = 8


def _positions(s) -> int:
    if s.kind == "prompt":
        return max(s.lens)
    if s.kind == "padded_decode":
        return max(s.lens) + s.steps
    return s.past_len + s.new_len


def test_signature_of_a_pair_reaches_past_its_windows():
    original = build_decoder(DecoderConfig(style="mobius", sliding_window=W, layers=1))
    sig = ModelSignature.of(original, epfuse.optimize(original, "cpu"))
    assert sig.lengths == (W,) and sig.max_len >= W + 4 and sig.chunk_batch == 1
    assert sig.has_cache


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_drawn_scenarios_stay_in_the_signature(data):
    sig = ModelSignature(max_len=data.draw(st.integers(1, 20)), chunk_batch=1, lengths=(W,))
    for s in data.draw(scenario_lists(sig, min_size=1)):
        assert _positions(s) <= sig.max_len + 5
        if s.kind == "continue" and s.new_len > 1:
            assert s.batch == 1
    prompt_only = ModelSignature(has_cache=False)
    assert data.draw(scenarios(prompt_only)).kind == "prompt"


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(cfg=decoder_configs(dtypes=("float32",)))
def test_decoder_configs_build(cfg):
    model = build_decoder(cfg)
    assert len(model.graph.output) == 1 + 2 * cfg.layers


def test_readme_pytest_example_runs(tmp_path):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (example,) = [b for b in blocks if "ModelSignature" in b]
    original = build_decoder(DecoderConfig(style="torch23", sliding_window=3, layers=1))
    onnx.save(original, tmp_path / "model.onnx")
    onnx.save(epfuse.optimize(original, "cpu"), tmp_path / "model.cpu.onnx")
    (tmp_path / "test_user.py").write_text(example.replace("max_examples=50", "max_examples=8"))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
