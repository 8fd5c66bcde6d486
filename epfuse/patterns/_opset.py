"""Raising a model's default-domain opset (from any opset >= 14) so rules may emit opset-23 ops.

``Attention``, ``RotaryEmbedding`` and ``RMSNormalization`` exist from opset 23. A model's ONNX
ops must all be valid at the model's one default-domain opset, so emitting one of them into an
opset-14..22 model (Optimum / TorchScript exports are 14-18, dynamo's 18) means re-reading
every other ONNX op in the model at opset 23. For each op present, every revision of its
schema between the model's opset and 23 (``onnx.defs``) is looked up in :data:`REVISIONS`,
which classifies it as

* ``safe``: the revision only widens type constraints, or adds attributes, inputs or
  attribute values whose defaults (or absence) keep the old behaviour (e.g. ``Shape`` 15's
  ``start``/``end``, ``Cast`` 19's ``saturate``, which only affects float8 targets); the node is
  valid at 23 as it is;
* ``convert``: the signature changed but an exact rewrite of the node exists and is applied in
  place (``ReduceMean``/``ReduceMax``/... 18: the ``axes`` attribute becomes an input;
  ``Split`` 18: ``num_outputs`` must be given when ``split`` is not; ``RoiAlign`` 16: its new
  ``coordinate_transformation_mode`` defaults to ``half_pixel``, so the old behaviour is spelt
  out as ``output_half_pixel``);
* ``refuse``: the meaning changed and no LLM export needs the op (``GroupNormalization`` 21's
  per-channel scale, ``GridSample`` 20's renamed modes, ``DFT`` 20's axis input), or ONNX
  Runtime cannot run the new revision (``RoiAlign`` 22 has no CPU kernel in ORT 1.32); the
  opset then stays as it is and the rule that asked keeps its pattern, with this reason.

A revision missing from the table (a newer ``onnx`` with a new revision) refuses too. The tests
check every entry against the ONNX schemas of opsets 14..23 (a ``safe`` entry's schema diff is
exactly the attributes/inputs it names, with optional defaults) and run every converted op on
ORT at opsets 14 and 17 against its original.

Why not ``onnx.version_converter``: it works on a ``ModelProto`` and returns a new one, so
using it means serializing the ``onnx_ir`` model (weights included) and deserializing it
again; rules call :func:`require_default_opset` in the middle of a match, holding nodes of the
model, which must survive the raise (here nodes are changed in place, and only the few that
need it: Optimum's Llama at opset 14 converts its 2L+1 ReduceMeans). It is all-or-nothing with
no per-op reason, and it silently mis-converts ``GroupNormalization`` 18 -> 21 (it keeps the
per-group scale and bias, which opset 21 reads per channel). Measured (onnx 1.23.2) on Optimum
Llama opset-14 exports it is linear too (0.67 s for 3990 nodes, 2.2 s for 15558) plus the
proto round trip (0.7 s / 3.1 s); this module's plan and conversion take a few milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator

import numpy as np
import onnx
import onnx_ir as ir

MIN_OPSET = 14
"""Lowest default opset raised: Optimum's lowest, and below it more revisions need adapters."""

_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclasses.dataclass(frozen=True)
class Revision:
    """How a model written for the previous revision of ``op`` reads at revision ``version``."""

    op: str
    version: int
    kind: str
    """``safe``, ``convert`` or ``refuse``."""
    why: str
    added: tuple[str, ...] = ()
    """For ``safe``: the attributes/inputs the revision adds (each optional, defaulting to the
    old behaviour); the tests check this against the schema diff."""
    convert: Callable[[ir.Node], None] | None = None
    """For ``convert``: rewrites a node of the old revision into the new one, in place."""


# ----------------------------------------------------------------------- in-place adapters


