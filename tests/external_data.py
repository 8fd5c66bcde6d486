"""Models with external weights for the I/O tests: plain, and behind a symlinked folder.

The API (tests/optimizer/test_io.py) and the CLI battery (test_bad_input_battery.py) both
check that such weights are refused: a link may point anywhere, so following it would read
(and, on save, write) outside the model's folder.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def with_external_data(source: Path, path: Path, location: str, size_threshold: int = 1024) -> Path:
    """Save a copy of ``source`` at ``path`` with its initializers of ``size_threshold`` bytes
    or more in the file ``location`` beside it (0: every initializer); return ``path``."""
    onnx.save(
        onnx.load(str(source)),
        str(path),
        save_as_external_data=True,
        location=location,
        size_threshold=size_threshold,
    )
    return path


def symlinked_data_model(source: Path, outside: Path, folder: Path) -> Path:
    """Save ``source`` with its weights in ``outside/w.data`` and write ``folder/s.onnx``
    reading them through the link ``folder/weights -> outside``; return that model's path."""
    outside.mkdir(parents=True, exist_ok=True)
    with_external_data(source, outside / "s.onnx", "w.data")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "weights").symlink_to(outside, target_is_directory=True)
    proto = onnx.load(str(outside / "s.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "weights/w.data"
    onnx.save(proto, str(folder / "s.onnx"))
    return folder / "s.onnx"
