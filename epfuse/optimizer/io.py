"""Loading and saving models: clear one-line errors, external data, atomic writes."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

from epfuse.errors import ModelLoadError

EXTERNAL_DATA_THRESHOLD = 1 << 30  # bytes of initializers above which output uses external data


def load_model(path: str | os.PathLike) -> ir.Model:
    """Read an ONNX file (and its external data, lazily) or raise ModelLoadError."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: file is empty")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:
        raise ModelLoadError(f"{path}: not an ONNX model ({_first_line(err)})") from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"{path}: not an ONNX model (no graph; truncated or other format)")
    try:
        # By path, so external data is looked up beside the model (and >2GB models work).
        onnx.checker.check_model(str(path))
    except Exception as err:
        raise ModelLoadError(f"{path}: invalid ONNX model ({_first_line(err)})") from None
    try:
        model = ir.serde.deserialize_model(proto)
        _set_base_dir(model, path.parent)
    except Exception as err:
        raise ModelLoadError(f"{path}: cannot read model ({_first_line(err)})") from None
    _check_external_data(model, path)
    return model


def _set_base_dir(model: ir.Model, base_dir: Path) -> None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            tensor.base_dir = str(base_dir)


def _check_external_data(model: ir.Model, path: Path) -> None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            data = Path(tensor.base_dir) / tensor.location
            if not data.exists():
                raise ModelLoadError(f"{path}: external data file {tensor.location!r} is missing")
            if data.stat().st_size < tensor.offset + tensor.length if tensor.length else False:
                raise ModelLoadError(f"{path}: external data file {tensor.location!r} is truncated")


def uses_external_data(model: ir.Model) -> bool:
    return any(
        isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()
    )


def save_model(
    model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None
) -> Path:
    """Write atomically: into a temporary folder beside ``path``, then rename into place.

    External data is written (as ``<name>.data`` beside the model) when asked for, when the
    input had it, or when the weights are large.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = uses_external_data(model) or _weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
    tmp_dir = Path(tempfile.mkdtemp(prefix=".epfuse-", dir=path.parent))
    try:
        tmp_model = tmp_dir / path.name
        data_name = f"{path.name}.data"
        if external_data:
            ir.save(model, tmp_model, external_data=data_name)
            os.replace(tmp_dir / data_name, path.parent / data_name)
        else:
            ir.save(model, tmp_model)
        os.replace(tmp_model, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def _weight_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += tensor.nbytes
    return total


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
