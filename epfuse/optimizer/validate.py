"""Final validation: the rewritten model passes onnx.checker and loads in ORT's CPU EP
whenever every op in it has a CPU kernel for its dtype."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort

from epfuse.errors import ValidationError

_NO_KERNEL = ("Could not find an implementation", "NOT_IMPLEMENTED")
_PROTO_LIMIT = 1_800_000_000


def validate(model: ir.Model) -> str | None:
    """Raise ValidationError, or return a note when the CPU load was not applicable."""
    proto = ir.to_proto(model)
    try:
        if proto.ByteSize() < _PROTO_LIMIT:
            onnx.checker.check_model(proto)
    except Exception as err:
        raise ValidationError(f"optimized model fails onnx.checker: {_line(err)}") from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    in_memory = proto.ByteSize() < _PROTO_LIMIT and not any(
        isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()
    )
    try:
        if in_memory:
            ort.InferenceSession(
                proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "model.onnx"
                ir.save(model, path, external_data="model.onnx.data")
                ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:
        message = str(err)
        if any(marker in message for marker in _NO_KERNEL):
            return f"not loaded on the CPU EP (no CPU kernel): {_line(err)}"
        raise ValidationError(
            f"optimized model does not load in ONNX Runtime: {_line(err)}"
        ) from None
    return None


def _line(err: BaseException) -> str:
    lines = [x for x in str(err).strip().splitlines() if x.strip()]
    return lines[0][:300] if lines else type(err).__name__
