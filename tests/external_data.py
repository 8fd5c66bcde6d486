"""A model whose external weights sit behind a symlinked folder, for the I/O refusal tests.

The API (tests/optimizer/test_io.py) and the CLI battery (test_bad_input_battery.py) both
check that such weights are refused: a link may point anywhere, so following it would read
(and, on save, write) outside the model's folder.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def symlinked_data_model(source: Path, outside: Path, folder: Path) -> Path:
    """Save ``source`` with its weights in ``outside/w.data`` and write ``folder/s.onnx``
    reading them through the link ``folder/weights -> outside``; return that model's path."""
    outside.mkdir(parents=True, exist_ok=True)
    onnx.save(
        onnx.load(str(source)),
        str(outside / "s.onnx"),
        save_as_external_data=True,
        location="w.data",
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "weights").symlink_to(outside, target_is_directory=True)
    proto = onnx.load(str(outside / "s.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "weights/w.data"
    onnx.save(proto, str(folder / "s.onnx"))
    return folder / "s.onnx"
