"""Stable codes for why a rule kept a node, so code and tests read the code, not the prose.

A :class:`~epfuse.patterns.base.Kept` outcome carries one of these plus a message for people;
the report keeps both (``LayerReport.codes``, ``RuleReport.kept_codes``). Codes are coarse on
purpose: they say what kind of obstacle stopped a rewrite, the message says which one.
"""

from __future__ import annotations

import enum


class ReasonCode(enum.StrEnum):
    EP_UNSUPPORTED = "ep-unsupported"
    """The EP's record has no op (or no attribute/feature of it) the rewrite would emit."""
    OPSET = "opset"
    """The rewrite needs a default opset the model does not have and cannot be raised to."""
    FORM = "form-not-recognized"
    """The node is the rule's anchor but the subgraph around it is not the recognized form."""
    SHAPE = "shape"
    """A rank, width or axis is unknown or not the one the fused op takes."""
    DTYPE = "dtype"
    """A dtype is unknown, differs between operands, or is one the fused op does not take."""
    HEADS = "heads"
    """Head counts or head size are not static, not consistent, or not divisible as needed."""
    OUTPUTS_USED = "outputs-used"
    """An output the fused op cannot produce (statistics, present KV, ...) is consumed."""
    NOT_EXPRESSIBLE = "not-expressible"
    """The node has a feature the fused op has no way to express."""
    MASK_NOT_PROVEN = "mask-not-proven"
    """The attention mask could not be proven causal (with or without a window)."""
    NOT_PROVEN = "not-proven"
    """Evaluation on ORT did not prove the rewrite equal (RoPE caches, sinks, mRoPE, MoE)."""
    ROPE_POSITIONS = "rope-positions"
    """RoPE positions the graph computes were not proven, by evaluation, to be the positions
    GroupQueryAttention's fused rotary uses (its own, or fed as position_ids)."""
    SKIPPED_LAYER = "skipped-layer"
    """The layer was excluded by ``skip_layers``; recorded by the pass manager, not a rule."""
    ROLLED_BACK = "rolled-back"
    """The layer's rewrite failed verification and was rolled back by the API."""
