"""optimize runs with fewer collector passes and gives the caller's thresholds back."""

from __future__ import annotations

import gc

import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.errors import EpfuseError
from epfuse.optimizer._collection import YOUNG_THRESHOLD, fewer_collections
from epfuse.patterns import RULES, Rule, Stage


class _SeesThreshold(
    Rule, name="test-sees-gc-threshold", stage=Stage.CANONICALIZE, anchor="MatMul"
):
    """Records the collector's young threshold while the run matches."""

    def __init__(self):
        self.seen: list[int] = []

    def match(self, node, ctx):
        self.seen.append(gc.get_threshold()[0])
        return None


@pytest.fixture
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_a_run_collects_less_and_restores_the_thresholds(default_thresholds):
    probe = _SeesThreshold()
    epfuse.optimize(build_decoder(DecoderConfig()), "cpu", rules=(*RULES, probe))
    assert probe.seen and set(probe.seen) == {YOUNG_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)


def test_the_thresholds_come_back_after_an_error(default_thresholds):
    with pytest.raises(EpfuseError):
        epfuse.optimize(b"not a model", "cpu")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("young", [0, 2 * YOUNG_THRESHOLD])
def test_a_disabled_or_higher_threshold_is_left_alone(young):
    saved = gc.get_threshold()
    gc.set_threshold(young, 10, 10)
    try:
        with fewer_collections():
            assert gc.get_threshold() == (young, 10, 10)
        assert gc.get_threshold() == (young, 10, 10)
    finally:
        gc.set_threshold(*saved)
