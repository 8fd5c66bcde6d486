"""The KV-cache benchmark script still runs against the library's current API.

``benchmarks/kv_cache.py`` broke silently once (the cache boundary moved to onnx_ir while the
script kept handing it protobuf); its ``--quick`` mode is cheap enough to run with the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_cache.py"


def test_quick_mode_measures_both_caches():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [row["past"] for row in rows] == [64, 128]
    for row in rows:
        # int8 holds a quarter of the fp32 bytes; the logits stay close to the float cache's
        assert row["kv_mib"]["int8 cache"] * 4 == row["kv_mib"]["fp32 cache"]
        assert row["max_abs_logits_diff"] < row["max_abs_logits"]
