"""Bundled example models.

``EXAMPLE_MODEL`` is a 2-layer random-weight GQA Llama (vocab 256, hidden 64, 4 query / 2 KV
heads, head_dim 16) exported by torch.onnx (dynamo) at opset 23 with a KV cache. Regenerate it
with ``python scripts/make_example.py``.
"""

from pathlib import Path

EXAMPLES_DIR: Path = Path(__file__).resolve().parent
EXAMPLE_MODEL: Path = EXAMPLES_DIR / "tiny-llama-opset23.onnx"

__all__ = ["EXAMPLES_DIR", "EXAMPLE_MODEL"]
