"""Final validation: the rewritten model passes onnx.checker and loads in ORT's CPU EP
whenever every op in it has a CPU kernel for its dtype.

ORT registers a few ops of its own in the default ONNX domain (``SimplifiedLayerNormalization``)
that onnx.checker does not know. Those nodes are checked against ORT's own schema instead
(inputs, outputs, attribute names), and the rest of the model goes through onnx.checker with
them moved to a private domain; the ORT load below then checks them for real.

Weights that live in external data are not read: a large external initializer is the input
model's own tensor, which no rule rewrites, the loader already checked against its data file,
and saving copies byte for byte; a large lazy tensor (a packed QKV weight concatenated from
such weights when saved) is likewise not evaluated. Each is checked as a graph input of the
same name, dtype and shape, so onnx.checker and ORT still resolve the
whole graph, infer every type and shape and create every kernel, without holding the weights
(ORT would otherwise read them all into memory, and pre-pack MatMul weights on top).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort

from epfuse.errors import ValidationError

_NO_KERNEL = ("Could not find an implementation", "NOT_IMPLEMENTED")
_PROTO_LIMIT = 1_800_000_000
ORT_INTERNAL_DEFAULT_DOMAIN = frozenset({"SimplifiedLayerNormalization"})
"""Ops ORT defines in the default domain that are not ONNX ops."""
_CHECK_DOMAIN = "epfuse.ort_internal"
# External initializers at least this large are validated as graph inputs (not read); smaller
# ones (shapes, axes, scalars that type and shape inference may need) are read and inlined.
WEIGHT_INPUT_BYTES = 1 << 16


def validate(model: ir.Model) -> str | None:
    """Raise ValidationError, or return a note when the CPU load was not applicable."""
    proto = _structure_proto(model)
    if _has_external(proto):
        _external_weights_to_inputs(proto, model)
    if not _has_external(proto) and proto.ByteSize() < _PROTO_LIMIT:
        return _check(proto, proto.SerializeToString())
    # Large in-memory models (or external data in subgraphs) are checked from a file.
    del proto
    with tempfile.TemporaryDirectory(prefix="epfuse-validate-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        return _check(str(path), str(path))


def _unread_weight(value: ir.Value) -> bool:
    """A large weight not in memory: external data, or a lazy tensor made from such (e.g. a
    packed QKV weight, whose serialization would read and concatenate its parts)."""
    tensor = value.const_value
    return (
        isinstance(tensor, (ir.ExternalTensor, ir.LazyTensor))
        and tensor.nbytes >= WEIGHT_INPUT_BYTES
    )


def _structure_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a proto whose unread weights are graph inputs (the model is restored)."""
    graph = model.graph
    initializers = list(graph.initializers.values())
    held = [v for v in initializers if _unread_weight(v)]
    if not held:
        return ir.to_proto(model)  # external tensors stay references: nothing is read here
    inputs = list(graph.inputs)
    tensors = {id(v): v.const_value for v in held}
    try:
        for value in held:
            if value.shape is None:
                value.shape = value.const_value.shape
            if value.dtype is None:
                value.dtype = value.const_value.dtype
            graph.initializers.pop(value.name)
            value.const_value = None
            if not value.is_graph_input():
                graph.inputs.append(value)
        return ir.to_proto(model)
    finally:
        for value in held:
            value.const_value = tensors[id(value)]
        graph.inputs.clear()
        graph.inputs.extend(inputs)
        graph.initializers.clear()
        for value in initializers:
            graph.initializers.add(value)


def _has_external(proto: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _tensors(proto.graph))


