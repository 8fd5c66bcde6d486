"""Numerical equivalence harness: does an optimized decoder compute what the original did?

Both models run on ONNX Runtime CPU sessions over a fixed set of scenarios with fixed seeds:

- ``prompt``: batch 2, ``prompt_len`` new tokens, empty past, all-ones mask.
- ``decode``: the ORIGINAL model runs an unpadded batch-2 prompt of ``decode_past_len`` tokens;
  its presents are the past of both models for 1 new token.
- ``chunk``: same with batch 1, a ``chunk_past_len``-token past and ``chunk_len`` new tokens
  (chunked prefill).
- ``padded``: batch 2, right-padded prompt of lengths ``padded_lens`` (default ``prompt_len``
  and about half of it), mask ``[1]*L + [0]*(prompt_len-L)``, position_ids ``arange``.
- ``padded_decode``: the padded prompt of ``padded_decode_lens`` (default ``padded_lens``), then
  ``padded_decode_steps`` decode steps, each model on its own cache, the prompt's padding kept
  as zeros in the mask. The only built-in scenario where a lost padding mask shows (causality
  hides padded keys from the valid rows of a right-padded prompt); see :class:`Scenario`.

Any batch and lengths can be given as explicit :class:`Scenario` objects (the property tests
draw them). Logits are compared on valid rows ``(b, :L_b)`` and present K/V on valid rows
``(b, :, :past+L_b, :)``, with the tolerance of the model's dtype from
:mod:`epfuse.tolerances`. A model without past inputs or present outputs is compared
on prompt scenarios only (the others are reported as skipped).

Model I/O is discovered from each graph by role, by shape, type and consumer (not by name), so
either model may rename inputs (:func:`discover_io`): the token input (or ``inputs_embeds``),
the mask, optional positions, past K/V inputs paired with present outputs, and the logits.
Default lengths are read from both graphs (:mod:`.limits`): past every sliding window and
length threshold, within the positions the models take.

A position input of shape (3, batch, seq) (mRoPE: temporal, height, width streams) is fed
``position_streams(position_ids)`` for the scenario's 2-D token positions, by default the
same position in all three streams (text only). A caller passes its own map, e.g. image-like
positions, as a pure function of the token index so that prompt and continuation agree.

Only onnxruntime and numpy are needed (no torch).
"""

from __future__ import annotations

from .comparison import OutputComparison, ScenarioResult, VerificationResult
from .feeds import PositionStreams, position_feed, text_positions
from .roles import KVSpec, ModelIO, discover_io
from .runner import Comparator, LengthError, ModelLike, assert_equivalent, compare_models
from .scenarios import SCENARIO_KINDS, SCENARIOS, Scenario, builtin_scenarios

__all__ = [
    "SCENARIOS",
    "SCENARIO_KINDS",
    "Comparator",
    "KVSpec",
    "LengthError",
    "ModelIO",
    "ModelLike",
    "OutputComparison",
    "PositionStreams",
    "Scenario",
    "ScenarioResult",
    "VerificationResult",
    "assert_equivalent",
    "builtin_scenarios",
    "compare_models",
    "discover_io",
    "position_feed",
    "text_positions",
]
