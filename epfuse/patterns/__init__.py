"""Rewrite rules, in three layers: ``canonicalize`` (exporter idioms -> standard ONNX),
``lower`` (standard ONNX -> what the chosen EP runs best) and ``legalize`` (whatever the EP's
record still does not take -> an op it does, or primitives). ``RULES`` lists them in order."""

from .base import AttentionFacts, Kept, OptimizeOptions, RewriteContext, Rewritten, Rule, Stage
from .canonicalize.attention_sinks import AttentionSinksToAttention
from .canonicalize.identity_ops import SameTypeCast, SingleInputConcat
from .canonicalize.kv_cache import KVConcatToAttentionPast
from .canonicalize.partial_rotary import PartialRotaryToRotaryDim
from .canonicalize.repeat_kv import RemoveRepeatKV
from .canonicalize.rms_norm import DecomposedRMSNormToRMSNormalization
from .canonicalize.rope_caches import RopeCosSinToCaches
from .canonicalize.rotate_half import RotateHalfToRotaryEmbedding
from .canonicalize.sdpa import DecomposedAttentionToAttention
from .canonicalize.shape_of_same_shape import ShapeOfSameShapeOp
from .canonicalize.split_rotary import SplitHalvesToRotaryEmbedding
from .legalize.expand import ExpandAttention, ExpandRMSNormalization, ExpandRotaryEmbedding
from .legalize.skip_norm import SkipSimplifiedToAddRMSNorm
from .lower.gqa import AttentionToGQA
from .lower.moe import ExpertsToMoE
from .lower.mrope import MRopeLowering
from .lower.ms_rotary import OnnxRotaryToContrib
from .lower.norms import (
    RMSNormToSimplified,
    SimplifiedToRMSNorm,
    SkipLayerNormFusion,
    SkipRMSNormFusion,
)
from .lower.pack_qkv import PackQKV
from .lower.qk_norm import QKNormIntoGQA
from .reasons import ReasonCode

RULES: tuple[Rule, ...] = (
    SingleInputConcat(),
    SameTypeCast(),
    DecomposedAttentionToAttention(),
    AttentionSinksToAttention(),
    RotateHalfToRotaryEmbedding(),
    SplitHalvesToRotaryEmbedding(),
    DecomposedRMSNormToRMSNormalization(),
    RopeCosSinToCaches(),
    PartialRotaryToRotaryDim(),
    RemoveRepeatKV(),
    KVConcatToAttentionPast(),
    ShapeOfSameShapeOp(),
    MRopeLowering(),
    AttentionToGQA(),
    QKNormIntoGQA(),
    PackQKV(),
    ExpertsToMoE(),
    SkipRMSNormFusion(),
    SkipLayerNormFusion(),
    RMSNormToSimplified(),
    SimplifiedToRMSNorm(),
    OnnxRotaryToContrib(),
    SkipSimplifiedToAddRMSNorm(),
    ExpandAttention(),
    ExpandRotaryEmbedding(),
    ExpandRMSNormalization(),
)

__all__ = [
    "RULES",
    "AttentionFacts",
    "Kept",
    "OptimizeOptions",
    "ReasonCode",
    "RewriteContext",
    "Rewritten",
    "Rule",
    "Stage",
]
