"""Raising a model's default-domain opset so canonicalize rules may emit opset-23 ops.

``Attention``, ``RotaryEmbedding`` and ``RMSNormalization`` exist from opset 23. A model's ONNX
ops must all be valid at the model's one default-domain opset, so emitting one of them into
an opset-18 model means re-reading every other ONNX op in the model at opset 23. That is only
safe if no op present changed meaning in between. :data:`TYPE_ONLY_UPDATES` lists the ops
whose revisions after opset 18 (up to 23) only add tensor types or add attributes/modes whose
defaults keep the old behaviour; they are checked against the ONNX changelog:

* opset 19: Cast/CastLike (float8 types; ``saturate`` only affects float8 targets),
  Constant/Identity/If/Loop/Scan/Shape/Size/Reshape (float8 types), Equal (string),
  Pad (new ``wrap`` mode), Resize (new ``half_pixel_symmetric`` mode), AveragePool
  (``dilations``, default 1), Quantize/DequantizeLinear (types);
* opset 20: IsNaN/IsInf/ConstantOfShape (float8 types), ReduceMax/ReduceMin (bool);
* opset 21: int4/uint4 types for the opset-19 list and Flatten/Squeeze/Unsqueeze/Transpose/
  QLinearMatMul; Quantize/DequantizeLinear block quantization (``block_size`` default 0);
* opset 22: bfloat16 for the activations, trigonometry, pooling, convolution, RNN and
  random ops;
* opset 23: float4e2m1 types for the opset-21 list.

Ops that did change meaning (GroupNormalization 21, GridSample 20, DFT 20) or that the list
does not name make the upgrade refuse; the rule then keeps the graph as it is.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

TYPE_ONLY_UPDATES: frozenset[str] = frozenset(
    [
        # opsets 19/20/21/23: new types, or new attributes/modes with old-behaviour defaults
        "Cast",
        "CastLike",
        "Constant",
        "ConstantOfShape",
        "Identity",
        "If",
        "Loop",
        "Scan",
        "Shape",
        "Size",
        "Reshape",
        "Pad",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Transpose",
        "QuantizeLinear",
        "DequantizeLinear",
        "QLinearMatMul",
        "Equal",
        "Resize",
        "AveragePool",
        "IsNaN",
        "IsInf",
        "ReduceMax",
        "ReduceMin",
        # opset 22: bfloat16 added
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
        "MaxPool",
        "GlobalAveragePool",
        "GlobalLpPool",
        "GlobalMaxPool",
        "LpPool",
        "MaxRoiPool",
        "MaxUnpool",
        "RoiAlign",
        "InstanceNormalization",
        "LpNormalization",
        "GRU",
        "LSTM",
        "RNN",
        "Det",
        "NegativeLogLikelihoodLoss",
    ]
)

_DEFAULT_DOMAINS = ("", "ai.onnx")


def _since(op_type: str, version: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, version, "").since_version
    except onnx.defs.SchemaError:
        return None


def changed_ops(model: ir.Model, target: int) -> list[str]:
    """Default-domain ops in ``model`` (subgraphs included) whose meaning may differ at
    ``target`` from the model's current opset: revised in between and not type-only."""
    current = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if current is None or current >= target:
        return []
    bad: set[str] = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in _DEFAULT_DOMAINS or node.op_type in bad:
            continue
        before, after = _since(node.op_type, current), _since(node.op_type, target)
        unknown = before is None or after is None
        if unknown or (before != after and node.op_type not in TYPE_ONLY_UPDATES):
            bad.add(node.op_type)
    return sorted(bad)


def require_default_opset(model: ir.Model, target: int, cache: dict) -> str | None:
    """Raise the default-domain opset to ``target`` if that is provably safe.

    Returns None when the model is (now) at ``target`` or above, else why it cannot be.
    Memoized in ``cache`` (the rewrite context's), since every rule in a run asks.
    """
    key = ("default-opset", target)
    if key in cache:
        return cache[key]
    bad = changed_ops(model, target)
    if bad:
        reason = f"raising the opset to {target} would change the meaning of {', '.join(bad)}"
    else:
        reason = None
        current = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        if current < target:
            model.opset_imports.pop("ai.onnx", None)
            model.opset_imports[""] = target
            model.graph.opset_imports.pop("ai.onnx", None)
            model.graph.opset_imports[""] = target
            model.ir_version = max(model.ir_version or 0, 10)
    cache[key] = reason
    return reason
