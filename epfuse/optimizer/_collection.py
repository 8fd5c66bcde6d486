"""Fewer garbage-collector passes while a model is optimized.

An optimization builds the model's IR (about ten objects per node and value, alive for the
whole run) and allocates a great many short-lived objects while it matches and proves.
CPython's cyclic collector runs a young-generation pass every 700 net allocations and, every
so often, a full pass over everything alive — the whole IR, again and again. On the 128-layer
benchmark that was about a third of the optimizer's time. Raising the young threshold during
the run keeps collection (cyclic garbage is still freed, only in larger batches: peak memory
measured the same) and restores the caller's thresholds afterwards, on error too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 50_000
"""Net allocations between young-generation passes during a run (CPython's default: 700)."""


@contextlib.contextmanager
def fewer_collections(young: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """Raise the collector's young threshold to ``young`` for the block; a collector the
    caller disabled (threshold 0) or already set at least as high is left alone."""
    saved = gc.get_threshold()
    if saved[0] == 0 or saved[0] >= young:
        yield
        return
    gc.set_threshold(young, *saved[1:])
    try:
        yield
    finally:
        gc.set_threshold(*saved)