def _axes_attribute_to_input(node: ir.Node) -> None:
    """Reduce* 13 -> 18: ``axes`` moves from an attribute to input 1 (absent: all axes, as
    before, since ``noop_with_empty_axes`` defaults to 0)."""
    axes = node.attributes.pop("axes", None)
    if axes is None:
        return
    values = np.asarray(list(axes.value), dtype=np.int64)
    tensor = ir.tensor(values, name=f"{node.name or node.op_type}/axes")
    const = ir.node("Constant", [], {"value": tensor}, name=f"{node.name or node.op_type}/axes")
    const.outputs[0].dtype = ir.DataType.INT64
    const.outputs[0].shape = ir.Shape([values.size])
    assert node.graph is not None
    node.graph.insert_before(node, const)
    node.resize_inputs(2)
    node.replace_input_with(1, const.outputs[0])


def _split_num_outputs(node: ir.Node) -> None:
    """Split 13 -> 18: without a ``split`` input, 13 splits into len(outputs) equal parts;
    18 requires that count as ``num_outputs``."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return
    if "num_outputs" not in node.attributes:
        node.attributes["num_outputs"] = ir.AttrInt64("num_outputs", len(node.outputs))


def _roi_align_mode(node: ir.Node) -> None:
    """RoiAlign 10 -> 16: 10 always used ``output_half_pixel`` coordinates; 16 adds the
    attribute with default ``half_pixel``, so the old behaviour must be written out."""
    name = "coordinate_transformation_mode"
    if name not in node.attributes:
        node.attributes[name] = ir.AttrString(name, "output_half_pixel")


# ------------------------------------------------------------------------------- the table

_TYPES = "adds tensor types only"
_BF16 = "adds bfloat16 (and other) types only"

# Identity and the control-flow ops pass any tensor through: each new tensor type revises them
# (16, 19, 21, 23) and nothing else.
_ANY_TYPE_OPS = ("Identity", "If", "Loop", "Scan")

# The ops that take each new small type: the 4-bit integers (21), then float4, float8e8m0 and
# more 4-bit types (23); nothing else in their schemas changes.
_SMALL_TYPE_OPS = (
    "Cast",
    "CastLike",
    "Constant",
    "ConstantOfShape",
    *_ANY_TYPE_OPS,
    "Shape",
    "Size",
    "Reshape",
    "Pad",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
)

_TYPE_ONLY: dict[int, tuple[str, ...]] = {
    15: ("BatchNormalization", "Pow"),
    16: (
        "GreaterOrEqual",
        "LessOrEqual",
        *_ANY_TYPE_OPS,
        "LeakyRelu",
        "PRelu",
        "Where",
    ),
    # ScatterElements/ScatterND 18: new reduction values max/min; the old values are unchanged
    18: ("OptionalGetElement", "ScatterElements", "ScatterND"),
    19: (
        "Constant",
        *_ANY_TYPE_OPS,
        "Shape",
        "Size",
        "Reshape",
        "Equal",
        "DequantizeLinear",
        "Pad",  # new "wrap" mode value
        "Resize",  # new "half_pixel_symmetric" mode value
    ),
    20: ("ConstantOfShape", "IsInf", "IsNaN", "ReduceMax", "ReduceMin"),
    21: (*_SMALL_TYPE_OPS, "QLinearMatMul"),
    22: (
        "Acos",
        "Acosh",
        "Asin",
        "Asinh",
        "Atan",
        "Atanh",
        "Cos",
        "Cosh",
        "Sin",
        "Sinh",
        "Tan",
        "Elu",
        "Selu",
        "Softplus",
        "Softsign",
        "HardSigmoid",
        "HardSwish",
        "Mish",
        "ThresholdedRelu",
        "Round",
        "Dropout",
        "EyeLike",
        "Bernoulli",
        "Multinomial",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Conv",
        "ConvTranspose",
        "DeformConv",
        "AveragePool",
        "MaxPool",
        "GlobalAveragePool",
        "GlobalLpPool",
        "GlobalMaxPool",
        "LpPool",
        "MaxRoiPool",
        "MaxUnpool",
        "GridSample",
        "InstanceNormalization",
        "LpNormalization",
        "GRU",
        "LSTM",
        "RNN",
        "Det",
        "NegativeLogLikelihoodLoss",
    ),
    23: _SMALL_TYPE_OPS,
}

_OPTIONAL: tuple[tuple[str, int, tuple[str, ...], str], ...] = (
    ("Shape", 15, ("start", "end"), "start/end default to the whole shape"),
    ("OptionalHasElement", 18, (), "its input becomes optional (and may be a tensor)"),
    ("Pad", 18, ("axes",), "the optional axes input defaults to all axes"),
    ("Resize", 18, ("antialias", "axes", "keep_aspect_ratio_policy"), "defaults: 0, all, stretch"),
    ("LpPool", 18, ("dilations", "ceil_mode"), "defaults: 1, 0 (floor)"),
    ("ScatterElements", 16, ("reduction",), 'reduction defaults to "none" (plain scatter)'),
    ("ScatterND", 16, ("reduction",), 'reduction defaults to "none" (plain scatter)'),
    ("AveragePool", 19, ("dilations",), "dilations default to 1"),
    ("Cast", 19, ("saturate",), "saturate only affects float8 targets"),
    ("CastLike", 19, ("saturate",), "saturate only affects float8 targets"),
    ("QuantizeLinear", 19, ("saturate",), "saturate only affects float8 outputs"),
    ("QuantizeLinear", 21, ("block_size", "output_dtype"), "0: per-tensor/axis; zero point type"),
    ("QuantizeLinear", 23, ("precision",), "0: the scale's precision"),
    ("DequantizeLinear", 21, ("block_size",), "0: per-tensor/axis quantization"),
    ("DequantizeLinear", 23, ("output_dtype",), "0: the scale's type"),
)

_REDUCE_AXES = (
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSumSquare",
)

_CONVERT: tuple[tuple[str, int, Callable[[ir.Node], None], str], ...] = (
    *(
        (op, 18, _axes_attribute_to_input, "the axes attribute becomes an input")
        for op in _REDUCE_AXES
    ),
    ("Split", 18, _split_num_outputs, "num_outputs is required when split is not given"),
    (
        "RoiAlign",
        16,
        _roi_align_mode,
        "the new coordinate_transformation_mode defaults to half_pixel",
    ),
)

_REFUSE: tuple[tuple[str, int, str], ...] = (
    ("GroupNormalization", 21, "scale and bias are read per channel instead of per group"),
    ("GridSample", 20, "modes are renamed (bilinear -> linear, bicubic -> cubic)"),
    ("DFT", 20, "axis moves to an input whose default changes from 1 to -2"),
    # Only bfloat16 is added, but ONNX Runtime 1.32's CPU EP has no RoiAlign-22 kernel: the
    # raised model would not load (the 16 conversion above serves targets 16..21).
    ("RoiAlign", 22, "ONNX Runtime has no CPU kernel for RoiAlign 22"),
)


def _build() -> dict[tuple[str, int], Revision]:
    table: dict[tuple[str, int], Revision] = {}

    def add(revision: Revision) -> None:
        key = (revision.op, revision.version)
        assert key not in table, f"{key} classified twice"
        table[key] = revision

    for version, ops in _TYPE_ONLY.items():
        for op in ops:
            add(Revision(op, version, "safe", _BF16 if version == 22 else _TYPES))
    for op, version, added, why in _OPTIONAL:
        add(Revision(op, version, "safe", why, added=added))
    for op, version, convert, why in _CONVERT:
        add(Revision(op, version, "convert", why, convert=convert))
    for op, version, why in _REFUSE:
        add(Revision(op, version, "refuse", why))
    return table


REVISIONS: dict[tuple[str, int], Revision] = _build()


@functools.cache
def _all_versions() -> dict[str, tuple[int, ...]]:
    found: dict[str, list[int]] = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain in _DEFAULT_DOMAINS:
            found.setdefault(s.name, []).append(s.since_version)
    return {op: tuple(sorted(v)) for op, v in found.items()}


def revisions_between(op: str, current: int, target: int) -> list[Revision] | str:
    """The revisions of ``op`` after ``current`` up to ``target``, or why one is unusable."""
    versions = _all_versions().get(op)
    if not versions or versions[0] > current:
        return f"{op} is not an ONNX op at opset {current}"
    found = []
    for version in versions:
        if not current < version <= target:
            continue
        revision = REVISIONS.get((op, version))
        if revision is None:
            return f"{op} {version}: revision not classified"
        if revision.kind == "refuse":
            return f"{op} {version}: {revision.why}"
        found.append(revision)
    return found


def _scopes(model: ir.Model) -> Iterator[tuple[ir.Graph | ir.Function, dict[str, int]]]:
    """(graph-like, its opset imports): the main graph (subgraphs included) and each function."""
    yield model.graph, model.opset_imports
    for function in model.functions.values():
        yield function, function.opset_imports


def _default_opset(imports: dict[str, int]) -> int | None:
    return imports.get("", imports.get("ai.onnx"))


@dataclasses.dataclass
class UpgradePlan:
    refused: dict[str, str]
    """op -> why raising would change its meaning (empty when the raise is safe)."""
    conversions: list[tuple[ir.Node, Revision]]

    @property
    def reason(self) -> str | None:
        if not self.refused:
            return None
        return "; ".join(self.refused[op] for op in sorted(self.refused))


def plan_upgrade(model: ir.Model, target: int) -> UpgradePlan:
    """What raising every default-domain opset of ``model`` to ``target`` needs (no edits)."""
    plan = UpgradePlan({}, [])
    for scope, imports in _scopes(model):
        current = _default_opset(imports)
        if current is None or current >= target:
            continue
        if current < MIN_OPSET:
            plan.refused[f"opset {current}"] = (
                f"opset {current} is below {MIN_OPSET}, the lowest raised to {target}"
            )
            continue
        memo: dict[str, list[Revision] | str] = {}
        for node in ir.traversal.RecursiveGraphIterator(scope):
            if node.domain not in _DEFAULT_DOMAINS:
                continue
            if node.op_type not in memo:
                memo[node.op_type] = revisions_between(node.op_type, current, target)
            revisions = memo[node.op_type]
            if isinstance(revisions, str):
                plan.refused[node.op_type] = revisions
                continue
            plan.conversions += [(node, r) for r in revisions if r.kind == "convert"]
    return plan


def changed_ops(model: ir.Model, target: int) -> list[str]:
    """Default-domain ops of ``model`` whose meaning would change at ``target`` (sorted)."""
    return sorted(plan_upgrade(model, target).refused)


def upgrade_opset(model: ir.Model, target: int) -> str | None:
    """Raise every default-domain opset of ``model`` to ``target``, converting in place the
    nodes whose signature changed. Returns None on success, else why not (model unchanged)."""
    plan = plan_upgrade(model, target)
    if plan.reason:
        return f"raising the opset to {target} would change the meaning of {plan.reason}"
    for node, revision in plan.conversions:  # in revision order per node (versions ascend)
        assert revision.convert is not None
        revision.convert(node)
    for _, imports in _scopes(model):
        current = _default_opset(imports)
        if current is not None and current < target:
            imports.pop("ai.onnx", None)
            imports[""] = target
    model.ir_version = max(model.ir_version or 0, 10)
    return None


def require_default_opset(model: ir.Model, target: int, cache: dict) -> str | None:
    """Raise the default-domain opset to ``target`` if that is provably safe.

    Returns None when the model is (now) at ``target`` or above, else why it cannot be.
    Memoized in ``cache`` (the rewrite context's), since every rule in a run asks. Nodes are
    converted in place, so a rule asking mid-match keeps valid references to its nodes.
    """
    key = ("default-opset", target)
    if key not in cache:
        cache[key] = upgrade_opset(model, target)
    return cache[key]
