"""The optimizer's own speed and memory: how ``epfuse.optimize`` scales with graph size.

1. Scaling: exports of one Llama architecture (small hidden size: node count is what matters)
   at 4, 16, 64 and 128 layers. Each file is optimized in a fresh subprocess that reports the
   time of ``epfuse.optimize(path, "cpu")`` and the peak resident memory of that process
   (``os.wait4``'s rusage ``ru_maxrss``, also taken just before optimizing, after imports).
   onnxscript's ``optimize_for_ort`` runs on the same files for comparison, with a timeout.
2. Large weights: a model whose weights (a few hundred MB) sit in external data is optimized
   and saved with external data; the peak memory must stay well below the weight bytes (the
   optimizer streams weights rather than holding them).

Exports are cached outside git (``~/.cache/epfuse-bench`` or ``--cache``); torch takes minutes
for 128 layers, so the first run is slow.

    python benchmarks/optimizer.py            # full run, writes benchmarks/results/optimizer.json
    python benchmarks/optimizer.py --quick    # 2 and 8 layers and a small external-data model
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import _common  # puts the checkout on sys.path

SEED = 0

# Runs in the child: import everything, record the baseline peak, then do one measured job.
_WORKER = r"""
import json, resource, sys, time
sys.path.insert(0, {repo!r})
job, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
import onnx, onnx_ir as ir, onnxruntime, numpy  # noqa
if job in ("epfuse", "epfuse-int4"):
    import epfuse
    from epfuse.optimizer.io import save_model
elif job == "onnxscript":
    from onnxscript.rewriter.ort_fusions import optimize_for_ort
def hwm_kb():
    # Peak RSS of this process image (per mm, reset at exec), unlike ru_maxrss (see below).
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base = hwm_kb()
info = {{}}
start = time.perf_counter()
if job in ("epfuse", "epfuse-int4"):
    precision = "int4" if job == "epfuse-int4" else "auto"
    model, report = epfuse.optimize_with_report(path, "cpu", precision=precision)
    info["fused"] = sum(1 for layer in report.layers if layer.fused)
    info["layers"] = len(report.layers)
    info["nodes_before"] = report.nodes_before
    info["nodes_after"] = report.nodes_after
    info["optimize_s"] = time.perf_counter() - start
    if out != "-":
        t = time.perf_counter()
        save_model(model, out)
        info["save_s"] = time.perf_counter() - t
elif job == "onnxscript":
    model = ir.load(path)
    t = time.perf_counter()
    model, counts = optimize_for_ort(model)
    info["optimize_s"] = time.perf_counter() - t
    info["load_s"] = t - start
    info["fusions"] = {{k: v for k, v in counts.items() if v}}
    info["nodes_after"] = len(model.graph)
