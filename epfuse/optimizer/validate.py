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
        onnx.checker.check_model(checkable)
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


def _line(err: BaseException) -> str:
    lines = [x for x in str(err).strip().splitlines() if x.strip()]
    return lines[0][:300] if lines else type(err).__name__
