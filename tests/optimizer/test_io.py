"""Model I/O: atomic saves that leave nothing behind on any failure (a signal included), OS
errors as one-line OutputErrors, stale temporary entries, and inputs whose external data
would be overwritten or read from outside their folder."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import onnx
import onnx_ir as ir
import pytest
from external_data import symlinked_data_model, with_external_data

import epfuse
from epfuse.errors import (
    EpfuseError,
    ModelLoadError,
    ModelTypeError,
    OptionError,
    OutputError,
    UnsupportedModelError,
)
from epfuse.optimizer import io
from epfuse.optimizer.cli import Terminated, _on_signal


@pytest.fixture
def model(example_model):
    return io.load_model(example_model)


def _entries(folder):
    return sorted(p.name for p in folder.rglob("*"))


@pytest.mark.parametrize(
    ("code", "text"),
    [(errno.EACCES, "permission denied"), (errno.ENOSPC, "no space left on device")],
)
def test_os_errors_are_output_errors_and_leave_nothing(tmp_path, model, monkeypatch, code, text):
    """Read-only folder and full file system (simulated: the suite runs as root, for whom
    chmod does not stop writes)."""

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(io.os, "replace", fail)
    out = tmp_path / "new" / "deeper" / "o.onnx"
    with pytest.raises(OutputError) as caught:
        io.save_model(model, out, external_data=True)
    assert str(caught.value) == f"cannot write {out}: {text}"
    assert isinstance(caught.value, OSError) and isinstance(caught.value, EpfuseError)
    assert _entries(tmp_path) == []  # no temp folder, no data file, no created folders


def test_sigterm_during_save_cleans_up(tmp_path, model, monkeypatch):
    """SIGTERM (as the CLI handles it) in the middle of writing: the temp folder and the
    already placed data file are removed."""
    real_save = ir.save

    def save_then_signal(*args, **kwargs):
        real_save(*args, **kwargs)
        _on_signal(signal.SIGTERM, None)

    monkeypatch.setattr(ir, "save", save_then_signal)
    with pytest.raises(Terminated):
        io.save_model(model, tmp_path / "o.onnx", external_data=True)
    assert _entries(tmp_path) == []


def test_stale_entries_of_dead_writers_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{io.TEMP_PREFIX}{dead.pid}-x").mkdir()
    (tmp_path / f"{io.TEMP_PREFIX}{dead.pid}-y.json").write_text("{}")
    (tmp_path / f"{io.TEMP_PREFIX}{os.getpid()}-z").mkdir()
    (tmp_path / ".epfuse-unrelated").mkdir()
    removed = io.clean_stale(tmp_path)
    assert len(removed) == 2
    assert _entries(tmp_path) == [f".epfuse-tmp-{os.getpid()}-z", ".epfuse-unrelated"]


def test_output_data_name_avoids_input_files(tmp_path, example_model):
    with_external_data(example_model, tmp_path / "a.onnx", "b.onnx.data")
    protected = io.input_files(tmp_path / "a.onnx")
    assert (tmp_path / "b.onnx.data").resolve() in protected
    assert io.external_data_name(tmp_path / "b.onnx", protected) == "b.onnx.epfuse.data"
    assert io.external_data_name(tmp_path / "c.onnx", protected) == "c.onnx.data"
    with pytest.raises(OutputError, match="reads its weights from it"):
        io.check_output(tmp_path / "b.onnx.data", protected)
    with pytest.raises(OutputError, match="overwrite the input model"):
        io.check_output(tmp_path / "a.onnx", protected)


def test_symlinked_data_folder_refused_by_the_api(tmp_path, example_model):
    linked = symlinked_data_model(example_model, tmp_path / "outside", tmp_path / "m")
    with pytest.raises(ModelLoadError, match="lies outside the model's folder"):
        epfuse.optimize(linked)


def test_small_external_tensors_are_loaded(tmp_path, example_model):
    with_external_data(example_model, tmp_path / "t0.onnx", "t0.data", size_threshold=0)
    model = io.load_model(tmp_path / "t0.onnx")
    tensors = [v.const_value for v in model.graph.initializers.values()]
    assert any(isinstance(t, ir.ExternalTensor) for t in tensors)  # weights stay lazy
    assert all(
        not isinstance(t, ir.ExternalTensor) for t in tensors if t.nbytes < io.SMALL_TENSOR_BYTES
    )
    _, report = epfuse.optimize_with_report(tmp_path / "t0.onnx")
    assert report.fused_layers == len(report.layers) == 2


@pytest.mark.parametrize(
    ("arg", "cls", "text"),
    [
        (123, ModelTypeError, "not int"),
        (b"\x08\x07", ModelTypeError, "onnx.load_from_string"),
        (None, ModelTypeError, "not NoneType"),
        (onnx.GraphProto(), ModelTypeError, "onnx.helper.make_model"),
        ("", ModelLoadError, "empty path"),
    ],
)
def test_api_bad_model_arguments(arg, cls, text):
    with pytest.raises(cls, match=text) as caught:
        epfuse.optimize(arg)
    assert isinstance(caught.value, EpfuseError)
    if cls is ModelTypeError:
        assert isinstance(caught.value, TypeError)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "positive integer, got 0"),
        (2.5, "positive integer, got 2.5"),
        (True, "positive integer, got True"),
        (99999999999, "above 2147483647"),
        (2_000_000_000, "the limit here is"),
    ],
)
def test_api_max_seq_len_validated(example_model, value, text):
    with pytest.raises(OptionError, match=text) as caught:
        epfuse.optimize(example_model, max_seq_len=value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)


def test_api_retarget_refused_and_never_runs_on_ep(example_model):
    optimized = epfuse.optimize(onnx.load(str(example_model)), "cpu")
    for ep in ("default", "dml"):
        with pytest.raises(UnsupportedModelError, match=f"cannot re-target this model to {ep}"):
            epfuse.optimize(optimized, ep)


def test_opset_beyond_onnx_is_named(tmp_path, example_model):
    proto = onnx.load(str(example_model))
    for opset in proto.opset_import:
        if opset.domain == "":
            opset.version = 9999
    onnx.save(proto, str(tmp_path / "f.onnx"))
    with pytest.raises(ModelLoadError, match="input opset 9999 unsupported"):
        io.load_model(tmp_path / "f.onnx")


def test_max_seq_len_above_the_graphs_own_positions_warns(example_model):
    """An optimized model carries cos/sin caches of 4096 rows: asking for more warns."""
    from epfuse.optimizer.api import model_max_positions

    optimized = epfuse.optimize(onnx.load(str(example_model)), "cpu")
    assert model_max_positions(ir.serde.deserialize_model(optimized)) == 4096
    _, report = epfuse.optimize_with_report(optimized, "cpu", max_seq_len=8192)
    assert any("above the model's own maximum position 4096" in w for w in report.warnings)
    _, report = epfuse.optimize_with_report(optimized, "cpu", max_seq_len=4096)
    assert not any("maximum position" in w for w in report.warnings)