info["total_s"] = time.perf_counter() - start
info["base_maxrss_kb"] = base
info["peak_hwm_kb"] = hwm_kb()
print("RESULT " + json.dumps(info))
"""


@dataclass
class Measurement:
    case: str
    tool: str
    nodes: int
    ok: bool
    seconds: float | None
    total_seconds: float | None
    peak_mb: float | None
    base_mb: float | None
    detail: dict
    error: str = ""


def run_child(job: str, path: Path, out: str, timeout: float) -> tuple[dict | None, float, str]:
    """Run one job in a fresh interpreter; (result, peak RSS in MB of that child, error)."""
    code = _WORKER.format(repo=str(_common.REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, job, str(path), out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    rusage = None
    timed_out = False
    # Drain the pipes in the background so a chatty child cannot block.
    import threading

    chunks: dict[str, list[str]] = {"out": [], "err": []}

    def drain(stream, key):
        for line in stream:
            chunks[key].append(line)

    threads = [
        threading.Thread(target=drain, args=(proc.stdout, "out"), daemon=True),
        threading.Thread(target=drain, args=(proc.stderr, "err"), daemon=True),
    ]
    for t in threads:
        t.start()
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            break
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=5)
    # Linux keeps the highest RSS of the forking parent in a child's ru_maxrss across exec, so
    # this is max(parent at fork, child); the child also reports its own VmHWM, which is used.
    peak_mb = rusage.ru_maxrss / 1024.0  # Linux: kilobytes
    stdout = "".join(chunks["out"])
    stderr = "".join(chunks["err"])
    if timed_out:
        return None, peak_mb, f"timed out after {timeout:.0f} s"
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), peak_mb, ""
    lines = [x for x in (stderr or stdout).strip().splitlines() if x.strip()]
    return None, peak_mb, (lines[-1] if lines else f"exit code {proc.returncode}")[:300]


# ----------------------------------------------------------------------------- models


def scaling_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    )


def large_config(quick: bool, size: str = "310mb"):
    """~78M float32 parameters (~310 MB) in full mode, ~10M (~40 MB) in quick mode; ``1gb``:
    Llama-3.2-1B's layer shape (hidden 2048, intermediate 8192, 32/8 heads) with 4 layers and
    a 32000 vocabulary, ~374M parameters (~1.4 GB)."""
    from transformers import LlamaConfig

    if size == "1gb":
        return LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=4096,
        )

    if quick:
        return LlamaConfig(
            vocab_size=8000,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
        )
    return LlamaConfig(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    )


def export_cached(config, opset: int, path: Path, external: bool = False) -> Path:
    """Export once and keep it; with ``external``, the weights go to ``<name>.data``."""
    if path.exists():
        return path
    import onnx

    from epfuse.testing.hf_export import export_hf_decoder

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    start = time.perf_counter()
    export_hf_decoder(config, tmp, opset=opset, seed=SEED)
    if external:
        model = onnx.load(str(tmp))
        data = path.name + ".data"
        onnx.save_model(
            model,
            str(tmp),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data,
            size_threshold=1024,
        )
        del model
        os.replace(tmp.with_name(data), path.with_name(data))
    os.replace(tmp, path)
    print(f"  exported {path.name} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def node_count(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def weight_bytes(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            total += int(info.get("length", 0))
        else:
            total += len(init.raw_data) or onnx.numpy_helper.to_array(init).nbytes
    return total


# ----------------------------------------------------------------------------- main


def measure(case, tool, path, nodes, timeout=600.0, out="-") -> Measurement:
    info, peak, err = run_child(tool, path, out, timeout)
    if info is None:
        return Measurement(case, tool, nodes, False, None, None, peak, None, {}, err)
    return Measurement(
        case=case,
        tool=tool,
        nodes=nodes,
        ok=True,
        seconds=info["optimize_s"],
        total_seconds=info["total_s"],
        peak_mb=info["peak_hwm_kb"] / 1024.0,
        base_mb=info["base_maxrss_kb"] / 1024.0,
        detail={**info, "ru_maxrss_mb": peak},
    )


def merge(runs: list[Measurement]) -> Measurement:
    """Median time and the highest peak of repeated runs of one case."""
    ok = [m for m in runs if m.ok]
    if len(ok) < len(runs):
        return next(m for m in runs if not m.ok)
    first = ok[0]
    secs = [m.seconds for m in ok]
    return Measurement(
        case=first.case,
        tool=first.tool,
        nodes=first.nodes,
        ok=True,
        seconds=statistics.median(secs),
        total_seconds=statistics.median(m.total_seconds for m in ok),
        peak_mb=max(m.peak_mb for m in ok),
        base_mb=statistics.median(m.base_mb for m in ok),
        detail={**first.detail, "all_optimize_s": secs},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache", help="export cache folder (default ~/.cache/epfuse-bench)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layers", help="comma-separated layer counts (default 4,16,64,128)")
    parser.add_argument("--opsets", default="23,18", help="opsets of the scaling exports")
    parser.add_argument("--repeats", type=int, help="runs per epfuse measurement (median)")
    parser.add_argument("--onnxscript-timeout", type=float, default=None)
    parser.add_argument("--no-onnxscript", action="store_true")
    parser.add_argument("--no-large", action="store_true", help="skip the external-data case")
    parser.add_argument(
        "--no-int4", action="store_true", help="skip the int4 run of the external-data case"
    )
    parser.add_argument(
        "--large-size",
        choices=("310mb", "1gb"),
        default="310mb",
        help="weights of the external-data case (1gb: Llama-3.2-1B layers, 4 of them)",
    )
    parser.add_argument("--export-only", action="store_true", help="only fill the export cache")
    args = parser.parse_args(argv)

    quick = args.quick
    layer_counts = [int(x) for x in (args.layers or ("2,8" if quick else "4,16,64,128")).split(",")]
    opsets = [int(x) for x in args.opsets.split(",")]
    repeats = args.repeats or (1 if quick else 3)
    ox_timeout = args.onnxscript_timeout or (60.0 if quick else 180.0)
    folder = _common.cache_dir(args.cache) / "optimizer"
    out_path = args.out or _common.RESULTS / ("optimizer-quick.json" if quick else "optimizer.json")
    print(f"# optimizer benchmark ({'quick' if quick else 'full'}); {_common.load_line()}")
    print(f"# cache: {folder}", flush=True)
    load_before = _common.load()

    measurements: list[Measurement] = []
    files: dict[tuple[int, int], Path] = {}
    for opset in opsets:
        for layers in layer_counts:
            files[(opset, layers)] = folder / f"llama-h64-L{layers}-opset{opset}.onnx"
    large_name = "large-quick" if quick else "large"
    if args.large_size == "1gb":
        large_name = "large-1gb"
    large_path = folder / f"{large_name}-opset23.onnx"
    if args.export_only:
        for (opset, layers), path in files.items():
            export_cached(scaling_config(layers), opset, path)
        if not args.no_large:
            export_cached(large_config(quick, args.large_size), 23, large_path, external=True)
        return 0
    # Export in a child process: torch would otherwise stay in this process, and a child
    # inherits its parent's peak RSS in ru_maxrss.
    needed = [p for p in files.values() if not p.exists()]
    if not args.no_large and not large_path.exists():
        needed.append(large_path)
    if needed:
        cmd = [
            sys.executable,
            __file__,
            "--export-only",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        subprocess.run(cmd, check=True)

    # Interleave: one pass over all files per repeat, so load changes hit every size alike.
    runs: dict[tuple[int, int], list[Measurement]] = {k: [] for k in files}
    nodes = {k: node_count(p) for k, p in files.items()}
    for rep in range(repeats):
        for (opset, layers), path in files.items():
            m = measure(f"opset {opset}, {layers} layers", "epfuse", path, nodes[(opset, layers)])
            runs[(opset, layers)].append(m)
            print(f"  [{rep + 1}/{repeats}]", end="")
            _print_measurement(m)
    for key, path in files.items():
        measurements.append(merge(runs[key]))
        if not args.no_onnxscript:
            m = measure(
                f"opset {key[0]}, {key[1]} layers", "onnxscript", path, nodes[key], ox_timeout
            )
            measurements.append(m)
            _print_measurement(m)

    large = None
    if not args.no_large:
        name = large_name
        path = large_path
        wbytes = weight_bytes(path)
        out_dir = folder / "out"
        out_dir.mkdir(exist_ok=True)
        out = out_dir / f"{name}.cpu.onnx"
        m = measure(
            f"external data, {wbytes / 2**20:.0f} MB weights",
            "epfuse",
            path,
            node_count(path),
            900,
            out=str(out),
        )
        out_data = out.with_name(out.name + ".data")
        m.detail["output_external_data"] = out_data.exists()
        m.detail["output_onnx_bytes"] = out.stat().st_size if out.exists() else None
        m.detail["weight_bytes"] = wbytes
        measurements.append(m)
        _print_measurement(m)
        large = {"path": str(path), "weight_bytes": wbytes, "limit_mb": wbytes / 2 / 2**20 + 300}
        if not args.no_int4:
            # int4: each weight is quantized alone (epfuse.optimizer.precision.int4), so the
            # peak must stay as far below the weights as the fp32 run's.
            out4 = out_dir / f"{name}.cpu.int4.onnx"
            m4 = measure(
                f"external data, {wbytes / 2**20:.0f} MB weights, int4",
                "epfuse-int4",
                path,
                node_count(path),
                1800,
                out=str(out4),
            )
            out4_data = out4.with_name(out4.name + ".data")
            m4.detail["output_weight_bytes"] = (
                out4_data.stat().st_size if out4_data.exists() else None
            )
            measurements.append(m4)
            _print_measurement(m4)
            large["int4"] = asdict(m4)
    load_after = _common.load()

    # ----------------------------------------------------------------- report
    print()
    rows = []
    for m in measurements:
        rows.append(
            [
                m.case,
                m.tool,
                str(m.nodes),
                f"{m.seconds:.2f}" if m.ok else m.error[:60],
                f"{m.peak_mb:.0f}" if m.peak_mb is not None else "-",
                f"{m.peak_mb - m.base_mb:.0f}" if m.ok and m.base_mb is not None else "-",
            ]
        )
    print(
        _common.table(
            ["case", "tool", "nodes", "optimize (s)", "peak RSS (MB)", "peak - imports (MB)"], rows
        )
    )

    targets = {}
    for opset in opsets:
        by_layers = {
            int(m.case.split(",")[1].split()[0]): m
            for m in measurements
            if m.tool == "epfuse" and m.case.startswith(f"opset {opset},") and m.ok
        }
        lo, hi = min(layer_counts), max(layer_counts)
        if lo in by_layers and hi in by_layers:
            ratio = by_layers[hi].seconds / by_layers[lo].seconds
            node_ratio = by_layers[hi].nodes / by_layers[lo].nodes
            targets[f"opset {opset}: time {hi} layers / {lo} layers"] = {
                "value": ratio,
                "node_ratio": node_ratio,
                "limit": 35.0 if (lo, hi) == (4, 128) else None,
            }
            print(
                f"opset {opset}: {hi}/{lo} layers: time x{ratio:.1f} for x{node_ratio:.1f} nodes"
                f"; {hi} layers in {by_layers[hi].seconds:.2f} s"
            )
            if hi == 128:
                targets[f"opset {opset}: 128 layers seconds"] = {
                    "value": by_layers[hi].seconds,
                    "limit": 20.0,
                    "fused": by_layers[hi].detail.get("fused"),
                }
    if large is not None:
        m = next(x for x in measurements if x.tool == "epfuse" and x.case.startswith("external"))
        if m.ok:
            print(
                f"external data: peak {m.peak_mb:.0f} MB (imports {m.base_mb:.0f} MB) vs limit "
                f"{large['limit_mb']:.0f} MB (weights/2 + 300 MB); output external data: "
                f"{m.detail['output_external_data']}"
            )
        targets["external data peak MB"] = {"value": m.peak_mb, "limit": large["limit_mb"]}
        m4 = next((x for x in measurements if x.tool == "epfuse-int4"), None)
        if m4 is not None and m4.ok:
            print(
                f"external data, int4: optimize+quantize {m4.seconds:.1f} s, peak "
                f"{m4.peak_mb:.0f} MB (imports {m4.base_mb:.0f} MB) for "
                f"{large['weight_bytes'] / 2**20:.0f} MB of fp32 weights"
            )
            targets["external data int4 peak MB"] = {
                "value": m4.peak_mb,
                "limit": large["limit_mb"],
            }
    print(f"\n# {_common.load_line()}")
    payload = {
        "benchmark": "optimizer",
        "quick": quick,
        "environment": _common.environment(),
        "load_before": load_before,
        "load_after": load_after,
        "repeats": repeats,
        "measurements": [asdict(m) for m in measurements],
        "targets": targets,
        "large": large,
    }
    _common.write_json(out_path, payload)
    print(f"# wrote {out_path}")
    return 0


def _print_measurement(m: Measurement) -> None:
    if m.ok:
        extra = ""
        if m.tool in ("epfuse", "epfuse-int4"):
            extra = f", {m.detail.get('fused')}/{m.detail.get('layers')} layers fused"
        print(
            f"  {m.case} [{m.tool}]: {m.nodes} nodes, {m.seconds:.2f} s, "
            f"peak {m.peak_mb:.0f} MB (imports {m.base_mb:.0f} MB){extra}; {_common.load_line()}",
            flush=True,
        )
    else:
        print(f"  {m.case} [{m.tool}]: FAILED: {m.error}; peak {m.peak_mb:.0f} MB", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
