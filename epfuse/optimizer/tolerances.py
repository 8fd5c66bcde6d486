"""Moved to :mod:`epfuse.tolerances` (a leaf, so ``capabilities`` need not import the
optimizer); this re-export keeps branches written before the move importing. Import
``epfuse.tolerances``."""

from epfuse.tolerances import (
    DRIFT,
    QUANTIZED_TOLERANCES,
    TOLERANCES,
    DriftBound,
    Tolerance,
    drift_bound,
    tolerance_for,
)

__all__ = [
    "DRIFT",
    "QUANTIZED_TOLERANCES",
    "TOLERANCES",
    "DriftBound",
    "Tolerance",
    "drift_bound",
    "tolerance_for",
]
