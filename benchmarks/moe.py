"""How much com.microsoft::MoE saves over the exported experts, on the CPU EP.

A small Mixtral with random weights (hidden 256, intermediate 512, 8 experts, top 2, 4 layers,
8 query / 2 KV heads, vocab 1024) is exported with torch.onnx at opset 23 (transformers'
``batched_mm`` experts, the implementation torch.onnx can export). Both candidates are
``epfuse.optimize(export, ...)`` with the same attention fusion (GroupQueryAttention); they
differ only in the experts:

- ``unfused experts``: the cpu record with ``moe=False`` (the experts stay as exported:
  GatherND of each token's expert weights, batched MatMuls, SwiGLU, weighted sum);
- ``MoE``: the cpu record (experts -> ``com.microsoft::MoE``).

ORT CPU EP, 2 intra-op threads, batch 1, default optimization level; candidates interleaved
round by round, one untimed run at each switch; medians of the per-round times. Logits of the
two are compared (a fast wrong model is not a result).

    python benchmarks/moe.py            # writes benchmarks/results/moe.json
    python benchmarks/moe.py --quick    # 2 layers, short shapes: checks the script works
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import _common  # puts the checkout on sys.path
import numpy as np

THREADS = 2
LOGIT_ATOL = 1e-3
FULL = (("prefill 128", 0, 128), ("decode past 256", 256, 1), ("decode past 1024", 1024, 1))
QUICK = (("prefill 16", 0, 16), ("decode past 32", 32, 1))


def config(quick: bool):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=1024,
        hidden_size=128 if quick else 256,
        intermediate_size=256 if quick else 512,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16 if quick else 32,
        max_position_embeddings=2048,
        num_local_experts=8,
        num_experts_per_tok=2,
        experts_implementation="batched_mm",
    )


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds(sess, past: int, seq: int, kv_heads: int, head_dim: int) -> dict:
    rng = np.random.default_rng(0)
    out = {
        "input_ids": rng.integers(0, 1024, (1, seq), dtype=np.int64),
        "attention_mask": np.ones((1, past + seq), np.int64),
        "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
    }
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            out[i.name] = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--cache", default=None)
    args = parser.parse_args(argv)

    import onnx

    import epfuse
    from epfuse.capabilities import get_ep
    from epfuse.patterns import RULES
    from epfuse.testing.hf_export import export_hf_decoder

    cfg = config(args.quick)
    rounds = args.rounds or (3 if args.quick else 12)
    folder = _common.cache_dir(args.cache) / ("moe-quick" if args.quick else "moe")
    folder.mkdir(parents=True, exist_ok=True)
    export = folder / "mixtral-opset23.onnx"
    if not export.exists():
        export_hf_decoder(cfg, export, opset=23)
    cpu = get_ep("cpu")
    no_moe = dataclasses.replace(
        cpu,
        name="cpu-no-moe",
        dtypes={d: dataclasses.replace(ops, moe=False) for d, ops in cpu.dtypes.items()},
    )
    paths = {"unfused experts": folder / "unfused.onnx", "MoE": folder / "moe.onnx"}
    original = onnx.load(str(export))
    # The exported experts: no MoE, and not the loop an EP without MoE gets either.
    exported = tuple(r for r in RULES if r.name != "legalize-experts-to-loop")
    for (name, path), record in zip(paths.items(), (no_moe, cpu), strict=True):
        model, report = epfuse.optimize_with_report(original, record, rules=exported)
        assert report.fused_layers == len(report.layers), report.summary()
        onnx.save(model, str(path))
        count = sum(n.op_type == "MoE" for n in model.graph.node)
        print(f"{name}: {len(model.graph.node)} nodes, {count} MoE")
    sessions = {name: session(path) for name, path in paths.items()}
    print(f"# MoE benchmark ({'quick' if args.quick else 'full'}); {_common.load_line()}")
    load_before = _common.load()
    results = {}
    for label, past, seq in QUICK if args.quick else FULL:
        first = next(iter(sessions.values()))
        data = feeds(first, past, seq, cfg.num_key_value_heads, cfg.head_dim)
        logits = {n: s.run(["logits"], data)[0] for n, s in sessions.items()}
        diff = float(np.abs(logits["MoE"] - logits["unfused experts"]).max())
        assert diff < LOGIT_ATOL, f"{label}: logits differ by {diff}"
        times: dict[str, list[float]] = {n: [] for n in sessions}
        for _ in range(rounds):
            for name, sess in sessions.items():
                sess.run(["logits"], data)  # untimed run at the switch
                start = time.perf_counter()
                sess.run(["logits"], data)
                times[name].append(1e3 * (time.perf_counter() - start))
        ratios = [a / b for a, b in zip(times["unfused experts"], times["MoE"], strict=True)]
        results[label] = {
            "unfused_ms": round(statistics.median(times["unfused experts"]), 3),
            "moe_ms": round(statistics.median(times["MoE"]), 3),
            "speedup": round(statistics.median(ratios), 3),
            "max_abs_logit_diff": diff,
        }
        print(f"  {label}: done; {_common.load_line()}")
    rows = [
        [label, f"{r['unfused_ms']:.2f}", f"{r['moe_ms']:.2f}", f"{r['speedup']:.2f}x"]
        for label, r in results.items()
    ]
    print(_common.table(["scenario", "unfused experts (ms)", "MoE (ms)", "speedup"], rows))
    payload = {
        "environment": _common.environment(),
        "load_before": load_before,
        "load_after": _common.load(),
        "threads": THREADS,
        "rounds": rounds,
        "model": {
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_local_experts",
                "num_experts_per_tok",
            )
        },
        "results": results,
    }
    name = "moe-quick.json" if args.quick else "moe.json"
    print(f"wrote {_common.write_json(_common.RESULTS / name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
