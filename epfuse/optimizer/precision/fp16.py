"""float32 -> float16 / bfloat16 conversion of a canonical graph, weights converted lazily.

Why not ``onnxruntime.transformers.float16.convert_float_to_float16`` itself: it converts
to float16 only (bfloat16 only as the dtype of blocked nodes), and it works on a ModelProto
with every weight loaded: given a model whose weights are external data it retypes those
tensors to float16 without converting their bytes. epfuse holds weights lazily in an
``onnx_ir`` model (external data is read when saved), so converting through it would hold the
fp32 weights twice (IR and proto) plus the fp16 result. onnx-ir (0.1) and onnxscript (0.7)
have no precision-conversion pass. So this module applies the same rules as ORT's converter
on the IR, and reuses its pieces: ``convert_np_to_float16`` (its clamping of values outside
the fp16 range: +-65504, and tiny magnitudes to the smallest subnormal, so a float32
``finfo.min`` mask constant stays a large finite negative) and ``DEFAULT_OP_BLOCK_LIST``
(ops kept in float32 with Casts around them). Each weight becomes an ``onnx_ir.LazyTensor``
converted when it is read (saving, a rule concatenating it), so one fp32 weight at a time is
in memory.

What stays float32, as the fused ops expect: RMSNormalization / LayerNormalization keep their
``stash_type=1`` (statistics in fp32); ONNX ``Attention`` gets ``softmax_precision=1`` (its
softmax in fp32, as GroupQueryAttention's kernels do). RoPE cos/sin caches that the
canonicalization built from float64 (``RewriteContext.record_float64``) are rounded once,
from float64, to the target dtype.

Graph inputs and outputs take the compute dtype (past/present K/V and logits), as the
onnxruntime-genai builder writes fp16 models; integer inputs are untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_np_to_float16

_TARGETS = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}
_FLOAT = ir.DataType.FLOAT
_BLOCKED = frozenset(DEFAULT_OP_BLOCK_LIST)
_DTYPE_ATTR_OPS = frozenset(
    ("EyeLike", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")
)
_FP32_SOFTMAX = 1  # TensorProto.FLOAT


@dataclasses.dataclass
class ConversionSummary:
    target: str
    values: int = 0
    weights: int = 0
    weights_from_float64: int = 0
    blocked_nodes: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        text = f"{self.weights} weights and {self.values} values converted to {self.target}"
        if self.weights_from_float64:
            text += f" ({self.weights_from_float64} RoPE caches rounded once from float64)"
        if self.blocked_nodes:
            text += f"; {len(self.blocked_nodes)} node(s) kept in float32 with Casts"
        return text


def convert_array(array: np.ndarray, target: str) -> np.ndarray:
    """One rounding of a float array to ``target`` (fp16 with ORT's range clamping)."""
    array = np.asarray(array)
    if target == "float16":
        # (ORT's helper indexes with np.where, which 0-d arrays do not take.)
        converted = convert_np_to_float16(np.atleast_1d(array))
        return np.asarray(converted, dtype=np.float16).reshape(array.shape)
    return array.astype(ml_dtypes.bfloat16)


def _lazy(tensor: ir.TensorProtocol, target: str, source64: np.ndarray | None) -> ir.LazyTensor:
    dtype = _TARGETS[target]

    def build() -> ir.Tensor:
        array = source64 if source64 is not None else tensor.numpy()
        return ir.Tensor(convert_array(array, target), dtype=dtype, name=tensor.name)

    return ir.LazyTensor(build, dtype=dtype, shape=tensor.shape, name=tensor.name)


def convert_float(
    model: ir.Model, target: str, float64_sources: Mapping[str, Any] | None = None
) -> ConversionSummary:
    """Convert every float32 value, weight and type attribute of ``model`` to ``target``
    (``"float16"`` or ``"bfloat16"``), in place. See the module docstring for what stays fp32.
    """
    if target not in _TARGETS:
        raise ValueError(f"cannot convert to {target!r}; targets: {sorted(_TARGETS)}")
    dtype = _TARGETS[target]
    sources = dict(float64_sources or {})
    summary = ConversionSummary(target)
    graphs = [model.graph, *_subgraphs(model.graph)]
    blocked = [
        node
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.domain in ("", "ai.onnx") and node.op_type in _BLOCKED and _touches_float(node)
    ]
    blocked_ids = {id(n) for n in blocked}
    keep_fp32 = {id(v) for n in blocked for v in n.outputs}

    for graph in graphs:
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None or tensor.dtype != _FLOAT:
                continue
            uses = value.uses()
            if uses and all(id(u.node) in blocked_ids for u in uses):
                continue  # read by float32-only nodes: keep it exact
            value.const_value = _lazy(tensor, target, sources.get(value.name))
            value.dtype = dtype
            summary.weights += 1
            summary.weights_from_float64 += value.name in sources
        for value in graph.inputs:
            if value.dtype == _FLOAT:
                value.dtype = dtype
                summary.values += 1

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if id(node) in blocked_ids:
            continue
        _convert_attributes(node, dtype, target)
        for value in node.outputs:
            if value.dtype == _FLOAT and id(value) not in keep_fp32:
                value.dtype = dtype
                summary.values += 1

    for node in blocked:
        _fence(node, dtype)
        summary.blocked_nodes.append(node.name or node.op_type)
    return summary


def _subgraphs(graph: ir.Graph) -> list[ir.Graph]:
    found = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                found.append(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                found.extend(attr.value)
    return found


def _touches_float(node: ir.Node) -> bool:
    values = [*node.inputs, *node.outputs]
    return any(v is not None and v.dtype == _FLOAT for v in values)


def _convert_attributes(node: ir.Node, dtype: ir.DataType, target: str) -> None:
    attrs = node.attributes
    op = node.op_type
    if node.domain in ("", "ai.onnx"):
        if op == "Cast" and attrs.get("to") is not None and attrs["to"].value == _FLOAT:
            attrs["to"] = ir.AttrInt64("to", dtype)
        dtype_attr = attrs.get("dtype") if op in _DTYPE_ATTR_OPS else None
        if dtype_attr is not None and dtype_attr.value == _FLOAT:
            attrs["dtype"] = ir.AttrInt64("dtype", dtype)
        if op == "ConstantOfShape" and "value" not in attrs and node.outputs[0].dtype == _FLOAT:
            zero = ir.Tensor(np.zeros((1,), dtype=convert_array(np.zeros(1), target).dtype))
            attrs["value"] = ir.AttrTensor("value", zero)
        if op == "Constant":
            for name in ("value_float", "value_floats"):
                if name in attrs:
                    array = np.asarray(attrs.pop(name).value, dtype=np.float32)
                    tensor = ir.Tensor(convert_array(array, target), dtype=dtype)
                    attrs["value"] = ir.AttrTensor("value", tensor)
        if op == "Attention" and "softmax_precision" not in attrs:
            attrs["softmax_precision"] = ir.AttrInt64("softmax_precision", _FP32_SOFTMAX)
    for name, attr in list(attrs.items()):
        if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == _FLOAT:
            tensor = attr.value
            converted = ir.Tensor(convert_array(tensor.numpy(), target), dtype=dtype)
            attrs[name] = ir.AttrTensor(name, converted)


def _fence(node: ir.Node, dtype: ir.DataType) -> None:
    """Keep a blocked node in float32: Cast its converted float inputs to float32 and its
    float32 outputs back to the compute dtype for their readers."""
    graph = node.graph
    for index, value in enumerate(node.inputs):
        if value is None or value.dtype != dtype:
            continue
        cast = ir.node("Cast", [value], {"to": _FLOAT}, name=f"{node.name}/to_fp32_{index}")
        cast.outputs[0].dtype = _FLOAT
        cast.outputs[0].shape = value.shape
        cast.outputs[0].name = f"{value.name}/fp32_for_{node.name or node.op_type}_{index}"
        graph.insert_before(node, cast)
        node.replace_input_with(index, cast.outputs[0])
    for value in node.outputs:
        if value.dtype != _FLOAT:
            continue
        readers = list(value.uses())
        outputs = [i for i, v in enumerate(graph.outputs) if v is value]
        if not readers and not outputs:
            continue
        cast = ir.node("Cast", [value], {"to": dtype}, name=f"{node.name}/from_fp32")
        back = cast.outputs[0]
        back.dtype, back.shape = dtype, value.shape
        graph.insert_after(node, cast)
        for use in readers:
            use.node.replace_input_with(use.idx, back)
        if outputs:
            back.name, value.name = value.name, f"{value.name}/fp32"
            for i in outputs:
                graph.outputs[i] = back
