"""The arrays a scenario step feeds: tokens, right-padded masks, positions (2-D, or the
(3, batch, seq) streams of an mRoPE model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .roles import ModelIO

PositionStreams = Callable[[np.ndarray], np.ndarray]
"""(batch, seq) token positions -> (3, batch, seq) mRoPE position streams."""


def text_positions(position_ids: np.ndarray) -> np.ndarray:
    """Text-only mRoPE positions: the same position in the T, H and W streams."""
    return np.broadcast_to(position_ids, (3, *position_ids.shape)).copy()


def position_feed(
    io: ModelIO, positions: np.ndarray, streams: PositionStreams | None = None
) -> np.ndarray:
    """The ``position_ids`` feed for a scenario's 2-D (batch, seq) token positions.

    A model whose position input is (3, batch, seq) (mRoPE) gets ``streams(positions)``,
    by default :func:`text_positions` (the same positions in the T, H and W streams).
    """
    if io.position_streams:
        positions = (streams or text_positions)(positions)
    return np.ascontiguousarray(positions).astype(io.position_ids_dtype)


def _feed_float(dtype: str) -> Any:
    return {"float16": np.float16, "float64": np.float64}.get(dtype, np.float32)


@dataclass(frozen=True)
class _Case:
    """Inputs of one scenario step plus the valid lengths of each batch row."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    past_len: int
    new_lens: tuple[int, ...]  # valid new tokens per row


def _tokens(rng: np.random.Generator, shape: tuple[int, ...], vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=shape, dtype=np.int64)


def _prompt_case(
    rng: np.random.Generator, batch: int, lens: Sequence[int], vocab: int, width: int | None = None
) -> _Case:
    width = width or max(lens)
    ids = _tokens(rng, (batch, width), vocab)
    mask = np.zeros((batch, width), np.int64)
    for b, n in enumerate(lens):
        mask[b, :n] = 1
    pos = np.tile(np.arange(width, dtype=np.int64), (batch, 1))
    return _Case(ids, mask, pos, 0, tuple(lens))


def _continue_case(rng: np.random.Generator, batch: int, past: int, new: int, vocab: int) -> _Case:
    ids = _tokens(rng, (batch, new), vocab)
    mask = np.ones((batch, past + new), np.int64)
    pos = np.tile(np.arange(past, past + new, dtype=np.int64), (batch, 1))
    return _Case(ids, mask, pos, past, (new,) * batch)
