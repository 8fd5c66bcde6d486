"""The public API: ``optimize`` and ``optimize_with_report``."""

from __future__ import annotations

import functools
import json
import numbers
import os
from collections.abc import Iterable, Sequence
from typing import TypeVar, overload

import onnx
import onnx_ir as ir

from epfuse.capabilities import DTYPES, EPCapabilities, get_ep
from epfuse.capabilities.conformance import Violation
from epfuse.errors import (
    ModelTypeError,
    OptionError,
    UnsupportedModelError,
    VerificationError,
)
from epfuse.patterns import RULES, OptimizeOptions, ReasonCode, Rule
from epfuse.patterns.analysis.signature import DecoderSignature

from ._collection import fewer_collections
from .io import load_model
from .manager import SKIPPED_REASON, PassManager, RewriteFailure, RunState
from .precision import Int4Options, PrecisionPlan
from .precision import choose as choose_precision
from .report import METADATA_KEY, Report
from .validate import validate

ModelLike = TypeVar("ModelLike", onnx.ModelProto, ir.Model)

_DTYPE_NAMES = {
    ir.DataType.FLOAT: "float32",
    ir.DataType.FLOAT16: "float16",
    ir.DataType.BFLOAT16: "bfloat16",
}


@overload
def optimize(
    model: onnx.ModelProto, ep: str | EPCapabilities = ..., **options
) -> onnx.ModelProto: ...
@overload
def optimize(
    model: ir.Model | str | os.PathLike, ep: str | EPCapabilities = ..., **options
) -> ir.Model: ...


def optimize(model, ep="cpu", **options):
    """Rewrite ``model`` for execution provider ``ep``; see :func:`optimize_with_report`."""
    return optimize_with_report(model, ep, **options)[0]


