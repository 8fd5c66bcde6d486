"""Loading and saving models: clear one-line errors, external data, atomic writes, and
nothing the user owns overwritten.

Why so careful: an input's external data can sit where the output's would go (``a.onnx``
reading ``b.onnx.data``, written to ``-o b.onnx``), a report path can name the input, and a
killed run can leave a half-written folder beside the output. So every output path is checked
against every file the input reads *before* anything is written (:func:`check_output`), the
output's data file gets a name nothing reads (:func:`external_data_name`), writes go through a
temporary entry beside the target that is renamed into place, and temporary entries carry the
writer's pid so that a later run removes those whose writer is gone (:func:`clean_stale`).
Every OS failure becomes :class:`~epfuse.errors.OutputError` (``cannot write OUT: reason``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from epfuse.errors import ModelLoadError, OutputError

EXTERNAL_DATA_THRESHOLD = 1 << 30  # bytes of initializers above which output uses external data
SMALL_TENSOR_BYTES = 1024
"""External tensors below this (onnx's own default ``size_threshold``) are read into memory on
load: they are shape and mask constants that the proofs and shape inference must see."""

if TYPE_CHECKING:
    import onnx_ir as ir

# onnx_ir is imported inside the functions that need it: the CLI checks every output path
# (check_output, input_files) before paying for it.

TEMP_PREFIX = ".epfuse-tmp-"
_TEMP_RE = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-")


def load_model(path: str | os.PathLike) -> ir.Model:
    """Read an ONNX file (large external data lazily, small tensors now) or raise
    ModelLoadError."""
    import onnx_ir as ir

    if str(path) == "":
        raise ModelLoadError("empty path: expected an .onnx file")
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file")
    try:
        if path.stat().st_size == 0:
            raise ModelLoadError(f"{path}: file is empty")
        proto = onnx.load(str(path), load_external_data=False)
    except ModelLoadError:
        raise
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read it ({reason(err)})") from None
    except Exception as err:
        raise ModelLoadError(f"{path}: not an ONNX model ({_first_line(err)})") from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"{path}: not an ONNX model (no graph; truncated or other format)")
    _check_opset(proto, path)
    _check_external_locations(proto, path)
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
    _load_small_tensors(model, path)
    return model


def _check_opset(proto: onnx.ModelProto, path: Path) -> None:
    newest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > newest:
            raise ModelLoadError(
                f"{path}: input opset {opset.version} unsupported (the installed onnx knows "
                f"ONNX opsets up to {newest})"
            )


def _external_locations(proto: onnx.ModelProto) -> Iterable[str]:
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    yield entry.value


def _check_external_locations(proto: onnx.ModelProto, path: Path) -> None:
    """Refuse external data outside the model's folder, whether by ``..``, an absolute path,
    or a symlinked file or folder on the way (onnx refuses some of these with tracebacks)."""
    base = path.parent.resolve()
    for location in _external_locations(proto):
        target = (path.parent / location).resolve()
        if not target.is_relative_to(base) or Path(location).is_absolute():
            raise ModelLoadError(
                f"{path}: external data {location!r} lies outside the model's folder "
                "(through '..', an absolute path or a symlink); refusing to read it"
            )
        if (path.parent / location).is_symlink() or target != base / Path(location):
            raise ModelLoadError(
                f"{path}: external data {location!r} is reached through a symlink; "
                "refusing to read it"
            )


def _set_base_dir(model: ir.Model, base_dir: Path) -> None:
    import onnx_ir as ir

    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            tensor.base_dir = str(base_dir)


def _check_external_data(model: ir.Model, path: Path) -> None:
    import onnx_ir as ir

    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            data = Path(tensor.base_dir) / tensor.location
            if not data.is_file():
                raise ModelLoadError(f"{path}: external data file {tensor.location!r} is missing")
            if tensor.length and data.stat().st_size < tensor.offset + tensor.length:
                raise ModelLoadError(f"{path}: external data file {tensor.location!r} is truncated")


def _load_small_tensors(model: ir.Model, path: Path) -> None:
    import onnx_ir as ir

    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes < SMALL_TENSOR_BYTES:
            try:
                array = tensor.numpy()
            except Exception as err:
                raise ModelLoadError(
                    f"{path}: cannot read external data {tensor.location!r} ({_first_line(err)})"
                ) from None
            value.const_value = ir.Tensor(array.copy(), dtype=tensor.dtype, name=tensor.name)


def uses_external_data(model: ir.Model) -> bool:
    import onnx_ir as ir

    return any(
        isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()
    )


def files_read(model: ir.Model, path: str | os.PathLike | None = None) -> dict[Path, str]:
    """Every file reading ``model`` touches (resolved) -> what it is, for refusing to write
    over it: the model file itself and its external data files."""
    import onnx_ir as ir

    files: dict[Path, str] = {}
    if path is not None:
        files[Path(path).resolve()] = "refusing to overwrite the input model"
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            data = (Path(tensor.base_dir) / tensor.location).resolve()
            files[data] = "the input model reads its weights from it (refusing to overwrite them)"
    return files


def input_files(path: str | os.PathLike) -> dict[Path, str]:
    """:func:`files_read` for a model file, read from its header only (no weights); a file
    that does not parse protects just itself (loading it reports the error)."""
    path = Path(path)
    files = {path.resolve(): "refusing to overwrite the input model"}
    if not path.is_file():
        return files
    with contextlib.suppress(Exception):
        proto = onnx.load(str(path), load_external_data=False)
        for location in _external_locations(proto):
            files[(path.parent / location).resolve()] = (
                "the input model reads its weights from it (refusing to overwrite them)"
            )
    return files


def external_data_name(path: str | os.PathLike, protected: Mapping[Path, str]) -> str:
    """``<name>.data`` beside ``path``, or the first ``<name>.epfuse[-N].data`` that no file in
    ``protected`` (the input's own files) is."""
    path = Path(path)
    candidates = [f"{path.name}.data", f"{path.name}.epfuse.data"]
    candidates += [f"{path.name}.epfuse-{i}.data" for i in range(2, 100)]
    for name in candidates:
        if (path.parent / name).resolve() not in protected:
            return name
    raise OutputError(f"cannot write {path}: no free name for its external data")


def reason(err: OSError) -> str:
    """'permission denied', 'no space left on device', ... for an OSError."""
    if err.strerror:
        return err.strerror[:1].lower() + err.strerror[1:]
    return _first_line(err)


def check_output(
    path: str | os.PathLike,
    protected: Mapping[Path, str] = {},
    *,
    create_parents: bool = True,
    directory: bool = False,
) -> None:
    """Raise OutputError unless ``path`` can be written without touching ``protected`` files.

    Checks what can be checked before anything is written: the path is no protected file,
    not an existing directory (or, with ``directory``, not an existing file), its folder
    exists (or, with ``create_parents``, can be made below an existing folder) and a temporary
    entry can be created there (catches read-only folders, /proc, permissions)."""
    path = Path(path)
    text = str(path)
    resolved = path.resolve()
    if resolved in protected:
        raise OutputError(f"cannot write {text}: {protected[resolved]}")
    if directory:
        if path.exists() and not path.is_dir():
            raise OutputError(f"cannot write {text}: it is a file, expected a folder")
    elif path.is_dir():
        raise OutputError(f"cannot write {text}: is a directory")
    elif path.exists() and not path.is_file():
        raise OutputError(f"cannot write {text}: not a regular file")
    folder = path if directory else path.parent
    ancestor = folder
    while not ancestor.exists():
        if not create_parents:
            raise OutputError(f"cannot write {text}: no such directory {folder}")
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"cannot write {text}: {ancestor} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=ancestor)
        os.rmdir(probe)
    except OSError as err:
        raise OutputError(
            f"cannot write {text}: cannot create files in {ancestor} ({reason(err)})"
        ) from None


def clean_stale(folder: str | os.PathLike) -> list[Path]:
    """Remove temporary entries of epfuse runs that are gone (killed mid-save) from
    ``folder``; return them. An entry's name carries its writer's pid."""
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for entry in Path(folder).iterdir():
            match = _TEMP_RE.match(entry.name)
            if match and not _alive(int(match.group(1))):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()
                removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p, returning the folders it created (deepest last) for removal on failure."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        made.mkdir()
    return list(reversed(missing))


def _remove_made(made: list[Path]) -> None:
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def save_model(
    model: ir.Model,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    protected: Mapping[Path, str] = {},
) -> Path:
    """Write atomically: into a temporary folder beside ``path``, then rename into place.

    External data is written (beside the model, named by :func:`external_data_name` so that
    it is none of the ``protected`` files) when asked for, when the input had it, or when the
    weights are large. Raises OutputError; on any failure (a signal included) nothing new is
    left behind.
    """
    import onnx_ir as ir

    path = Path(path)
    check_output(path, protected)
    if external_data is None:
        external_data = uses_external_data(model) or _weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
    data_name = external_data_name(path, protected) if external_data else None
    made: list[Path] = []
    tmp_dir: Path | None = None
    placed: Path | None = None
    try:
        made = _make_parents(path.parent)
        clean_stale(path.parent)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=path.parent))
        tmp_model = tmp_dir / path.name
        if data_name is not None:
            ir.save(model, tmp_model, external_data=data_name)
            placed = path.parent / data_name
            os.replace(tmp_dir / data_name, placed)
        else:
            ir.save(model, tmp_model)
        os.replace(tmp_model, path)
    except BaseException as err:
        if placed is not None:
            with contextlib.suppress(OSError):
                placed.unlink()
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir = None
        _remove_made(made)
        if isinstance(err, OSError):
            raise OutputError(f"cannot write {path}: {reason(err)}") from None
        raise
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a text file atomically (temporary file beside it, then rename); OutputError."""
    path = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=path.parent)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        raise OutputError(f"cannot write {path}: {reason(err)}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def remove_written(path: str | os.PathLike) -> None:
    """Undo a :func:`save_model` (the model and any data file it named) after a later
    failure, so that a failed run leaves nothing behind."""
    path = Path(path)
    with contextlib.suppress(Exception):
        proto = onnx.load(str(path), load_external_data=False)
        for location in set(_external_locations(proto)):
            with contextlib.suppress(OSError):
                (path.parent / location).unlink()
    with contextlib.suppress(OSError):
        path.unlink()


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


__all__ = [
    "check_output",
    "clean_stale",
    "external_data_name",
    "files_read",
    "input_files",
    "load_model",
    "save_model",
    "write_text",
]
