"""RoPE caches chosen at run time between two constants: ``Where(cond, long_cache, short_cache)``.

LongRoPE (Phi-3.5-mini, Phi-4-mini) rotates with one of two frequency sets, chosen per call by
Hugging Face's ``max(position_ids) + 1 > original_max_position_embeddings``. The canonical form
(``canonicalize/rope_caches``) keeps that condition as the graph computes it and selects
between two constant cache pairs with a scalar ``Where``; this module is the one reading of
that form for the rules that consume caches (the GQA lowering passes the selected caches to
``cos_cache``/``sin_cache``; the length limits read their rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._graph import const_array


@dataclasses.dataclass(frozen=True)
class SwitchedCache:
    """``value = Where(cond, when_true, when_false)`` of two constant (rows, width) caches."""

    cond: ir.Value
    when_true: np.ndarray
    when_false: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.when_true.shape)


def switched_cache(value: ir.Value | None) -> SwitchedCache | None:
    """The :class:`SwitchedCache` ``value`` is, or None: a ``Where`` whose condition is a
    boolean scalar (so one cache is taken whole, never mixed row by row) and whose branches are
    constant 2-D caches of one shape and dtype."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx"):
        return None
    cond, a, b = node.inputs
    if cond is None or cond.dtype != ir.DataType.BOOL or cond.shape is None:
        return None
    if any(not isinstance(d, int) or d != 1 for d in cond.shape):
        return None  # a rank-0 (or all-ones) condition picks one cache whole
    when_true, when_false = const_array(a), const_array(b)
    if when_true is None or when_false is None or when_true.ndim != 2:
        return None
    if when_true.shape != when_false.shape or when_true.dtype != when_false.dtype:
        return None
    return SwitchedCache(cond, when_true, when_false)