def _with_fewer_collections(function):
    """Run ``function`` under :func:`fewer_collections` (the optimizer's IR is large and long
    lived; see :mod:`epfuse.optimizer._collection`)."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with fewer_collections():
            return function(*args, **kwargs)

    return run


@_with_fewer_collections
def optimize_with_report(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    ep: str | EPCapabilities = "cpu",
    *,
    max_seq_len: int = OptimizeOptions.max_seq_len,
    validate_output: bool = True,
    verify: bool = False,
    skip_layers: Iterable[int] = (),
    probe: bool = False,
    require_fusion: bool = False,
    precision: str = "auto",
    int4: Int4Options | None = None,
    kv_cache: str | None = None,
    model_max_positions: int | None = None,
    rules: Sequence[Rule] = RULES,
):
    """Optimize and return ``(optimized_model, report)``.

    ``precision`` (``"auto"``, ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int4"``; see
    :mod:`epfuse.optimizer.precision`): ``auto`` converts a float32 export to the dtype the
    EP's record prefers (float16 for cuda, dml, webgpu, trt-rtx) and keeps it otherwise (cpu);
    an explicit dtype wins; ``int4`` quantizes MatMul weights (``int4``:
    :class:`~epfuse.optimizer.precision.Int4Options`, the genai builder's CPU defaults).
    ``kv_cache="int8"`` (opt-in; default the compute dtype) types every GroupQueryAttention
    past/present int8 with calibrated per-channel scales where the record has
    ``gqa.kv_cache_int8`` (cpu; see :mod:`epfuse.optimizer.precision.kv_cache`), verified
    against the float-cache model at the ``kv-int8`` tolerance.
    ``report.precision`` says what was chosen and why. With ``verify=True`` a converted or
    quantized model is verified against the unfused model converted the same way, and its
    drift from the float32 original is reported in ``report.precision["drift"]``.

    ``model`` may be a path, an ``onnx.ModelProto`` (a ModelProto is returned) or an
    ``onnx_ir.Model`` (an ``onnx_ir.Model`` is returned; the argument itself is not changed).
    The report is also stored as JSON in the output's ``metadata_props["epfuse.report"]``.

    ``skip_layers``: attention layers (report indices) that no lowering may touch.

    ``rules``: the rule set every run of the pass manager uses (default
    :data:`epfuse.patterns.RULES`): a caller or test runs its own set without patching.

    ``verify=True`` compares the result with the original on ORT CPU
    (:func:`epfuse.optimizer.verify.compare_models`, default scenarios, lengths past any
    sliding window). When it fails, the layers whose rewrite alone fails are found by group
    testing (halves of the fused layers re-optimized and verified alone, a passing half
    clearing all its layers: about 2 log2(N) verifications for one bad layer among N; a group
    failing only in combination counts as failing) and rolled back to their canonical
    standard form (reported as kept, "rolled back: failed verification (max err ...)"), and
    the rolled-back model is verified again. If that still fails, all lowerings are rolled back; if even that fails (a broken
    canonicalization), :class:`epfuse.errors.VerificationError` is raised. The returned model
    always passed verification.

    An EP that can fuse no layer still gets a model: everything it can take (norm fusions,
    caches, cleanup), every layer it cannot fuse in a form its record takes (standard ops or
    primitives), and per layer the reason in the report. ``require_fusion=True`` instead
    raises :class:`epfuse.errors.UnsupportedModelError` when any attention layer is not fused.
    A model with no attention at all raises it in any case. A node that no legalization can
    make something the EP's record takes makes the run raise it too: the output always
    conforms to the record (``epfuse.capabilities.conformance``).

    ``probe=True`` checks the EP's record against the installed ONNX Runtime first
    (``epfuse.capabilities.probe``: schemas, and known-answer runs for an EP present in this
    build) and trusts the probe where they disagree; the disagreements go into the report.

    ``max_seq_len`` must be a positive integer that ORT's int32 sequence lengths take and whose
    cos/sin caches fit in memory (else :class:`epfuse.errors.OptionError`, stating the limit);
    above the model's own maximum position (read from the graph, or ``model_max_positions``,
    e.g. a Hugging Face ``max_position_embeddings``) the report carries a warning.

    Errors: every refusal is an :class:`epfuse.errors.EpfuseError` whose message is the line
    the CLI prints (see the README's error section for the classes).
    """
    record = get_ep(ep)
    probe_notes: list[str] = []
    if probe:
        from epfuse.capabilities.probe import cached_probe

        record, probe_report = cached_probe(record)
        probe_notes = [f"probe overrides the record: {m}" for m in probe_report.mismatches]
    _check_max_seq_len(max_seq_len)
    as_proto = isinstance(model, onnx.ModelProto)
    if as_proto:
        source = ir.serde.deserialize_model(model)
    elif isinstance(model, ir.Model):
        source = ir.serde.deserialize_model(ir.to_proto(model))
    elif isinstance(model, (str, os.PathLike)):
        source = load_model(model)
    else:
        raise ModelTypeError(_model_type_message(model))
    dtype = model_dtype(source)
    plan = choose_precision(precision, record, dtype, int4)
    kv_int8 = _check_kv_cache(kv_cache, record, plan.compute_dtype)
    if verify and plan.compute_dtype == "bfloat16":
        raise VerificationError(
            "cannot verify a bfloat16 model on ORT CPU (it has no bfloat16 MatMul kernel); "
            "optimize without verify: the output's structure is still checked against the "
            "record (conformance)"
        )
    warnings = _max_seq_len_warnings(source, max_seq_len, model_max_positions)
    original = None
    if verify:
        # ORT runs the comparison from bytes: external weights must be in memory.
        ir.external_data.load_to_model(source)
        original = ir.to_proto(source)

    def fresh() -> ir.Model:
        """A new copy of the input (the first run edits ``source`` in place)."""
        if original is not None:
            return ir.serde.deserialize_model(original)
        if as_proto:
            return ir.serde.deserialize_model(model)
        if isinstance(model, ir.Model):
            return ir.serde.deserialize_model(ir.to_proto(model))
        return load_model(model)

    # A rule whose rewrite fails on this model (raises, or makes the graph cyclic) leaves the
    # graph half-edited: the run is redone from a fresh copy without that rule, which the
    # report names. An unknown culprit (a cycle found after the stages) is looked for by
    # rerunning with a cycle check after every rewrite.
    disabled: dict[str, str] = {}
    # With verify, the rollback lowers the same canonical graph with other skip sets: it is
    # canonicalized once (per set of disabled rules) and each run lowers a copy.
    canonical_runs: dict[tuple, RunState] = {}

    def run(skip: Iterable[int], reuse_source: bool = False) -> tuple[ir.Model, Report]:
        checked = False
        work = source if reuse_source else None
        while True:
            options = OptimizeOptions(
                max_seq_len=max_seq_len,
                skip_layers=frozenset(skip),
                disabled_rules=dict(disabled),
                check_rewrites=checked,
            )
            key = (tuple(sorted(disabled)), checked)
            manager = PassManager(tuple(rules))
            try:
                if key in canonical_runs:
                    canonical = canonical_runs[key].copy()
                else:
                    model = work if work is not None else fresh()
                    canonical = manager.canonicalize(model, record, dtype, options, precision=plan)
                    if original is not None:
                        canonical_runs[key] = canonical.copy()
                work = canonical.ctx.model
                report = manager.lower(canonical, options.skip_layers)
                break
            except RewriteFailure as failure:
                if failure.rule is None and not checked:
                    checked = True
                elif failure.rule is None or failure.rule in disabled:
                    raise UnsupportedModelError(f"internal error: {failure}") from None
                else:
                    where = f" of {failure.node}" if failure.node else ""
                    disabled[failure.rule] = (
                        f"disabled: its rewrite{where} {failure.why} (an epfuse bug; "
                        "the model was optimized again without it)"
                    )
            work = None  # half-edited: the next try starts from a fresh copy
        if not report.layers:
            why = [f"{r.name}: {reason}" for r in report.rules for reason in r.kept_reasons]
            detail = f" (kept: {'; '.join(why)})" if why else ""
            raise UnsupportedModelError(
                f"no attention found in the model (nothing to optimize){detail}"
            )
        if report.violations:
            vendor = _vendor_op_refusal(report.violations, record, report.dtype)
            if vendor:
                raise UnsupportedModelError(vendor)
            more = len(report.violations) - 1
            extra = f" (and {more} more)" if more else ""
            raise UnsupportedModelError(
                f"cannot make the model fit {record.name} ({report.dtype}): "
                f"{report.violations[0]}{extra}"
            )
        report.assumptions.extend(probe_notes)
        report.warnings.extend(warnings)
        if kv_int8:
            _quantize_kv(work, report, max_seq_len)
        if validate_output:
            note = validate(work)
            if note:
                report.assumptions.append(note)
        return work, report

    work, report = run(skip_layers, reuse_source=True)
    if original is not None:
        reference, tolerance, strict = original, None, False
        if plan.changes_numerics:
            reference = _reference(original, record, dtype, plan, max_seq_len, rules)
            tolerance = _plan_tolerance(plan, kv_int8)
            strict = plan.int4 is not None and plan.int4.accuracy_level == 4
        work, report = _verified(reference, work, report, run, skip_layers, tolerance, strict)
        if plan.changes_numerics:
            report.verification += f"; reference: the unfused model at {plan.name}"
            report.precision["drift"] = _drift(original, work, plan)
        if kv_int8:
            report.verification += "; int8 KV cache within the kv-int8 tolerance"
    if require_fusion:
        _require_fusion(report)
    work.metadata_props[METADATA_KEY] = report.to_json()
    return (ir.to_proto(work) if as_proto else work), report


_INT32_MAX = 2**31 - 1
# Bytes per cos/sin row while the caches are made and proven: float64 cos and sin, a
# temporary of each, per rotary pair (head_size / 2), plus the float32 result.
_BYTES_PER_ROW_PER_HEAD_DIM = 40
_DEFAULT_HEAD_DIM = 256  # when the graph does not say (the largest head size in use)


def _check_max_seq_len(value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(f"max_seq_len must be a positive integer, got {value!r}")
    if value < 1:
        raise OptionError(f"max_seq_len must be a positive integer, got {value}")
    if value > _INT32_MAX:
        raise OptionError(
            f"max_seq_len {value} is above {_INT32_MAX}, the longest sequence ONNX Runtime's "
            "attention ops take (int32 lengths)"
        )


def _head_dim(model: ir.Model) -> int:
    dims = [
        v.shape[-1]
        for v in model.graph.inputs
        if v.shape is not None and len(v.shape) == 4 and isinstance(v.shape[-1], int)
    ]
    return max(dims) if dims else _DEFAULT_HEAD_DIM


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 1 << 40


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def model_max_positions(model: ir.Model) -> int | None:
    """The model's own maximum position, where the graph states one: rows of constant cos/sin
    caches of a RotaryEmbedding or GroupQueryAttention, or of a position-embedding table
    gathered by the position input."""
    rows = []
    positions = DecoderSignature.of(model).position_ids
    for node in model.graph:
        if node.op_type == "RotaryEmbedding":
            caches = node.inputs[1:3] if node.domain in ("", "ai.onnx") else node.inputs[2:4]
        elif node.op_type == "GroupQueryAttention":
            caches = node.inputs[7:9]
        elif node.op_type == "Gather" and len(node.inputs) > 1 and node.inputs[1] is not None:
            caches = [node.inputs[0]] if node.inputs[1] is positions else []
        else:
            continue
        for value in caches:
            if value is not None and value.const_value is not None:
                shape = value.const_value.shape
                if len(shape) == 2:
                    rows.append(int(shape[0]))
    return min(rows) if rows else None


def _max_seq_len_warnings(model: ir.Model, max_seq_len: int, hf_limit: int | None) -> list[str]:
    """Refuse a max_seq_len whose caches cannot be allocated; warn above the model's limit."""
    head_dim = _head_dim(model)
    per_row = head_dim * _BYTES_PER_ROW_PER_HEAD_DIM
    budget = _available_memory() // 2
    if max_seq_len * per_row > budget:
        raise OptionError(
            f"max_seq_len {max_seq_len}: the cos/sin caches need about "
            f"{_gib(max_seq_len * per_row)} of memory while made and proven, more than half "
            f"of the {_gib(budget * 2)} available; the limit here is {budget // per_row} rows"
        )
    warnings = []
    limits = [(hf_limit, "max_position_embeddings of the Hugging Face config")]
    limits.append((model_max_positions(model), "rows of the graph's position tables"))
    for limit, source in limits:
        if limit and max_seq_len > limit:
            warnings.append(
                f"max_seq_len {max_seq_len} is above the model's own maximum position {limit} "
                f"({source}): positions past it were never trained"
            )
    cache_bytes = max_seq_len * head_dim * 4  # float32 cos + sin, head_dim/2 each
    if cache_bytes > 256 << 20:
        warnings.append(
            f"max_seq_len {max_seq_len} makes cos/sin caches of about {_gib(cache_bytes)} "
            "per rotary layout in the output"
        )
    return warnings


def _model_type_message(model) -> str:
    hint = ""
    if isinstance(model, (bytes, bytearray)):
        hint = " (for serialized bytes use onnx.load_from_string(data) first)"
    elif isinstance(model, onnx.GraphProto):
        hint = " (wrap a GraphProto with onnx.helper.make_model first)"
    return (
        "model must be a path, an onnx.ModelProto or an onnx_ir.Model, not "
        f"{type(model).__name__}{hint}"
    )


def _vendor_op_refusal(
    violations: list[Violation], record: EPCapabilities, dtype: str
) -> str | None:
    """The refusal for an already optimized model re-targeted to an EP that lacks its vendor
    ops (com.microsoft GroupQueryAttention ...). No exact standard form exists for GQA: it
    writes the new K/V at ``seqlens_k``, not after the past, so an Attention + Concat would
    compute a different present cache for padded batches. Re-optimize the original export."""
    vendor = sorted({f"{v.domain}::{v.op}" for v in violations if v.vendor})
    if not vendor:
        return None
    return (
        f"cannot re-target this model to {record.name} ({dtype}): {record.name} does not run "
        f"{', '.join(vendor)} in the form this model has, and no exact standard ONNX form "
        "exists; optimize the original export for this EP instead"
    )


def _require_fusion(report: Report) -> None:
    """Strict mode: every attention layer fused (an input GQA the EP takes counts as fused)."""
    unfused = [layer for layer in report.layers if not (layer.fused or layer.from_input)]
    if not unfused:
        return
    first = unfused[0]
    why = (first.reasons or ["no reason recorded"])[0]
    raise UnsupportedModelError(
        f"require_fusion: {len(unfused)} of {len(report.layers)} attention layers not fused "
        f"for {report.ep} ({report.dtype}); layer {first.layer}: {why}"
    )


def _reference(
    original: onnx.ModelProto,
    record,
    dtype: str,
    plan: PrecisionPlan,
    max_seq_len: int,
    rules: Sequence[Rule],
) -> onnx.ModelProto:
    """The unfused model converted/quantized as ``plan`` says: what a low-precision result is
    verified against (canonicalization is exact; the PRECISION stage is the same code)."""
    model = ir.serde.deserialize_model(original)
    options = OptimizeOptions(max_seq_len=max_seq_len)
    PassManager(tuple(rules)).run(model, record, dtype, options, precision=plan, lower=False)
    return ir.to_proto(model)


def _plan_tolerance(plan: PrecisionPlan, kv_int8: bool = False):
    from epfuse.tolerances import Tolerance, tolerance_for

    int8 = plan.int4 is not None and plan.int4.accuracy_level == 4
    tol = tolerance_for(plan.compute_dtype, "int4-int8-compute" if int8 else None)
    if kv_int8:  # both roundings at once: their bounds add
        kv = tolerance_for(plan.compute_dtype, "kv-int8")
        tol = Tolerance(atol=tol.atol + kv.atol, rtol=tol.rtol + kv.rtol)
    return tol


def _check_kv_cache(kv_cache: str | None, record: EPCapabilities, dtype: str) -> bool:
    """True for an int8 KV cache the record's GroupQueryAttention takes; a one-line error
    for an unknown value or an EP/dtype without it."""
    from .precision.kv_cache import normalize

    try:
        value = normalize(kv_cache)
    except ValueError as err:
        raise OptionError(str(err)) from None
    if value is None:
        return False
    gqa = record.ops(dtype).gqa
    if gqa is None or not gqa.kv_cache_int8:
        what = "has no GroupQueryAttention" if gqa is None else "takes no int8 KV cache"
        raise UnsupportedModelError(
            f"kv_cache int8: {record.name}'s record {what} for {dtype} "
            "(gqa.kv_cache_int8; use the default cache dtype)"
        )
    return True


def _quantize_kv(work: ir.Model, report: Report, max_seq_len: int) -> None:
    from .precision.kv_cache import quantize_kv_cache

    summary = quantize_kv_cache(work, max_seq_len)
    if not summary.layers:
        why = "; ".join(summary.kept) or "no layer was fused into GroupQueryAttention"
        raise UnsupportedModelError(
            f"kv_cache int8: no GroupQueryAttention cache to quantize ({why})"
        )
    report.precision["kv_cache"] = summary.describe()


def _float_compute(model: onnx.ModelProto | ir.Model) -> ir.Model:
    """``model`` with every MatMulNBits computing in its activation dtype (accuracy_level
    dropped): the same int4 weights without the int8 rounding of activations, so two such
    models that differ only by fusion agree to the activation dtype's tolerance. A copy (the
    weights shared), in onnx_ir: verify serializes it once, for its session."""
    if isinstance(model, onnx.ModelProto):
        copy = ir.serde.deserialize_model(model)
    else:
        copy = model.clone()
    for node in copy.graph:
        if node.op_type == "MatMulNBits":
            node.attributes.pop("accuracy_level", None)
    return copy


def _drift(original: onnx.ModelProto, work: ir.Model, plan: PrecisionPlan) -> dict:
    from .precision.drift import measure_drift

    try:
        return measure_drift(original, work, plan.name).to_dict()
    except Exception as err:
        return {"summary": f"not measured: {_first_line(err)}"}


def _verified(
    original: onnx.ModelProto,
    work: ir.Model,
    report: Report,
    run,
    skip_layers,
    tolerance=None,
    strict_int4: bool = False,
):
    """Verify ``work`` against ``original`` (the reference: the input, or the unfused model
    at the same precision); roll back the layers whose rewrite breaks equivalence.

    ``strict_int4``: int4 weights with int8 activations (accuracy level 4) agree only to the
    int8 rounding noise (the loose ``tolerance``); the rewrite must also pass with both models
    computing in their activation dtype (:func:`_float_compute`), at that dtype's tolerance.
    """
    from .verify.limits import default_lengths, read_limits
    from .verify.runner import Comparator

    # Read once: every candidate of the rollback is the original with some of ``work``'s
    # lowerings, so its windows, thresholds and position tables are among these two graphs'.
    # Candidates go to verify as onnx_ir models: its sessions are the one protobuf boundary.
    limits = read_limits(original, work)
    lengths = default_lengths(limits)
    float_reference = _float_compute(original) if strict_int4 else None
    pairs: dict[str, Comparator] = {}

    def pair(key: str, reference: onnx.ModelProto | ir.Model, candidate: ir.Model, tol):
        """A comparator of ``candidate``; the reference's session is loaded once."""
        if key not in pairs:
            pairs[key] = Comparator(reference, candidate, tolerance=tol, limits=limits)
            return pairs[key]
        return pairs[key].with_optimized(candidate)

    def compare(candidate: ir.Model):
        result = pair("reference", original, candidate, tolerance).compare(**lengths)
        if float_reference is not None and result.passed:
            floats = pair("float", float_reference, _float_compute(candidate), None)
            result = floats.compare(**lengths)
        return result

    def check(candidate: ir.Model):
        try:
            result = compare(candidate)
        except Exception as err:
            raise VerificationError(f"cannot verify: {_first_line(err)}") from None
        for scenario in result.scenarios:
            if scenario.error and scenario.error.startswith("original model failed"):
                raise VerificationError(
                    f"cannot verify on ORT CPU: {scenario.name}: {scenario.error}"
                )
        return result

    result = check(work)
    if result.passed:
        report.verification = f"passed ({_scenario_list(result)})"
        return work, report
    base_skip = set(skip_layers)
    fused = [layer.layer for layer in report.layers if layer.fused]

    def fused_only(group: list[int]):
        """The verdict on the model with only ``group``'s lowerings (every other fused layer
        rolled back)."""
        return check(run(base_skip | (set(fused) - set(group)))[0])

    failing = _culprits(fused, result, fused_only)
    work, report = run(base_skip | set(failing))
    again = check(work)
    if not again.passed and set(failing) != set(fused):
        failing = {**dict.fromkeys(fused, _worst(result)), **failing}
        work, report = run(base_skip | set(fused))
        again = check(work)
    if not again.passed:
        raise VerificationError(
            "the model fails verification even with every lowering rolled back "
            f"(canonicalization is not equivalent): {_worst(again)}"
        )
    for layer in report.layers:
        if layer.layer in failing:
            layer.reasons = [r for r in layer.reasons if r != SKIPPED_REASON]
            layer.codes = [c for c in layer.codes if c != ReasonCode.SKIPPED_LAYER]
            layer.keep(
                ReasonCode.ROLLED_BACK,
                f"rolled back: failed verification ({failing[layer.layer]})",
            )
    rolled = ", ".join(str(i) for i in sorted(failing))
    report.verification = (
        f"passed after rolling back layer(s) {rolled} ({_scenario_list(again)}); "
        f"the full rewrite failed: {_worst(result)}"
    )
    return work, report


def _culprits(fused: list[int], failed, verdict) -> dict[int, str]:
    """The fused layers to roll back, with why, found by group testing: ``failed`` is the
    failing verdict on all of ``fused``; ``verdict(group)`` verifies the model in which only
    ``group``'s layers are lowered.

    A failing group is split in halves and each half verified alone: a passing half clears
    all its layers at once, a failing one is split again, down to the single layers that fail
    alone. One defective layer among N costs 2 log2(N) verifications instead of N. A failing
    group whose halves both pass fails only in combination (no single culprit): the whole
    group is rolled back (for the whole model, as before: every lowering).
    """
    failing: dict[int, str] = {}

    def search(group: list[int], verdict_on_group) -> None:
        if len(group) == 1:
            failing[group[0]] = _worst(verdict_on_group)
            return
        half = len(group) // 2
        culprit_found = False
        for part in (group[:half], group[half:]):
            outcome = verdict(part)
            if not outcome.passed:
                search(part, outcome)
                culprit_found = True
        if not culprit_found:  # each half passes alone: only the combination fails
            failing.update(dict.fromkeys(group, _worst(verdict_on_group)))

    if fused:
        search(list(fused), failed)
    return failing


def _scenario_list(result) -> str:
    ran = [s.name for s in result.scenarios if s.skipped is None]
    skipped = [s.name for s in result.scenarios if s.skipped is not None]
    text = "scenarios " + ", ".join(ran)
    return text + (f"; skipped {', '.join(skipped)}" if skipped else "")


def _worst(result) -> str:
    """'max err X on OUTPUT in SCENARIO' for the worst failing comparison (or the error)."""
    worst = result.worst_failure()
    if worst is None or isinstance(worst, str):
        return worst or "no comparison failed"
    return f"max err {worst.max_abs_err:.3g} on {worst.output} in {worst.scenario}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__


def read_report(model: onnx.ModelProto | ir.Model) -> Report | None:
    """The report stored in an optimized model, if any."""
    if isinstance(model, onnx.ModelProto):
        props = {p.key: p.value for p in model.metadata_props}
    else:
        props = model.metadata_props
    text = props.get(METADATA_KEY)
    return Report.from_dict(json.loads(text)) if text else None


def model_dtype(model: ir.Model) -> str:
    """The compute dtype :class:`DecoderSignature` reads: of the KV-cache inputs, else of
    the logits, else of the first float output."""
    dtype = DecoderSignature.of(model).dtype
    if dtype is None:
        raise UnsupportedModelError(
            "cannot tell the model's float dtype from its inputs or outputs"
        )
    if dtype not in _DTYPE_NAMES:
        raise UnsupportedModelError(
            f"unsupported dtype {dtype.name.lower()} (epfuse handles {', '.join(DTYPES)})"
        )
    return _DTYPE_NAMES[dtype]
