"""int4 weight-only quantization with onnxruntime's ``MatMulNBitsQuantizer``, one weight at a time.

The quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``) takes a ModelProto with
its weights loaded. Handing it the whole model would hold every fp32 weight twice (the IR's,
read from external data, and the proto's) plus the int4 result. So each MatMul with a constant
weight is quantized in a model of its own: that one MatMul, its weight and a typed input. The
quantizer's nodes (``MatMulNBits``, or ``GatherBlockQuantized`` for the embedding) and
initializers replace the original node in the IR model, and the fp32 weight is released. Peak
memory is one fp32 weight plus the int4 weights, whatever the model's size; the quantization
itself is ORT's code, unchanged (block-wise round-to-nearest with a per-block scale, and a
zero point when asymmetric).

This runs after lowering: the packed QKV weight of a fused layer (``lower/pack_qkv``) is one
MatMul, quantized as one weight. Blocks run along the input dimension, one scale per output
column and block, so quantizing the packed [hidden, q+k+v] weight gives exactly the columns
that quantizing Q, K and V apart would: the fused int4 model and the unfused int4 reference
hold the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np
import onnx
import onnx_ir as ir

from epfuse.patterns.analysis.signature import DecoderSignature

from . import Int4Options

CHUNK_BYTES = 32 << 20
"""Weights larger than this are quantized a block of columns at a time (see _chunked_matmul)."""
_LAZY_BYTES = 1 << 16  # validate.WEIGHT_INPUT_BYTES: smaller tensors are inlined there anyway
_SHAPE_OPS = frozenset(("Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten"))


@dataclasses.dataclass
class Int4Summary:
    options: Int4Options
    matmuls: int = 0
    gathers: int = 0
    kept: list[str] = dataclasses.field(default_factory=list)
    """MatMul/Gather weights left in float, and why."""
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0

    def describe(self) -> str:
        text = f"int4: {self.matmuls} MatMul weight(s)"
        if self.gathers:
            text += f" and {self.gathers} embedding table(s)"
        text += f" quantized ({self.options.describe()})"
        if self.weight_bytes_before:
            text += (
                f"; weights {self.weight_bytes_before / 2**20:.1f} -> "
                f"{self.weight_bytes_after / 2**20:.1f} MiB"
            )
        return text


def quantize_int4(model: ir.Model, options: Int4Options) -> Int4Summary:
    """Replace constant-weight MatMuls (and optionally the embedding Gather) with int4 ops."""
    summary = Int4Summary(options)
    graph = model.graph
    lm_head = _lm_head(graph)
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "MatMul":
            weight = node.inputs[1]
            if not _float_weight(weight):
                continue
            if node is lm_head and not options.lm_head:
                summary.kept.append(f"{node.name or 'lm_head'}: lm_head kept (option)")
                continue
            if weight.shape is None or len(weight.shape) != 2:
                summary.kept.append(f"{node.name}: weight is not 2-D")
                continue
            _replace(model, node, 1, options, ("MatMul",), summary)
        elif node.op_type == "Gather" and options.embeddings:
            data = node.inputs[0]
            if _float_weight(data) and data.shape is not None and len(data.shape) == 2:
                _replace(model, node, 0, options, ("Gather",), summary)
    return summary


def _float_weight(value: ir.Value | None) -> bool:
    return (
        value is not None
        and value.const_value is not None
        and value.is_initializer()
        and value.const_value.dtype
        in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    )


def _lm_head(graph: ir.Graph) -> ir.Node | None:
    """The MatMul whose result is the logits output (through shape-only ops)."""
    logits = DecoderSignature.of(graph).logits
    if logits is None and graph.outputs:
        logits = graph.outputs[0]
    node = logits.producer() if logits is not None else None
    while node is not None and node.op_type in _SHAPE_OPS and node.inputs:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node if node is not None and node.op_type == "MatMul" else None


def _replace(
    model: ir.Model,
    node: ir.Node,
    weight_index: int,
    options: Int4Options,
    op_types: tuple[str, ...],
    summary: Int4Summary,
) -> None:
    graph = model.graph
    weight = node.inputs[weight_index]
    tensor = weight.const_value
    summary.weight_bytes_before += tensor.nbytes
    if op_types == ("MatMul",) and tensor.nbytes > CHUNK_BYTES:
        nodes, initializers = _chunked_matmul(model, node, options, CHUNK_BYTES)
    else:
        result = _run_quantizer(_single_node_model(model, node, weight_index), options, op_types)
        nodes, initializers = list(result.node), list(result.initializer)
    if [n.op_type for n in nodes] == [node.op_type]:
        summary.kept.append(f"{node.name}: the quantizer kept it")
        summary.weight_bytes_after += tensor.nbytes
        return
    values: dict[str, ir.Value] = {v.name: v for v in node.inputs if v is not None}
    for proto in initializers:
        # A copy in a message of its own: a sub-message would keep the one-node model's whole
        # protobuf arena alive, fp32 weight bytes included, for as long as the int4 tensor.
        own = onnx.TensorProto.FromString(proto.SerializeToString())
        quantized = ir.serde.deserialize_tensor(own)
        summary.weight_bytes_after += quantized.nbytes
        if quantized.nbytes >= _LAZY_BYTES:
            # Held as a lazy tensor, which the output validation treats like external data
            # (a graph input, not copied into the proto it loads in ORT): the check needs the
            # weight's type and shape, and a copy plus ORT's prepacking of every int4 weight
            # would double the peak memory.
            quantized = ir.LazyTensor(
                (lambda t=quantized: t), dtype=quantized.dtype, shape=quantized.shape, name=own.name
            )
        value = ir.Value(name=_fresh(graph, proto.name), const_value=quantized)
        value.dtype, value.shape = quantized.dtype, quantized.shape
        graph.register_initializer(value)
        values[proto.name] = value
    old = node.outputs[0]
    created = []
    for proto in nodes:
        inputs = [values[name] if name else None for name in proto.input]
        attributes = [ir.serde.deserialize_attribute(a) for a in proto.attribute]
        new = ir.Node(
            proto.domain,
            proto.op_type,
            inputs,
            attributes,
            num_outputs=len(proto.output),
            name=proto.name or None,
        )
        for out, name in zip(new.outputs, proto.output, strict=True):
            out.name = f"{old.name}/{name}" if name != "y" else None
            values[name] = out
        created.append(new)
    graph.insert_after(node, created)
    replacement = values["y"]
    # MatMul's result has A's dtype, Gather's the table's.
    dtype = old.dtype or (node.inputs[0].dtype if weight_index == 1 else tensor.dtype)
    if dtype is not None:  # unknown (no type inference on this graph): leave it to ORT
        replacement.dtype = dtype
        if old.shape is not None:
            replacement.shape = old.shape
    name = old.name
    old.replace_all_uses_with(replacement, replace_graph_outputs=True)
    old.name = None
    replacement.name = name
    graph.remove(node, safe=True)
    if not weight.uses():
        graph.initializers.pop(weight.name, None)
        weight.const_value = None  # release the fp32 weight now
    if op_types == ("MatMul",):
        summary.matmuls += 1
    else:
        summary.gathers += 1
    _set_opset(model, "com.microsoft", 1)


def _run_quantizer(
    mini: onnx.ModelProto, options: Int4Options, op_types: tuple[str, ...]
) -> onnx.GraphProto:
    """ORT's MatMulNBitsQuantizer on a one-node model; the quantized graph."""
    MatMulNBitsQuantizer = _quantizer_class()
    quant_axes = (("Gather", 1),) if op_types == ("Gather",) else None
    quantizer = MatMulNBitsQuantizer(
        mini,
        bits=4,
        block_size=options.block_size,
        is_symmetric=options.symmetric,
        accuracy_level=options.accuracy_level or None,
        op_types_to_quantize=op_types,
        quant_axes=quant_axes,
    )
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # its per-node INFO lines are noise here
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    return quantizer.model.model.graph


