"""Hypothesis strategies for equivalence fuzzing, for ``epfuse fuzz`` and users' own suites.

The only epfuse module that imports hypothesis (the ``fuzz`` extra): ``import epfuse`` and
``epfuse.optimize`` never do.

- :func:`scenarios` / :func:`scenario_lists` draw :class:`epfuse.optimizer.verify.Scenario`
  values inside the input contract of a model (README "Input contract") described by a
  :class:`ModelSignature` (``ModelSignature.of(original, optimized)`` reads it from the
  graphs): right padding only, positions contiguous from 0 on a first prompt and
  ``past + arange`` after it (decode and chunked prefill continue the original's own cache),
  decode after a padded prompt with the prompt's padding kept in the mask, and lengths up to
  past every sliding window, length threshold (LongRoPE) and chunk, with lengths next to each
  of those drawn often. Token ids are drawn by :func:`seeds` (the seed of the comparison's
  uniform draw over the vocabulary), so a failure replays as ``epfuse verify --scenario NAME
  --seed S``.
- :func:`decoder_configs` draws the small decoders the project's own property suite fuzzes
  (:class:`epfuse.testing.model_builder.DecoderConfig`; its repr rebuilds the model), and
  :func:`check_equivalent` is that suite's property: build, optimize for an EP, compare.

A user's pytest suite (see README "Equivalence fuzzing")::

    from hypothesis import given, settings
    from epfuse.optimizer.verify import Comparator
    from epfuse.testing.strategies import ModelSignature, scenario_lists, seeds

    PAIR = Comparator("model.onnx", "model.cpu.onnx")
    SIGNATURE = ModelSignature.of_comparator(PAIR)

    @settings(max_examples=50, deadline=None, derandomize=True)
    @given(cases=scenario_lists(SIGNATURE), seed=seeds())
    def test_optimized_model_is_equivalent(cases, seed):
        result = PAIR.run(cases, seed)
        assert result.passed, str(result)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import note
from hypothesis import strategies as st

from epfuse.optimizer.verify import Comparator, Scenario, compare_models
from epfuse.optimizer.verify.limits import default_lengths

from .model_builder import DecoderConfig, build_decoder

MIN_MAX_LEN = 12
"""Drawn prompt and past lengths reach at least this far (the project's historical range)."""
MAX_STEPS = 2  # decode steps after a padded prompt
MAX_NEW = 5  # new tokens of a chunked prefill

# head_dim: 16 and 32 take GQA with fused RoPE on CPU; 8 and 24 are GQA-legal (multiple of 8)
# but not for fused rotary (head_size % 16), so RoPE must stay outside. The fused sizes are
# listed twice: drawn twice as often, since most rewrite logic (fused rotary) lives there.
HEAD_DIMS = (16, 32, 16, 32, 8, 24)


@dataclasses.dataclass(frozen=True)
class ModelSignature:
    """What the scenario strategies need to know about a model (pair)."""

    has_cache: bool = True
    """Past inputs and present outputs: decode, chunked prefill and padded decode are drawn."""
    max_len: int = MIN_MAX_LEN
    """Longest drawn prompt or past; a chunk adds up to 5 new tokens, a padded prompt 2
    decode steps (so no scenario needs more than ``max_len + 5`` positions)."""
    chunk_batch: int = 1
    """Largest batch of a chunked prefill (ORT CPU's GroupQueryAttention takes 1)."""
    max_batch: int = 3
    lengths: tuple[int, ...] = ()
    """Sliding windows and length thresholds: lengths next to them are drawn often."""

    @classmethod
    def of(cls, original: Any, optimized: Any = None, max_len: int | None = None):
        """Read from the models (paths, ModelProtos or onnx_ir Models)."""
        return cls.of_comparator(Comparator(original, optimized or original), max_len)

    @classmethod
    def of_comparator(cls, pair: Comparator, max_len: int | None = None) -> ModelSignature:
        limits = pair.limits
        longest = max(limits.longest + 4, MIN_MAX_LEN, default_lengths(limits)["prompt_len"] + 1)
        reach = max_len if max_len is not None else longest
        if limits.max_positions is not None:
            reach = min(reach, limits.max_positions - MAX_NEW)
        return cls(
            has_cache=pair.has_cache,
            max_len=max(1, reach),
            chunk_batch=1 if pair.gqa else 3,
            lengths=tuple(sorted({*limits.windows, *limits.thresholds})),
        )


def _length(sig: ModelSignature, low: int, high: int) -> st.SearchStrategy[int]:
    """A length in [low, high]; next to a window or threshold (T-1 .. T+2) half the time."""
    high = max(low, high)
    near = sorted({n for t in sig.lengths for n in (t - 1, t, t + 1, t + 2) if low <= n <= high})
    uniform = st.integers(low, high)
    return st.one_of(st.sampled_from(near), uniform) if near else uniform


def _lens(sig: ModelSignature, batch: int, high: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(_length(sig, 1, high), min_size=batch, max_size=batch).map(tuple)


@st.composite
def scenarios(draw: st.DrawFn, signature: ModelSignature | None = None) -> Scenario:
    """One in-contract scenario for ``signature`` (default: the project's small decoders):
    a right-padded prompt, decode on a real past, chunked prefill (batch up to
    ``chunk_batch``) or decode after a padded prompt; batch 1..max_batch; past and prompt
    lengths including 0 and 1."""
    sig = signature or ModelSignature()
    kinds = ("prompt", "decode", "chunk", "padded_decode") if sig.has_cache else ("prompt",)
    kind = draw(st.sampled_from(kinds))
    batch = draw(st.integers(1, sig.max_batch))
    top = sig.max_len
    if kind == "prompt":
        return Scenario.prompt(draw(_lens(sig, batch, top)))
    if kind == "decode":
        return Scenario.continuation(batch, draw(_length(sig, 0, top)), 1)
    if kind == "chunk":
        batch = draw(st.integers(1, sig.chunk_batch))
        past = draw(_length(sig, 0, top))
        return Scenario.continuation(batch, past, draw(st.integers(2, MAX_NEW)))
    lens = draw(_lens(sig, max(batch, 2), top))
    return Scenario.padded_decode(lens, steps=draw(st.integers(1, MAX_STEPS)))


def scenario_lists(
    signature: ModelSignature | None = None,
    min_size: int = 2,
    max_size: int = 4,
    chunk_batch: int | None = None,
) -> st.SearchStrategy[list[Scenario]]:
    """``min_size``..``max_size`` scenarios with distinct names (a name seeds the inputs).
    ``chunk_batch`` overrides the signature's."""
    sig = signature or ModelSignature()
    if chunk_batch is not None:
        sig = dataclasses.replace(sig, chunk_batch=chunk_batch)
    return st.lists(
        scenarios(sig), min_size=min_size, max_size=max_size, unique_by=lambda s: s.name
    )


def seeds() -> st.SearchStrategy[int]:
    """Seeds of the token ids (uniform over the vocabulary, per scenario name)."""
    return st.integers(0, 2**31 - 1)


# ------------------------------------------------------- the project's own decoder configs


@st.composite
def decoder_configs(
    draw: st.DrawFn,
    dtypes: tuple[str, ...] = ("float32", "float16"),
    styles: tuple[str, ...] = ("torch23", "mobius"),
    max_layers: int = 3,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    rotary_dims: tuple[int, ...] = (8, 16),
) -> DecoderConfig:
    """A small decoder (:class:`epfuse.testing.model_builder.DecoderConfig`; its repr is
    the reproducible form hypothesis prints, paste it into ``build_decoder(...)``): 1-3
    layers, GQA/MQA/MHA head layouts, full/partial/interleaved RoPE, softcap, sliding window,
    either graph style, fp32 or fp16."""
    kv_heads = draw(st.sampled_from((1, 2, 4)))
    group = draw(st.sampled_from((1, 2, 4)).filter(lambda g, kv=kv_heads: kv * g <= 8))
    head_dim = draw(st.sampled_from(head_dims))
    partial = [r for r in rotary_dims if r < head_dim]
    rotary_dim = draw(st.sampled_from((None, *partial))) if partial else None
    return DecoderConfig(
        layers=draw(st.integers(1, max_layers)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        interleaved=draw(st.booleans()),
        softcap=draw(st.sampled_from((0.0, 0.0, 2.0, 30.0))),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 8))),
        vocab=64,
        intermediate=32,
        dtype=draw(st.sampled_from(dtypes)),
        style=draw(st.sampled_from(styles)),
        seed=draw(st.integers(0, 3)),
    )


def check_equivalent(cfg: DecoderConfig, ep: str, cases: list[Scenario]) -> None:
    """The property suite's property: build ``cfg``, optimize for ``ep``, compare on
    ``cases``. Fails with the comparison table; the notes (printed by hypothesis with the
    falsifying example) hold the reproducible config and the optimization report."""
    import epfuse

    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, ep, precision=cfg.dtype)
    note(f"reproduce: build_decoder({cfg!r}), optimize for {ep!r}")
    note(report.summary())
    result = compare_models(original, optimized, scenarios=cases)
    assert result.passed, f"{cfg!r} on {ep}:\n{result}"
