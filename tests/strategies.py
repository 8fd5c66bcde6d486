"""Hypothesis strategies for equivalence fuzzing: decoder configs and in-contract inputs.

``decoder_configs()`` draws :class:`model_builder.DecoderConfig` values (their repr is the
reproducible form hypothesis prints for a failing example: paste it into
``build_decoder(DecoderConfig(...))``). ``scenario_lists()`` draws explicit
:class:`epfuse.optimizer.verify.Scenario` values inside the input contract of a GQA-fused
model (README "Input contract"):

- right padding only (``Scenario.prompt`` rows are ones then zeros);
- positions contiguous from 0 on a first prompt, ``past + arange`` afterwards;
- chunked prefill (past > 0 and several new tokens) with batch 1 (ORT CPU's GQA);
- decode after a padded prompt with the prompt's padding kept in the mask
  (``Scenario.padded_decode``);
- lengths past a sliding window.

3-D positions (mRoPE, issue 4) are not drawn here: the builder has no mRoPE form yet. The
extension point is :func:`epfuse.optimizer.verify.position_feed` (with ``position_streams``) (how 2-D scenario positions
become the model's position feed) plus a ``mrope_section`` field in ``decoder_configs``.
"""

from __future__ import annotations

from hypothesis import note
from hypothesis import strategies as st
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.verify import Scenario, compare_models

# head_dim: 16 and 32 take GQA with fused RoPE on CPU; 8 and 24 are GQA-legal (multiple of 8)
# but not for fused rotary (head_size % 16), so RoPE must stay outside. The fused sizes are
# listed twice: drawn twice as often, since most rewrite logic (fused rotary) lives there.
HEAD_DIMS = (16, 32, 16, 32, 8, 24)
MAX_LEN = 12  # longest drawn prompt / past: beyond every drawn sliding window (<= 8)


@st.composite
def decoder_configs(
    draw: st.DrawFn,
    dtypes: tuple[str, ...] = ("float32", "float16"),
    styles: tuple[str, ...] = ("torch23", "mobius"),
    max_layers: int = 3,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    rotary_dims: tuple[int, ...] = (8, 16),
) -> DecoderConfig:
    """A small decoder: 1-3 layers, GQA/MQA/MHA head layouts, full/partial/interleaved RoPE,
    softcap, sliding window, either graph style, fp32 or fp16."""
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


def _lens(batch: int, low: int = 1) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(low, MAX_LEN), min_size=batch, max_size=batch).map(tuple)


@st.composite
def scenarios(draw: st.DrawFn, chunk_batch: int = 1) -> Scenario:
    """One in-contract scenario: prompt (right-padded), decode, chunked prefill (batch up to
    ``chunk_batch``: 1 where ORT CPU's GQA runs it) or decode after a padded prompt; batch
    1-3; past and prompt lengths including 0 and 1."""
    kind = draw(st.sampled_from(("prompt", "decode", "chunk", "padded_decode")))
    batch = draw(st.integers(1, 3))
    if kind == "prompt":
        return Scenario.prompt(draw(_lens(batch)))
    if kind == "decode":
        return Scenario.continuation(batch, draw(st.integers(0, MAX_LEN)), 1)
    if kind == "chunk":
        batch = draw(st.integers(1, chunk_batch))
        return Scenario.continuation(batch, draw(st.integers(0, MAX_LEN)), draw(st.integers(2, 5)))
    lens = draw(_lens(max(batch, 2)))
    return Scenario.padded_decode(lens, steps=draw(st.integers(1, 2)))


def scenario_lists(max_size: int = 4, chunk_batch: int = 1) -> st.SearchStrategy[list[Scenario]]:
    """2..max_size scenarios with distinct names (a name seeds the scenario's inputs)."""
    return st.lists(
        scenarios(chunk_batch=chunk_batch),
        min_size=2,
        max_size=max_size,
        unique_by=lambda s: s.name,
    )


def check_equivalent(cfg: DecoderConfig, ep: str, cases: list[Scenario]) -> None:
    """The property: build ``cfg``, optimize for ``ep``, compare on ``cases``.

    Fails with the comparison table; the notes (printed by hypothesis with the falsifying
    example) hold the reproducible config and the optimization report.
    """
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, ep, precision=cfg.dtype)
    note(f"reproduce: build_decoder({cfg!r}), optimize for {ep!r}")
    note(report.summary())
    result = compare_models(original, optimized, scenarios=cases)
    assert result.passed, f"{cfg!r} on {ep}:\n{result}"
