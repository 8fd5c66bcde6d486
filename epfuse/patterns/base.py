"""The rule protocol shared by every rewrite, and the context a rule runs in.

A rule is anchored on one op type. The driver (``epfuse.optimizer.manager``) offers it each
node of that type; the rule answers with one of three outcomes:

* ``None`` — not its business (the node is not the shape it rewrites); nothing is recorded;
* :class:`Kept` — the node *is* its shape, but the rewrite cannot be proven safe for this EP
  or this graph; its reason code and message go into the report and the graph is left untouched;
* :class:`Rewritten` — the graph was changed; a short note goes into the report.

A rule must not modify the graph unless it returns ``Rewritten``: checks come first.
Each lowering rule declares ``emits`` — the capabilities (``epfuse.capabilities.emissions``,
the one emission table) its output needs of the EP for the model's dtype; ``requires()``
derives from it, so the pass manager can select rules by capability and say why one was not
selected. A rule refines ``requires()`` only for a condition the table cannot say.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, ClassVar

import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .reasons import ReasonCode

if TYPE_CHECKING:
    from epfuse.capabilities import EPCapabilities, OpSupport


class Stage(enum.Enum):
    CANONICALIZE = "canonicalize"
    LOWER = "lower"
    FINALIZE = "finalize"
    """Lowering that must see the attention decisions first (e.g. splitting RoPE out for an
    EP without fused rotary only once GQA has decided not to take it)."""
    LEGALIZE = "legalize"
    """After lowering: every node the EP's record does not take becomes one it does, or its
    primitive expansion (``epfuse.patterns.legalize``)."""


@dataclasses.dataclass(frozen=True)
class Kept:
    code: ReasonCode
    """What kind of obstacle stopped the rewrite: stable, for code and tests to read."""
    message: str
    """The same for people: shown in the report as given."""


@dataclasses.dataclass(frozen=True)
class AttentionFacts:
    """What an attention lowering emitted, as fields: the report's ``LayerReport.facts``,
    which the API, the genai packager and tests read instead of the note's prose."""

    op: str
    """``domain::op_type`` of the fused node (``com.microsoft::GroupQueryAttention``)."""
    num_heads: int
    kv_num_heads: int
    head_size: int
    do_rotary: bool = False
    """RoPE fused into the node (then ``rotary_*`` describe it)."""
    rotary_dim: int | None = None
    rotary_interleaved: bool = False
    rotary_cache_rows: int | None = None
    """Rows of the fused cos/sin caches: the positions the node takes."""
    local_window_size: int | None = None
    """The proven sliding window (None: full causal)."""
    softcap: float | None = None
    head_sink: bool = False


@dataclasses.dataclass(frozen=True)
class Rewritten:
    note: str = ""
    layer_result: str | None = None
    """For attention rules: what the layer became (e.g. ``GroupQueryAttention(do_rotary=1)``)."""
    fused: bool = True
    """With ``layer_result``: whether the layer now counts as fused (legalizing a layer into
    standard or primitive ops does not)."""
    facts: AttentionFacts | None = None
    """With ``layer_result``: the fused node's parameters, for readers (not prose)."""


Outcome = Kept | Rewritten | None


LAYER_KEY = "epfuse.layer"
"""Node metadata key holding the attention-layer index the pass manager gave the node."""


FLOAT64_SOURCES = "epfuse.float64-sources"
"""RewriteContext.cache key: initializer name -> float64 source array."""


@dataclasses.dataclass
class OptimizeOptions:
    max_seq_len: int = 4096
    """Rows of the constant cos/sin caches made from run-time RoPE; longer sequences fail in ORT."""
    skip_layers: frozenset[int] = frozenset()
    """Attention layers (report indices) that no lowering rule may touch; they keep their
    canonical standard form. Used by ``optimize(verify=True)`` to roll back layers whose
    rewrite fails verification."""
    disabled_rules: dict[str, str] = dataclasses.field(default_factory=dict)
    """Rules (by name) the pass manager runs not at all, with why: set by the API for a rule
    whose rewrite failed (raised, or made the graph cyclic) on this model."""
    check_rewrites: bool = False
    """Check the graph for a cycle after every rewrite (quadratic: only used by the API to
    find which rule broke a run, after a cheap whole-run check failed)."""


@dataclasses.dataclass
class RewriteContext:
    model: ir.Model
    ep: EPCapabilities
    dtype: str
    options: OptimizeOptions
    cache: dict[Any, Any] = dataclasses.field(default_factory=dict)
    """Per-run memo for values built once per graph (seqlens_k, total length, ...)."""

    @property
    def graph(self) -> ir.Graph:
        return self.model.graph

    @property
    def ops(self) -> OpSupport:
        return self.ep.ops(self.dtype)

    def record_float64(self, value: ir.Value, array64: Any) -> None:
        """Remember the float64 array a constant was rounded from (RoPE caches), so that a
        later precision conversion rounds it once from float64 instead of twice."""
        if value.name:
            self.cache.setdefault(FLOAT64_SOURCES, {})[value.name] = array64

    def float64_sources(self) -> dict[str, Any]:
        """Initializer name -> the float64 array it was built from (see ``record_float64``)."""
        return self.cache.get(FLOAT64_SOURCES, {})

    def skips(self, node: ir.Node) -> bool:
        """True when ``node`` belongs to a layer in ``options.skip_layers``.

        The pass manager never offers a lowering rule the attention node of a skipped layer;
        a lowering anchored on another op of the layer must ask this before editing.
        """
        layer = node.metadata_props.get(LAYER_KEY)
        return layer is not None and int(layer) in self.options.skip_layers


class Rule:
    """Base class of all rewrite rules. Subclasses set the class attributes and ``apply``."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    anchor: ClassVar[tuple[str, str]]
    """(domain, op_type) of the nodes offered to ``apply``; domain "" is ONNX."""
    description: ClassVar[str] = ""
    emits: ClassVar[tuple[Capability, ...]] = ()
    """Capabilities every output of the rule needs (features it adds only to some nodes, e.g.
    GQA's softcap, are checked per node in ``apply``)."""

    def requires(self, ops: OpSupport, ep: EPCapabilities) -> str | None:
        """None when the EP can take this rule's output for the dtype, else why not."""
        for capability in self.emits:
            if not capability.supported_by(ops):
                return capability.lacking(ep.name)
        return None

    def apply(self, node: ir.Node, ctx: RewriteContext) -> Outcome:
        raise NotImplementedError
