"""The public API: ``optimize`` and ``optimize_with_report``."""

from __future__ import annotations

import json
import os
from typing import TypeVar, overload

import onnx
import onnx_ir as ir

from epfuse.capabilities import DTYPES, EPCapabilities, get_ep
from epfuse.errors import UnsupportedModelError
from epfuse.patterns import OptimizeOptions

from .io import load_model
from .manager import PassManager
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


def optimize_with_report(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    ep: str | EPCapabilities = "cpu",
    *,
    max_seq_len: int = OptimizeOptions.max_seq_len,
    validate_output: bool = True,
):
    """Optimize and return ``(optimized_model, report)``.

    ``model`` may be a path, an ``onnx.ModelProto`` (a ModelProto is returned) or an
    ``onnx_ir.Model`` (an ``onnx_ir.Model`` is returned; the argument itself is not changed).
    The report is also stored as JSON in the output's ``metadata_props["epfuse.report"]``.
    """
    record = get_ep(ep)
    if max_seq_len < 1:
        raise ValueError("max_seq_len must be positive")
    as_proto = isinstance(model, onnx.ModelProto)
    if as_proto:
        work = ir.serde.deserialize_model(model)
    elif isinstance(model, ir.Model):
        work = ir.serde.deserialize_model(ir.to_proto(model))
    else:
        work = load_model(model)
    dtype = model_dtype(work)
    options = OptimizeOptions(max_seq_len=max_seq_len)
    report = PassManager().run(work, record, dtype, options)
    if not report.layers:
        raise UnsupportedModelError("no attention found in the model (nothing to optimize)")
    if validate_output:
        note = validate(work)
        if note:
            report.assumptions.append(note)
    work.metadata_props[METADATA_KEY] = report.to_json()
    return (ir.to_proto(work) if as_proto else work), report


def read_report(model: onnx.ModelProto | ir.Model) -> Report | None:
    """The report stored in an optimized model, if any."""
    if isinstance(model, onnx.ModelProto):
        props = {p.key: p.value for p in model.metadata_props}
    else:
        props = model.metadata_props
    text = props.get(METADATA_KEY)
    return Report.from_dict(json.loads(text)) if text else None


def model_dtype(model: ir.Model) -> str:
    """The activation dtype: that of the KV-cache inputs, else the first float output."""
    candidates = [v for v in model.graph.inputs if v.shape is not None and len(v.shape) == 4]
    candidates += list(model.graph.outputs)
    for value in candidates:
        if value.dtype is None:
            continue
        if value.dtype in _DTYPE_NAMES:
            return _DTYPE_NAMES[value.dtype]
        if value.dtype.is_floating_point():
            raise UnsupportedModelError(
                f"unsupported dtype {value.dtype.name.lower()} (epfuse handles {', '.join(DTYPES)})"
            )
    raise UnsupportedModelError("cannot tell the model's float dtype from its inputs or outputs")
