"""Final validation: the rewritten model passes onnx.checker and loads in ORT's CPU EP
whenever every op in it has a CPU kernel for its dtype.

ORT registers a few ops of its own in the default ONNX domain (``SimplifiedLayerNormalization``)
that onnx.checker does not know. Those nodes are checked against ORT's own schema instead
(inputs, outputs, attribute names), and the rest of the model goes through onnx.checker with
them moved to a private domain; the ORT load below then checks them for real."""

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


def validate(model: ir.Model) -> str | None:
    """Raise ValidationError, or return a note when the CPU load was not applicable."""
    external = any(
        isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()
    )
    proto = None if external else ir.to_proto(model)
    if proto is not None and proto.ByteSize() < _PROTO_LIMIT:
        return _check(proto, proto.SerializeToString())
    # Large or external-data models are checked from a file, as ORT and onnx expect them.
    with tempfile.TemporaryDirectory(prefix="epfuse-validate-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        return _check(str(path), str(path))


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
