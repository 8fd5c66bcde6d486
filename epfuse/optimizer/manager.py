"""The pass manager: the optimizer's stages as onnx-ir passes, run in order on one model.

::

    InferTypes -> Canonicalize -> Precision -> Select -> Lower -> Finalize -> Legalize
      -> QuantizeInt4 -> CheckConformance -> CheckAcyclic -> Cleanup -> Summarize

Each stage is an ``onnx_ir.passes.InPlacePass`` whose ``call(model)`` returns a
:class:`StageResult` (an ``onnx_ir.passes.PassResult`` that also carries the run's
:class:`~epfuse.optimizer.report.Report`). The stages of one run share a :class:`RunState`
(the rewrite context, the report being written, the per-rule reports, the layers, the
selected rules), so any stage can be run alone on a state made by :meth:`RunState.begin`.
:class:`Pipeline` composes them like ``onnx_ir.passes.Sequential`` but lets a stage's
exception through unwrapped: the API's rollback catches :class:`RewriteFailure` by type.
Clean-up is onnx-ir's common passes.

The rule stages (canonicalize, lower, finalize, legalize) group their rules by the op they
anchor on; each sweeps the graph, offering every node to the rules anchored on its op, and
repeats until a sweep changes nothing (a fixed point; a stage without one after
``MAX_SWEEPS`` is a report warning). A sweep is linear in the number of nodes, and a rule
touches only a bounded neighbourhood, so the whole run stays linear in graph size (no
multi-output pattern search, no global re-optimization between rewrites).

Selection happens between the stages: a lowering rule whose ``requires`` fails for the EP and
dtype is not run at all, and the report says why. Validation of the result is done by the
caller (``epfuse.optimizer.api``), which never returns a model that fails it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import ClassVar

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from epfuse.capabilities import EPCapabilities
from epfuse.capabilities.conformance import Violation
from epfuse.patterns import (
    RULES,
    Kept,
    OptimizeOptions,
    ReasonCode,
    RewriteContext,
    Rewritten,
    Rule,
    Stage,
)
from epfuse.patterns.analysis.shapes import declared_names, refine_shapes
from epfuse.patterns.analysis.signature import DecoderSignature
from epfuse.patterns.base import LAYER_KEY
from epfuse.patterns.legalize._common import missing

from .precision import PrecisionPlan
from .precision.fp16 import convert_float
from .precision.int4 import quantize_int4
from .report import LayerReport, Report, RuleReport

MAX_SWEEPS = 8


class RewriteFailure(Exception):
    """A rule raised while rewriting, or the rewritten graph has a cycle: the graph may be
    half-edited, so the run is void. ``rule`` is None when the culprit is not known (the
    cycle was found after the stages); the API then reruns with ``check_rewrites``."""

    def __init__(self, rule: str | None, node: str | None, why: str):
        super().__init__(f"{rule or 'a rule'}: {why}" + (f" (at {node})" if node else ""))
        self.rule, self.node, self.why = rule, node, why


SKIPPED_REASON = "excluded by skip_layers: no lowering applied"


_ATTENTION_OPS = (("", "Attention"), ("com.microsoft", "GroupQueryAttention"))


def _is_attention(node: ir.Node) -> bool:
    return (node.domain, node.op_type) in _ATTENTION_OPS


def _is_attention_anchor(anchor: tuple[str, str]) -> bool:
    """Rules that decide what an attention layer becomes; their not being selected is a reason
    on every layer. Refinements anchored on an existing GQA (q/k norm, packing) and the norm
    and RoPE rules are reported per rule only."""
    return anchor == ("", "Attention")


# ---------------------------------------------------------------------------- run state


@dataclasses.dataclass
class RunState:
    """What the stages of one run share; :meth:`begin` makes it for a model."""

    ctx: RewriteContext
    report: Report
    rule_reports: dict[str, RuleReport]
    """Per rule of the rule set, in its order (the report's ``rules``)."""
    active: list[Rule]
    """The rule set less ``options.disabled_rules``."""
    precision: PrecisionPlan | None = None
    selected: list[Rule] = dataclasses.field(default_factory=list)
    """The non-canonicalize rules the EP's record takes (filled by :class:`Select`)."""
    layers: dict[int, LayerReport] = dataclasses.field(default_factory=dict)
    """Attention layers by index (labelled by :class:`Canonicalize`)."""
    start: float = dataclasses.field(default_factory=time.perf_counter)

    @classmethod
    def begin(
        cls,
        model: ir.Model,
        ep: EPCapabilities,
        dtype: str,
        options: OptimizeOptions,
        rules: tuple[Rule, ...] = RULES,
        precision: PrecisionPlan | None = None,
    ) -> RunState:
        report_options: dict = {"max_seq_len": options.max_seq_len}
        if options.skip_layers:
            report_options["skip_layers"] = sorted(options.skip_layers)
        report = Report(ep=ep.name, dtype=dtype, options=report_options)
        report.nodes_before = len(model.graph)
        rule_reports = {
            rule.name: RuleReport(rule.name, rule.stage.value, selected=True) for rule in rules
        }
        for name, why in options.disabled_rules.items():
            if name in rule_reports:
                rule_reports[name].selected = False
                rule_reports[name].not_selected_because = why
                report.warnings.append(f"{name} {why}")
        return cls(
            ctx=RewriteContext(model=model, ep=ep, dtype=dtype, options=options),
            report=report,
            rule_reports=rule_reports,
            active=[rule for rule in rules if rule.name not in options.disabled_rules],
            precision=precision,
        )

    def copy(self) -> RunState:
        """An independent copy of a run stopped after :data:`CANONICAL_STAGES`, for
        :meth:`PassManager.lower`: the model re-read from its serialization (types, shapes
        and layer labels included), the report copied, the run's memo fresh (its keys are the
        original's node objects; every entry is rebuilt on demand)."""
        model = ir.serde.deserialize_model(ir.serde.serialize_model(self.ctx.model))
        ctx = RewriteContext(
            model=model, ep=self.ctx.ep, dtype=self.ctx.dtype, options=self.ctx.options
        )
        report = copy.deepcopy(self.report)
        return RunState(
            ctx=ctx,
            report=report,
            rule_reports=copy.deepcopy(self.rule_reports),
            active=self.active,
            precision=self.precision,
            layers={layer.layer: layer for layer in report.layers},
        )


@dataclasses.dataclass
class StageResult(ir.passes.PassResult):
    """An onnx-ir pass result that also carries the run's report (the same object for every
    stage of a run: each stage adds to it)."""

    report: Report


class StagePass(ir.passes.InPlacePass):
    """One stage of a run: edits the run's model in place and writes into its report."""

    name: ClassVar[str]

    def __init__(self, state: RunState):
        self.state = state

    def requires(self, model: ir.Model) -> None:
        if model is not self.state.ctx.model:
            raise ir.passes.PreconditionError(
                f"{self.name}: the model is not the one this run's state was made for"
            )

    def call(self, model: ir.Model) -> StageResult:
        return StageResult(model, self.apply(model), self.state.report)

    def apply(self, model: ir.Model) -> bool:
        """Run the stage; True when it changed the graph."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Pipeline(ir.passes.Sequential):
    """``onnx_ir.passes.Sequential`` whose stage errors pass through as raised (Sequential
    wraps them in ``PassError``; the API tells a rule's failure by its type)."""

    def __init__(self, state: RunState, *passes: ir.passes.PassBase):
        super().__init__(*passes)
        self.state = state

    def call(self, model: ir.Model) -> StageResult:
        modified = False
        for stage in self.passes:
            result = stage(model)
            model, modified = result.model, modified or result.modified
        return StageResult(model, modified, self.state.report)


# ------------------------------------------------------------------------------- stages


class InferTypes(StagePass):
    """ONNX type and shape inference, then the dims it left anonymous where provable."""

    name = "infer-types"

    def apply(self, model: ir.Model) -> bool:
        failure = _infer_types(model)
        if failure:
            self.state.report.warnings.append(failure)
        return False  # types and shapes only: no node changes


class Canonicalize(StagePass):
    """Lift exporter idioms to the standard form, whatever the EP (its rules are never
    selected by capability: what the EP cannot take is the LEGALIZE stage's job); then label
    the attention layers the report is kept by."""

    name = "canonicalize"

    def apply(self, model: ir.Model) -> bool:
        state = self.state
        canonical = [rule for rule in state.active if rule.stage is Stage.CANONICALIZE]
        changed, kept = sweep(state, canonical)
        layers = _label_layers(model.graph, kept)
        state.report.layers = layers
        state.layers = {layer.layer: layer for layer in layers}
        for node, reason in kept:
            index = _layer_of(node)
            if index in state.layers and node.graph is model.graph:
                state.layers[index].keep(reason.code, reason.message)
        return changed


class Precision(StagePass):
    """Convert the canonical graph to the plan's compute dtype: before selection, so the
    record of the converted dtype decides the lowering."""

    name = "precision"

    def apply(self, model: ir.Model) -> bool:
        state, plan = self.state, self.state.precision
        if plan is None:
            return False
        state.report.precision = plan.to_dict()
        if not plan.converts:
            return False
        summary = convert_float(model, plan.compute_dtype, state.ctx.float64_sources())
        state.ctx.analyses.invalidate()  # values now compute in another dtype
        state.ctx.dtype = state.report.dtype = plan.compute_dtype
        state.report.precision["conversion"] = summary.describe()
        return True


class Select(StagePass):
    """Choose the lowering rules the EP's record takes; the others are reported (on every
    layer, for the rules that decide what an attention layer becomes)."""

    name = "select"

    def apply(self, model: ir.Model) -> bool:
        state = self.state
        state.selected = []
        for rule in state.active:
            if rule.stage is Stage.CANONICALIZE:
                continue
            reason = rule.requires(state.ctx.ops, state.ctx.ep)
            if reason is None:
                state.selected.append(rule)
                continue
            state.rule_reports[rule.name].selected = False
            state.rule_reports[rule.name].not_selected_because = reason
            if _is_attention_anchor(rule.anchor):
                for layer in state.report.layers:
                    layer.keep(ReasonCode.EP_UNSUPPORTED, reason)
        for index in sorted(state.ctx.options.skip_layers):
            if index in state.layers:
                state.layers[index].keep(ReasonCode.SKIPPED_LAYER, SKIPPED_REASON)
        return False


class _SelectedRules(StagePass):
    """Sweep the selected rules of one stage to a fixed point."""

    stage: ClassVar[Stage]

    def apply(self, model: ir.Model) -> bool:
        rules = [rule for rule in self.state.selected if rule.stage is self.stage]
        return sweep(self.state, rules)[0]


class Lower(_SelectedRules):
    """Standard ops -> what the EP runs best (GQA, contrib rotary, norm fusions, MoE)."""

    name, stage = "lower", Stage.LOWER


class Finalize(_SelectedRules):
    """Lowering that must see the attention decisions first."""

    name, stage = "finalize", Stage.FINALIZE


class Legalize(_SelectedRules):
    """Every node the record does not take -> one it does, or its primitive expansion."""

    name, stage = "legalize", Stage.LEGALIZE


class QuantizeInt4(StagePass):
    """int4 MatMul weights, last among the edits, so a packed QKV weight is one MatMul,
    quantized as one weight."""

    name = "quantize-int4"

    def apply(self, model: ir.Model) -> bool:
        plan = self.state.precision
        if plan is None or plan.int4 is None:
            return False
        common_passes.RemoveUnusedNodesPass()(model)
        self.state.report.precision["quantization"] = quantize_int4(model, plan.int4).describe()
        return True


class CheckConformance(StagePass):
    """Nodes the record still does not take after legalization go into
    ``report.violations`` (the API refuses such a model)."""

    name = "check-conformance"

    def apply(self, model: ir.Model) -> bool:
        self.state.report.violations = _violations(model.graph, self.state.ctx, self.state.layers)
        return False


class CheckAcyclic(StagePass):
    """One linear cycle check per run; the API finds the culprit by rerunning with a check
    after every rewrite (``OptimizeOptions.check_rewrites``)."""

    name = "check-acyclic"

    def apply(self, model: ir.Model) -> bool:
        if has_cycle(model.graph):
            raise RewriteFailure(None, None, "a rewrite made the graph cyclic")
        return False


class Cleanup(StagePass):
    """Drop the layer labels, then onnx-ir's dead-node, unused-opset and topological passes."""

    name = "cleanup"

    _COMMON = ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.RemoveUnusedOpsetsPass(),
        common_passes.TopologicalSortPass(),
    )

    def apply(self, model: ir.Model) -> bool:
        for node in model.graph:
            node.metadata_props.pop(LAYER_KEY, None)
        return self._COMMON(model).modified


class Summarize(StagePass):
    """The report's closing facts: rules, the input contract, node and op counts, time."""

    name = "summarize"

    def apply(self, model: ir.Model) -> bool:
        state, report, graph = self.state, self.state.report, model.graph
        report.rules = list(state.rule_reports.values())
        report.assumptions = _assumptions(graph, state.ctx.ep, state.ctx.dtype, state.ctx.options)
        report.nodes_after = len(graph)
        counts: dict[str, int] = defaultdict(int)
        for node in graph:
            counts[f"{node.domain + '::' if node.domain else ''}{node.op_type}"] += 1
        report.ops_after = dict(sorted(counts.items()))
        report.seconds = time.perf_counter() - state.start
        return False


class SummarizeReference(StagePass):
    """The reference run (nothing lowered) reports no layers, only nodes and time."""

    name = "summarize-reference"

    def apply(self, model: ir.Model) -> bool:
        report = self.state.report
        report.layers = []
        report.nodes_after = len(model.graph)
        report.seconds = time.perf_counter() - self.state.start
        return False


CANONICAL_STAGES: tuple[type[StagePass], ...] = (InferTypes, Canonicalize, Precision)
"""The stages that read no ``skip_layers`` (layers are labelled after canonicalize):
:meth:`PassManager.canonicalize`."""

LOWERING_STAGES: tuple[type[StagePass], ...] = (
    Select,
    Lower,
    Finalize,
    Legalize,
    QuantizeInt4,
    CheckConformance,
    CheckAcyclic,
    Cleanup,
    Summarize,
)
""":meth:`PassManager.lower`: the rest of a full run."""

STAGES: tuple[type[StagePass], ...] = CANONICAL_STAGES + LOWERING_STAGES
"""A full run, in order."""

REFERENCE_STAGES: tuple[type[StagePass], ...] = (
    InferTypes,
    Canonicalize,
    Precision,
    Cleanup,
    QuantizeInt4,
    SummarizeReference,
)
"""``lower=False``: the unfused model converted (and quantized) the same way."""


class PassManager:
    """Runs :data:`STAGES` with the rule set it is given (default ``patterns.RULES``)."""

    def __init__(self, rules: tuple[Rule, ...] = RULES):
        self.rules = rules

    def pipeline(self, state: RunState, *, lower: bool = True) -> Pipeline:
        """The run's stages as one onnx-ir pass (``pipeline(state)(model).report``)."""
        return Pipeline(state, *(stage(state) for stage in (STAGES if lower else REFERENCE_STAGES)))

    def run(
        self,
        model: ir.Model,
        ep: EPCapabilities,
        dtype: str,
        options: OptimizeOptions,
        *,
        precision: PrecisionPlan | None = None,
        lower: bool = True,
    ) -> Report:
        """Optimize ``model`` in place for ``ep``; ``dtype`` is the input's compute dtype.

        ``precision`` (see ``epfuse.optimizer.precision``) converts the canonical graph to its
        compute dtype before selection, so the converted dtype's record decides the lowering,
        and quantizes int4 weights after legalization. ``lower=False`` stops after the
        PRECISION stage (then quantizes as ``precision`` says): the unfused model converted
        the same way, which ``optimize(verify=True)`` compares the result with.
        """
        state = RunState.begin(model, ep, dtype, options, self.rules, precision)
        return self.pipeline(state, lower=lower)(model).report

    def canonicalize(
        self,
        model: ir.Model,
        ep: EPCapabilities,
        dtype: str,
        options: OptimizeOptions,
        *,
        precision: PrecisionPlan | None = None,
    ) -> RunState:
        """:data:`CANONICAL_STAGES` on ``model`` in place, with ``options.skip_layers``
        ignored: the same result for every skip set, which :meth:`lower` continues (the
        rollback of ``optimize(verify=True)`` lowers one :meth:`RunState.copy` per skip set)."""
        unskipped = dataclasses.replace(options, skip_layers=frozenset())
        state = RunState.begin(model, ep, dtype, unskipped, self.rules, precision)
        Pipeline(state, *(stage(state) for stage in CANONICAL_STAGES))(model)
        return state

    def lower(self, state: RunState, skip_layers: Iterable[int] = ()) -> Report:
        """:data:`LOWERING_STAGES` on a canonicalized run, offering no rule the attention of
        ``skip_layers``; the run's report (as :meth:`run` with those ``skip_layers``)."""
        skip = frozenset(skip_layers)
        state.ctx.options = dataclasses.replace(state.ctx.options, skip_layers=skip)
        if skip:
            state.report.options["skip_layers"] = sorted(skip)
        model = state.ctx.model
        return Pipeline(state, *(stage(state) for stage in LOWERING_STAGES))(model).report


# ------------------------------------------------------------------------------- driver


def sweep(state: RunState, rules: list[Rule]) -> tuple[bool, list[tuple[ir.Node, Kept]]]:
    """Sweep ``rules`` to a fixed point: (whether any rewrote, the (node, Kept) of the rules
    that kept a node in the last sweep).

    A stage still changing the graph after ``MAX_SWEEPS`` sweeps (two rules undoing each
    other, or a rule rewriting its own output) stops there: the graph is still valid (each
    rewrite is), but the report says so rather than returning as if converged.
    """
    by_anchor: dict[tuple[str, str], list[Rule]] = defaultdict(list)
    for rule in rules:
        by_anchor[rule.anchor].append(rule)
    if not by_anchor:
        return False, []
    ctx, rule_reports, layers = state.ctx, state.rule_reports, state.layers
    graph = ctx.graph
    modified = False
    for _ in range(MAX_SWEEPS):
        changed = False
        kept_now: dict[tuple[str, int], tuple[ir.Node, Kept]] = {}
        for node in list(graph):
            if node.graph is not graph:
                continue  # removed by an earlier rewrite in this sweep
            if ctx.options.skip_layers and ctx.skips(node):
                continue  # a skipped layer's attention is offered to no rule
            for rule in by_anchor.get((node.domain, node.op_type), ()):
                outcome = _apply(rule, node, ctx)
                if outcome is None:
                    continue
                if isinstance(outcome, Kept):
                    kept_now[(rule.name, id(node))] = (node, outcome)
                    continue
                assert isinstance(outcome, Rewritten)
                changed = modified = True
                rule_reports[rule.name].rewritten += 1
                layer = layers.get(_layer_of(node))
                if layer is not None and outcome.layer_result:
                    layer.result = outcome.layer_result
                    layer.fused = outcome.fused
                    layer.facts = outcome.facts
                    if outcome.note:
                        layer.notes.append(outcome.note)
                    for part in outcome.kept:
                        layer.keep(part.code, part.message)
                break
        if not changed:
            for (rule_name, _), (node, kept) in kept_now.items():
                rule_report = rule_reports[rule_name]
                rule_report.kept += 1
                if kept.message not in rule_report.kept_reasons:
                    rule_report.kept_reasons.append(kept.message)
                if kept.code not in rule_report.kept_codes:
                    rule_report.kept_codes.append(str(kept.code))
                layer = layers.get(_layer_of(node))
                if layer is not None and node.graph is graph:
                    layer.keep(kept.code, kept.message)
            return modified, list(kept_now.values())
    stage = rules[0].stage.value
    state.report.warnings.append(
        f"{stage} reached no fixed point after {MAX_SWEEPS} sweeps (rules still rewriting: "
        f"{', '.join(sorted({r.name for r in rules if rule_reports[r.name].rewritten}))})"
    )
    return modified, []


NOT_LIFTED = "attention not lifted"
"""The result of a layer whose KV cache no attention node reads after canonicalization."""


def _label_layers(graph: ir.Graph, kept: list = ()) -> list[LayerReport]:
    """One report per attention layer, numbered by the KV cache layer its node reads.

    A decoder layer whose attention was not lifted (no Attention reads its past) is still a
    layer of the model: it is listed, ``fused: false``, with the canonicalization's reasons
    for the nodes kept between its neighbours (so a partial lift never reads as "every layer
    fused"). Without a KV cache, or when the nodes do not map one to one onto its layers, the
    attention nodes are numbered in graph order and only they are listed."""
    attention = [node for node in graph if _is_attention(node)]
    pairs = DecoderSignature.of(graph).layers if attention else []
    order = _cache_layers(pairs, attention)
    layers: list[LayerReport] = []
    for index, node in zip(order or range(len(attention)), attention, strict=True):
        node.metadata_props[LAYER_KEY] = str(index)
        given = node.domain != ""  # the input's own GroupQueryAttention
        result = "GroupQueryAttention (input)" if given else "Attention (kept)"
        name = node.name or node.op_type
        layers.append(LayerReport(layer=index, node=name, result=result, from_input=given))
    if order is None or len(order) == len(pairs):
        return sorted(layers, key=lambda layer: layer.layer)
    position = {id(node): i for i, node in enumerate(graph)}
    lifted = dict(zip(order, (position[id(n)] for n in attention), strict=True))
    for index, (key, _value) in enumerate(pairs):
        if index in lifted:
            continue
        before = max((p for i, p in lifted.items() if i < index), default=-1)
        after = min((p for i, p in lifted.items() if i > index), default=len(position))
        report = LayerReport(layer=index, node=key.past.name or "", result=NOT_LIFTED)
        reasons = {
            (reason.code, reason.message)
            for node, reason in kept
            if node.graph is graph
            and _layer_of(node) is None
            and before < position.get(id(node), -1) < after
        }
        for code, message in sorted(reasons):
            report.keep(code, message)
        if not reasons:
            report.keep(
                ReasonCode.FORM, "no rule lifted this layer's attention (not a recognized form)"
            )
        layers.append(report)
    return sorted(layers, key=lambda layer: layer.layer)


def _cache_layers(pairs: list, attention: list[ir.Node]) -> list[int] | None:
    """The KV cache layer (index into ``pairs``, the signature's (key, value) per layer) each
    attention node reads its past key from (Attention input 4, GroupQueryAttention input 3),
    when every node reads a distinct one; else None."""
    if not pairs or not attention:
        return None
    index_of = {id(key.past): i for i, (key, _value) in enumerate(pairs)}
    order = []
    for node in attention:
        slot = 4 if node.domain == "" else 3
        past = node.inputs[slot] if len(node.inputs) > slot else None
        if past is None or id(past) not in index_of:
            return None
        order.append(index_of[id(past)])
    return order if len(set(order)) == len(order) else None


def _violations(graph: ir.Graph, ctx: RewriteContext, layers) -> list[Violation]:
    """Nodes the EP's record does not take, after legalization (always a reason to refuse).

    Legalization maps every node the record does not take to one it does or to primitives;
    one it could not (no exact rewrite) is listed here, its layer marked ``runs_on_ep=False``,
    and the API refuses the model with the first of these lines.
    """
    found = []
    for node in graph:
        flags = missing(node, ctx)
        if not flags:
            continue
        layer = layers.get(_layer_of(node))
        if layer is not None:
            layer.runs_on_ep = False
        domain = node.domain or "ai.onnx"
        found.append(Violation(node.name or node.op_type, domain, node.op_type, tuple(flags)))
    return found


def _apply(rule: Rule, node: ir.Node, ctx: RewriteContext):
    """``rule.apply``, turning a crash (or, when checking, a cycle) into a RewriteFailure."""
    where = f"{node.op_type} {node.name}".strip()
    try:
        outcome = rule.apply(node, ctx)
    except Exception as err:
        lines = str(err).strip().splitlines()
        why = f"raised {type(err).__name__}" + (f": {lines[0]}" if lines else "")
        raise RewriteFailure(rule.name, where, why) from err
    if isinstance(outcome, Rewritten) and ctx.options.check_rewrites and has_cycle(ctx.graph):
        raise RewriteFailure(rule.name, where, "made the graph cyclic")
    return outcome


def has_cycle(graph: ir.Graph) -> bool:
    """True when the nodes of ``graph`` (not its subgraphs) cannot be ordered (Kahn, linear)."""
    nodes = list(graph)
    index = {id(node): i for i, node in enumerate(nodes)}
    waiting = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for value in node.inputs:
            source = value.producer() if value is not None else None
            if source is not None and id(source) in index:
                waiting[i] += 1
                users[index[id(source)]].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    done = 0
    while ready:
        done += 1
        for j in users[ready.pop()]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    return done != len(nodes)


def _infer_types(model: ir.Model) -> str | None:
    """Fill in value types (and shapes where ONNX can) so rules can check dtypes.

    Best effort: a model ONNX's inference rejects is still optimized, with fewer facts known;
    the returned line (for the report's warnings) says why. onnx-ir's pass catches the error
    itself and logs it with a traceback; the log is captured here instead of reaching the
    user's terminal (the report carries the one line that matters).
    """
    declared = declared_names(model.graph)
    captured: list[logging.LogRecord] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(record)

    log = logging.getLogger(common_passes.ShapeInferencePass.__module__)
    handler, propagate = _Capture(logging.WARNING), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        common_passes.ShapeInferencePass()(model)
    except Exception as err:  # ONNX's inference raises many types; all mean "fewer facts"
        captured.append(
            logging.makeLogRecord({"msg": "failed", "exc_info": (type(err), err, None)})
        )
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
    # Dims inference left anonymous (TorchScript's run-time reshape targets, residual adds
    # of differently named dims) are derived from the ops' shape rules where provable.
    refine_shapes(model.graph, declared)
    failures = [r for r in captured if r.exc_info or "failed" in str(r.msg)]
    if not failures:
        return None  # only "value not found" notes: inference ran
    record = failures[0]
    cause = record.exc_info[1] if record.exc_info else None
    text = str(cause) if cause is not None else record.getMessage()
    first = text.strip().splitlines()[0] if text.strip() else "no message"
    return f"ONNX shape inference failed ({first}); rules saw only the exported types"


def _layer_of(node: ir.Node) -> int | None:
    value = node.metadata_props.get(LAYER_KEY)
    return int(value) if value is not None else None


def _assumptions(
    graph: ir.Graph, ep: EPCapabilities, dtype: str, options: OptimizeOptions
) -> list[str]:
    gqa = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not gqa:
        return []
    notes = [
        "attention_mask is right-padded: each row is ones then zeros (left padding is not supported)",
        "attention_mask length equals past length + new tokens",
        "outputs and present K/V at padded positions are unspecified",
    ]
    if any(n.attributes.get("do_rotary") and n.attributes["do_rotary"].value for n in gqa):
        notes.append(
            "on a first prompt (no past) positions are contiguous and the same for every row: "
            "position_ids[b] = position_ids[0, 0] + arange(seq) (fused rotary reads row 0's start)"
        )
        rows = min(
            n.inputs[7].shape[0]
            for n in gqa
            if len(n.inputs) > 7 and n.inputs[7] is not None and n.inputs[7].shape is not None
        )
        notes.append(f"total sequence length <= {rows} (rows of the cos/sin caches)")
    gqa_record = ep.ops(dtype).gqa
    if gqa_record is not None and gqa_record.chunked_prefill_needs_batch1:
        notes.append(f"on the {ep.name} EP, chunked prefill (past > 0 and seq > 1) needs batch 1")
    return notes