def _chunked_matmul(
    model: ir.Model, node: ir.Node, options: Int4Options, chunk_bytes: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Quantize a large [K, N] weight a block of output columns at a time.

    ORT's quantizer holds several fp32 copies of the weight it quantizes (padded, transposed),
    which for a large ``lm_head`` is most of the model. Its blocks run along K, one scale (and
    zero point) per column and block, so column slices quantize independently: the int4
    weight, scales and zero points of the slices, stacked along N (their first axis, N-major
    when flattened), are the whole weight's (checked in the tests).
    """
    weight = node.inputs[1]
    tensor = weight.const_value
    k, n = (int(d) for d in tensor.shape)
    itemsize = max(tensor.nbytes // max(k * n, 1), 1)
    step = max(1, chunk_bytes // (k * itemsize))
    pieces: list[tuple[onnx.NodeProto, list[onnx.TensorProto]]] = []
    for start in range(0, n, step):
        view = tensor.numpy()
        part = np.array(view[:, start : start + step], copy=True)
        del view  # no view of the mapping may outlive the copy, or it cannot be unmapped
        if isinstance(tensor, ir.ExternalTensor):
            with contextlib.suppress(BufferError):
                tensor.release()  # only the pages of these columns were read
        mini = _single_node_model(model, node, 1, array=part)
        del part
        result = _run_quantizer(mini, options, ("MatMul",))
        nodes = list(result.node)
        if [x.op_type for x in nodes] != ["MatMulNBits"]:
            return [onnx.helper.make_node(node.op_type, [], [])], []
        # Copies in messages of their own: a sub-message keeps the chunk model's protobuf
        # arena (its fp32 columns included) alive.
        own_node = onnx.NodeProto.FromString(nodes[0].SerializeToString())
        own = [onnx.TensorProto.FromString(t.SerializeToString()) for t in result.initializer]
        pieces.append((own_node, own))
        del result, nodes, mini
    first, first_inits = pieces[0]
    by_name = {t.name: i for i, t in enumerate(first_inits)}
    merged = []
    for proto in first_inits:
        arrays = []
        for piece_node, inits in pieces:
            index = by_name[proto.name]
            array = onnx.numpy_helper.to_array(inits[index])
            cols = next(a.i for a in piece_node.attribute if a.name == "N")
            arrays.append(array.reshape(cols, -1))
        whole = np.concatenate(arrays, axis=0)
        shape = (n, *onnx.numpy_helper.to_array(first_inits[by_name[proto.name]]).shape[1:])
        if len(shape) == 1:
            shape = (whole.size,)
        merged.append(onnx.numpy_helper.from_array(whole.reshape(shape), proto.name))
    combined = onnx.NodeProto()
    combined.CopyFrom(first)
    for attribute in combined.attribute:
        if attribute.name == "N":
            attribute.i = n
    return [combined], merged


def _quantizer_class():
    """``MatMulNBitsQuantizer``, imported without the root-logger set-up its module does at
    import (``logging.basicConfig(level=INFO)``), which would make every library's INFO
    messages print in the caller's process."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return MatMulNBitsQuantizer


def _single_node_model(
    model: ir.Model, node: ir.Node, weight_index: int, array: np.ndarray | None = None
) -> onnx.ModelProto:
    """A model of ``node`` alone, its weight (or ``array``, a slice of it) loaded: the only
    fp32 weight in memory."""
    weight = node.inputs[weight_index]
    other = node.inputs[1 - weight_index]
    tensor = weight.const_value
    data = tensor.numpy() if array is None else array
    # Loaded here (an external or lazy tensor becomes bytes): the one weight in memory.
    weight_proto = ir.serde.serialize_tensor(ir.Tensor(data, dtype=tensor.dtype))
    del data
    weight_proto.name = weight.name
    if array is None and isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):  # a view still alive elsewhere: keep it
            tensor.release()  # unmap: the proto holds the one copy now
    fallback = tensor.dtype if weight_index == 1 else ir.DataType.INT64
    elem = other.dtype if other.dtype is not None else fallback
    rank = len(other.shape) if other.shape is not None else 3
    dims = [f"d{i}" for i in range(rank)]
    inputs = [onnx.helper.make_tensor_value_info(other.name, int(elem), dims)]
    names = [other.name, weight.name] if weight_index == 1 else [weight.name, other.name]
    attrs = {k: ir.serde.serialize_attribute(a) for k, a in node.attributes.items()}
    proto_node = onnx.helper.make_node(node.op_type, names, ["y"], name=node.name or "w")
    proto_node.attribute.extend(attrs.values())
    out_dtype = node.outputs[0].dtype or ir.DataType.FLOAT
    output = onnx.helper.make_tensor_value_info("y", int(out_dtype), None)
    graph = onnx.helper.make_graph([proto_node], "one", inputs, [output], [weight_proto])
    opset = model.opset_imports.get("", 21)
    return onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", max(opset, 21))],
        ir_version=max(model.ir_version or 10, 10),
    )


def _fresh(graph: ir.Graph, name: str) -> str:
    if name not in graph.initializers:
        return name
    i = 1
    while f"{name}_{i}" in graph.initializers:
        i += 1
    return f"{name}_{i}"


def _set_opset(model: ir.Model, domain: str, version: int) -> None:
    model.opset_imports.setdefault(domain, version)