def _tensors(graph: onnx.GraphProto):
    """Every tensor of ``graph``: initializers and tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _tensors(sub)


def _external_weights_to_inputs(proto: onnx.ModelProto, model: ir.Model) -> None:
    """In ``proto`` (a copy), turn the main graph's external initializers into graph inputs
    (large ones) or inline data (small ones). Subgraph initializers are left as they are."""
    graph = proto.graph
    input_names = {i.name for i in graph.input}
    kept = []
    for tensor in graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            kept.append(tensor)
            continue
        value = model.graph.initializers.get(tensor.name)
        source = value.const_value if value is not None else None
        if source is None:
            kept.append(tensor)  # not ours to interpret; the file-based check handles it
            continue
        if source.nbytes >= WEIGHT_INPUT_BYTES:
            if tensor.name not in input_names:
                graph.input.append(
                    onnx.helper.make_tensor_value_info(
                        tensor.name, tensor.data_type, list(tensor.dims)
                    )
                )
                input_names.add(tensor.name)
            continue
        inline = onnx.TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = onnx.TensorProto.DEFAULT
        inline.raw_data = source.tobytes()
        kept.append(inline)
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _check(checkable, loadable) -> str | None:
    try:
        if isinstance(checkable, str):
            proto = onnx.load(checkable, load_external_data=False)
            if _move_internal_ops(proto):
                moved = str(Path(checkable).with_name("epfuse-checked.onnx"))
                onnx.save(proto, moved)
                checkable = moved
        else:
            proto = onnx.ModelProto()
            proto.CopyFrom(checkable)
            if _move_internal_ops(proto):
                checkable = proto
        onnx.checker.check_model(checkable)
    except ValidationError:
        raise
    except Exception as err:
        raise ValidationError(f"optimized model fails onnx.checker: {_line(err)}") from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(loadable, options, providers=["CPUExecutionProvider"])
    except Exception as err:
        if any(marker in str(err) for marker in _NO_KERNEL):
            return f"not loaded on the CPU EP (no CPU kernel): {_line(err)}"
        raise ValidationError(
            f"optimized model does not load in ONNX Runtime: {_line(err)}"
        ) from None
    return None


def _move_internal_ops(proto: onnx.ModelProto) -> bool:
    """Check ORT-internal default-domain nodes against ORT's schema and move them out of the
    way of onnx.checker. Returns whether any node was moved."""
    moved = False
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in ORT_INTERNAL_DEFAULT_DOMAIN:
            _check_against_ort_schema(node)
            node.domain = _CHECK_DOMAIN
            moved = True
    if moved:
        proto.opset_import.add(domain=_CHECK_DOMAIN, version=1)
    return moved


def _check_against_ort_schema(node: onnx.NodeProto) -> None:
    schema = _ort_schemas().get(node.op_type)
    if schema is None:
        raise ValidationError(f"{node.op_type}: not an op of the installed ONNX Runtime")
    if len(node.input) > len(schema.inputs) or len(node.output) > len(schema.outputs):
        raise ValidationError(f"{node.op_type} {node.name!r}: too many inputs or outputs")
    required = sum(1 for i in schema.inputs if i.option == _single_option())
    if sum(1 for name in node.input if name) < required:
        raise ValidationError(f"{node.op_type} {node.name!r}: a required input is missing")
    unknown = {a.name for a in node.attribute} - set(schema.attributes)
    if unknown:
        raise ValidationError(f"{node.op_type} {node.name!r}: unknown attributes {sorted(unknown)}")


def _single_option():
    from onnxruntime.capi.onnxruntime_pybind11_state import schemadef

    return schemadef.OpSchema.FormalParameterOption.Single


_SCHEMAS: dict[str, object] = {}


def _ort_schemas() -> dict[str, object]:
    if not _SCHEMAS:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

        for schema in get_all_operator_schema():
            if schema.domain == "" and schema.name in ORT_INTERNAL_DEFAULT_DOMAIN:
                _SCHEMAS[schema.name] = schema
    return _SCHEMAS


def _line(err: BaseException) -> str:
    lines = [x for x in str(err).strip().splitlines() if x.strip()]
    return lines[0][:300] if lines else type(err).__name__
