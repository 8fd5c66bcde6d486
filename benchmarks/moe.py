"""How much com.microsoft::MoE saves over the exported experts, on the CPU EP.

A small Mixtral with random weights (hidden 256, intermediate 512, 8 experts, top 2, 4 layers,
8 query / 2 KV heads, vocab 1024) is exported with torch.onnx at opset 23 (transformers'
``batched_mm`` experts, the implementation torch.onnx can export). The candidates are
``epfuse.optimize(export, ...)`` with the same attention fusion (GroupQueryAttention); they
differ only in the experts:

- ``exported``: the cpu record with ``moe=False`` and without ``legalize-experts-to-loop``
  (GatherND of each token's expert weights, batched MatMuls, SwiGLU, weighted sum);
- ``loop``: the cpu record with the loop preferred at any size
  (``experts_loop_min_decode_weights=0``: the loop over the experts in standard ops, what
  cpu float32 emits for real Mixtral blocks);
- ``MoE``: the cpu record (these tiny experts are below its threshold for the loop:
  ``com.microsoft::MoE``).

ORT CPU EP, 2 intra-op threads, batch 1, default optimization level; candidates interleaved
round by round, one untimed run at each switch; medians of the per-round times. Logits of the
candidates are compared (a fast wrong model is not a result).

    python benchmarks/moe.py            # writes benchmarks/results/moe.json
    python benchmarks/moe.py --quick    # 2 layers, short shapes: checks the script works
"""

from __future__ import annotations

import argparse
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
    no_moe = cpu.variant("cpu-no-moe", moe=False)
    candidates = {  # name: (record, rules)
        # The exported experts: no MoE, and not the loop an EP without MoE gets either.
        "exported": (no_moe, tuple(r for r in RULES if r.name != "legalize-experts-to-loop")),
        "loop": (cpu.variant("cpu-loop", experts_loop_min_decode_weights=0), RULES),
        "MoE": (cpu, RULES),
    }
    paths = {name: folder / f"{name}.onnx" for name in candidates}
    original = onnx.load(str(export))
    for name, (record, rules) in candidates.items():
        model, report = epfuse.optimize_with_report(original, record, rules=rules)
        assert report.fused_layers == len(report.layers), report.summary()
        onnx.save(model, str(paths[name]))
        ops = [n.op_type for n in model.graph.node]
        print(f"{name}: {len(ops)} nodes, {ops.count('MoE')} MoE, {ops.count('NonZero')} NonZero")
    sessions = {name: session(path) for name, path in paths.items()}
    print(f"# MoE benchmark ({'quick' if args.quick else 'full'}); {_common.load_line()}")
    load_before = _common.load()
    results = {}
    for label, past, seq in QUICK if args.quick else FULL:
        first = next(iter(sessions.values()))
        data = feeds(first, past, seq, cfg.num_key_value_heads, cfg.head_dim)
        logits = {n: s.run(["logits"], data)[0] for n, s in sessions.items()}
        diffs = {n: float(np.abs(v - logits["exported"]).max()) for n, v in logits.items()}
        assert max(diffs.values()) < LOGIT_ATOL, f"{label}: logits differ: {diffs}"
        times: dict[str, list[float]] = {n: [] for n in sessions}
        for _ in range(rounds):
            for name, sess in sessions.items():
                sess.run(["logits"], data)  # untimed run at the switch
                start = time.perf_counter()
                sess.run(["logits"], data)
                times[name].append(1e3 * (time.perf_counter() - start))
        results[label] = {f"{n}_ms": round(statistics.median(t), 3) for n, t in times.items()}
        for n in ("loop", "MoE"):
            ratios = [a / b for a, b in zip(times["exported"], times[n], strict=True)]
            results[label][f"{n}_speedup"] = round(statistics.median(ratios), 3)
        results[label]["max_abs_logit_diff"] = max(diffs.values())
        print(f"  {label}: done; {_common.load_line()}")
    rows = [
        [
            label,
            *(f"{r[f'{n}_ms']:.2f}" for n in candidates),
            f"{r['loop_speedup']:.2f}x",
            f"{r['MoE_speedup']:.2f}x",
        ]
        for label, r in results.items()
    ]
    headers = ["scenario", *(f"{n} (ms)" for n in candidates), "loop speedup", "MoE speedup"]
    print(_common.table(headers, rows))
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
