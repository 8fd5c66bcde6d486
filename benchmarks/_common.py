"""Shared helpers of the benchmark scripts: cache folder, machine load, JSON output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# The scripts import the epfuse of this checkout, not an installed copy.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def cache_dir(override: str | None) -> Path:
    """Where exports are cached between runs (outside git: exports are large and slow)."""
    root = Path(
        override
        or os.environ.get("EPFUSE_BENCH_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "epfuse-bench"
    )
    root.mkdir(parents=True, exist_ok=True)
    return root


def load() -> dict[str, float]:
    """The 1/5/15-minute load averages, so every result says how busy the machine was."""
    one, five, fifteen = os.getloadavg()
    return {"load1": round(one, 2), "load5": round(five, 2), "load15": round(fifteen, 2)}


def load_line() -> str:
    info = load()
    return (
        f"load average {info['load1']:.2f} {info['load5']:.2f} {info['load15']:.2f} "
        f"on {os.cpu_count()} cores"
    )


def environment() -> dict:
    import onnx
    import onnxruntime

    env = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    try:
        import subprocess

        env["git"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        pass
    return env


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)
