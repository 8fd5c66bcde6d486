"""The rule protocol shared by every rewrite, and the context a rule runs in.

A rule is anchored on one op type. The driver (``epfuse.optimizer.manager``) offers it each
node of that type; the rule answers with one of three outcomes:

* ``None`` — not its business (the node is not the shape it rewrites); nothing is recorded;
* :class:`Kept` — the node *is* its shape, but the rewrite cannot be proven safe for this EP
  or this graph; its reason code and message go into the report and the graph is left untouched;
* :class:`Rewritten` — the graph was changed; a short note goes into the report.

A rule is three steps the base class drives (``Rule.apply``): ``match(node, ctx)`` finds its
shape around the anchor and returns a match object (or ``None``, or a ``Kept`` when the shape
is there but malformed); ``check(match, ctx)`` holds the proofs (EP capabilities, ORT
evaluations) and returns a ``Kept`` or ``None``; ``rewrite(match, ctx)`` edits the graph and
returns ``Rewritten``. Only ``rewrite`` may modify the graph: checks come first.
A rule declares itself in its class header, ``class X(Rule, name=..., stage=..., anchor=...,
emits=..., benefit=...)``, its docstring's first paragraph being the description the report
lists; a module of ``canonicalize``, ``lower`` or ``legalize`` that defines it is all it takes
to be in ``RULES`` (``epfuse.patterns.discover_rules``).
Each lowering rule declares ``emits`` — the capabilities (``epfuse.capabilities.emissions``,
the one emission table) its output needs of the EP for the model's dtype; ``requires()``
derives from it, so the pass manager can select rules by capability and say why one was not
selected. A rule refines ``requires()`` only for a condition the table cannot say.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .analysis.manager import A, AnalysisManager, Unproven
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
    kept: tuple[Kept, ...] = ()
    """With ``layer_result``: parts of the layer left outside the fused op (a rotation GQA
    cannot take, say), each with its reason code; they enter the layer's ``codes``/``reasons``."""


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
    """Per-run records keyed by names and constants (float64 sources, the opset upgrade);
    what is proven about graph values lives in ``analyses``."""
    analyses: AnalysisManager = dataclasses.field(init=False)
    """The run's typed analyses (``analysis.manager``): ask them with :meth:`analysis`."""

    def __post_init__(self) -> None:
        self.analyses = AnalysisManager(self.model.graph)

    @property
    def graph(self) -> ir.Graph:
        return self.model.graph

    def analysis(self, kind: type[A], *key: Any) -> A | Unproven | None:
        """The typed result of analysis ``kind`` for ``key`` (ir values/nodes themselves and
        scalars), computed once and cached while what it names is still in the graph."""
        return self.analyses.get(kind, self, *key)

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
    """Base class of all rewrite rules: declared by class keywords, run as match -> check ->
    rewrite (``apply``)."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    anchor: ClassVar[tuple[str, str]]
    """(domain, op_type) of the nodes offered to ``apply``; domain "" is ONNX. Declared as
    ``anchor="Op"`` for an ONNX op or ``anchor=("domain", "Op")``."""
    description: ClassVar[str] = ""
    emits: ClassVar[tuple[Capability, ...]] = ()
    """Capabilities every output of the rule needs (features it adds only to some nodes, e.g.
    GQA's softcap, are checked per node in ``check``)."""
    benefit: ClassVar[int] = 1
    """Among the rules of one stage anchored on one op, those of higher benefit are offered a
    node first (MLIR's PatternBenefit); equal benefits go by name. Raise it only where one
    rule's rewrite would hide another's shape, and say so where it is declared."""

    def __init_subclass__(
        cls,
        *,
        name: str | None = None,
        stage: Stage | None = None,
        anchor: str | tuple[str, str] | None = None,
        emits: tuple[Capability, ...] | None = None,
        benefit: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
        if stage is not None:
            cls.stage = stage
        if anchor is not None:
            cls.anchor = ("", anchor) if isinstance(anchor, str) else tuple(anchor)
        if emits is not None:
            cls.emits = tuple(emits)
        if benefit is not None:
            cls.benefit = benefit
        if "description" not in cls.__dict__ and cls.__doc__:
            cls.description = _first_paragraph(cls.__doc__)

    def requires(self, ops: OpSupport, ep: EPCapabilities) -> str | None:
        """None when the EP can take this rule's output for the dtype, else why not."""
        for capability in self.emits:
            if not capability.supported_by(ops):
                return capability.lacking(ep.name)
        return None

    def match(self, node: ir.Node, ctx: RewriteContext) -> Any:
        """The rule's shape around ``node`` (any object ``check`` and ``rewrite`` read), or
        ``None`` (not its shape), or a ``Kept`` (its shape, but in a form it cannot take)."""
        raise NotImplementedError

    def check(self, match: Any, ctx: RewriteContext) -> Kept | None:
        """The proofs the rewrite needs (EP record, evaluations on ORT): a ``Kept`` names the
        one that failed. It may record on the match what it proved (plans, built caches)."""
        return None

    def rewrite(self, match: Any, ctx: RewriteContext) -> Rewritten:
        """Edit the graph for a match that passed ``check``."""
        raise NotImplementedError

    def apply(self, node: ir.Node, ctx: RewriteContext) -> Outcome:
        """The driver the pass manager calls: match, then check, then rewrite."""
        found = self.match(node, ctx)
        if found is None or isinstance(found, Kept):
            return found
        kept = self.check(found, ctx)
        if kept is not None:
            return kept
        return self.rewrite(found, ctx)


def _first_paragraph(doc: str) -> str:
    """A docstring's first paragraph on one line (the rule's description)."""
    return " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())
