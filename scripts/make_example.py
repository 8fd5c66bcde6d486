"""Regenerate the bundled example model ``epfuse/examples/tiny-llama-opset23.onnx``.

A 2-layer random-weight GQA Llama (see ``epfuse.testing.hf_export.tiny_llama_config``),
exported with torch.onnx (dynamo) at opset 23 with seed 0, as a single file without external
data. Needs the ``export`` extra (torch, transformers).

    python scripts/make_example.py [--out PATH]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "epfuse" / "examples" / "tiny-llama-opset23.onnx"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    import onnx

    from epfuse.testing.hf_export import export_hf_decoder, tiny_llama_config

    start = time.perf_counter()
    path = export_hf_decoder(tiny_llama_config(), args.out, opset=23, seed=0)
    elapsed = time.perf_counter() - start

    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    counts = collections.Counter(
        f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node
    )
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB) in {elapsed:.1f} s")
    print(", ".join(f"{op} {n}" for op, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
