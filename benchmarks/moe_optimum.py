"""What lifting Optimum's experts buys on the CPU EP: the experts as Optimum exports them vs
com.microsoft::MoE, and vs what an EP without MoE gets (the loop over the experts).

Hugging Face Optimum (optimum-onnx 0.1.0, transformers 4.57, TorchScript, opset 18) exports a
small Qwen3-MoE (its sparse block a traced loop over every expert) and a small GPT-OSS (every
expert on every token, times the dense top-k routing matrix) with random weights: hidden 256,
expert intermediate 512, 8 experts, top 2, 4 layers, 8 query / 2 KV heads, vocab 1024. Three
candidates, all ``epfuse.optimize`` of the same export with the same attention fusion:

- ``exported``: the two expert lifts left out of the rule set (the experts as exported);
- ``batched``: the cpu record with ``moe=False`` and without ``legalize-experts-to-loop``: the
  lifted canonical form itself (what dynamo's exports are), one weight matrix gathered per
  (token, slot);
- ``loop``: the cpu record with the loop preferred at any size
  (``experts_loop_min_decode_weights=0``): lifted, then the loop over the experts in standard
  ops (what cpu float32 gets for real GPT-OSS blocks, and what an EP without MoE gets);
- ``MoE``: the cpu record (these tiny experts are below its threshold for the loop): lifted,
  then ``com.microsoft::MoE``.

ORT CPU EP, 2 intra-op threads, batch 1; candidates interleaved round by round, an untimed
run at each switch, medians. Logits are compared (a fast wrong model is not a result). Needs
the Optimum environment:

    PYTHONPATH=. /work/venv-optimum/bin/python benchmarks/moe_optimum.py
    ... --cpu-time   # 1 thread, process CPU time per run (a loaded machine's measure)
    ... --quick      # 2 layers, short shapes: checks the script works
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
FULL = (("prefill 128", 0, 128), ("decode past 256", 256, 1))
QUICK = (("prefill 16", 0, 16), ("decode past 32", 32, 1))
LIFTS = ("expert-loop-to-batched", "dense-experts-to-batched")
LOOP = "legalize-experts-to-loop"


def config(family: str, quick: bool):
    dims = dict(
        vocab_size=1024,
        hidden_size=128 if quick else 256,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16 if quick else 32,
        max_position_embeddings=2048,
        num_experts_per_tok=2,
    )
    if family == "qwen3-moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **dims,
            intermediate_size=512,
            moe_intermediate_size=256 if quick else 512,
            num_experts=8,
            norm_topk_prob=False,
        )
    from transformers import GptOssConfig

    return GptOssConfig(
        **dims,
        intermediate_size=256 if quick else 512,
        num_local_experts=8,
        sliding_window=128,
        layer_types=(["sliding_attention", "full_attention"] * 4)[: dims["num_hidden_layers"]],
    )


def session(path: Path, cpu_time: bool):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1 if cpu_time else THREADS
    options.inter_op_num_threads = 1
    if cpu_time:  # a spinning thread's wait would count as work
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds(sess, past: int, seq: int, kv_heads: int, head_dim: int) -> dict:
    rng = np.random.default_rng(0)
    names = {i.name for i in sess.get_inputs()}
    out = {
        "input_ids": rng.integers(0, 1024, (1, seq), dtype=np.int64),
        "attention_mask": np.ones((1, past + seq), np.int64),
    }
    if "position_ids" in names:
        out["position_ids"] = np.arange(past, past + seq, dtype=np.int64)[None]
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            out[i.name] = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
    return out


def measure(
    family: str,
    quick: bool,
    rounds: int,
    folder: Path,
    only: list[str] | None = None,
    cpu_time: bool = False,
) -> dict:
    import onnx

    import epfuse
    from epfuse.capabilities import get_ep
    from epfuse.patterns import RULES
    from epfuse.testing.optimum_export import export_optimum_decoder

    cfg = config(family, quick)
    out = folder / family
    export = out / "model.onnx"
    if not export.exists():
        export_optimum_decoder(cfg, out)
    cpu = get_ep("cpu")
    no_moe = cpu.variant("cpu-no-moe", moe=False)
    runs = {
        "exported": (cpu, tuple(r for r in RULES if r.name not in LIFTS)),
        "batched": (no_moe, tuple(r for r in RULES if r.name != LOOP)),
        "loop": (cpu.variant("cpu-loop", experts_loop_min_decode_weights=0), RULES),
        "MoE": (cpu, RULES),
    }
    original = onnx.load(str(export))
    paths = {}
    for name, (record, rules) in runs.items():
        model, report = epfuse.optimize_with_report(original, record, rules=rules)
        paths[name] = out / f"{name}.onnx"
        onnx.save(model, str(paths[name]))
        ops = [n.op_type for n in model.graph.node]
        print(
            f"{family} {name}: {len(ops)} nodes, {ops.count('MoE')} MoE, "
            f"{ops.count('NonZero')} NonZero, {ops.count('GatherND')} GatherND; "
            f"{report.fused_layers}/{len(report.layers)} attention layers fused"
        )
    sessions = {name: session(path, cpu_time) for name, path in paths.items()}
    clock = time.process_time if cpu_time else time.perf_counter
    results = {}
    for label, past, seq in QUICK if quick else FULL:
        if only and label not in only:
            continue
        first = next(iter(sessions.values()))
        data = feeds(first, past, seq, cfg.num_key_value_heads, cfg.head_dim)
        logits = {n: s.run(["logits"], data)[0] for n, s in sessions.items()}
        diffs = {n: float(np.abs(v - logits["exported"]).max()) for n, v in logits.items()}
        assert max(diffs.values()) < LOGIT_ATOL, f"{family} {label}: logits differ: {diffs}"
        times: dict[str, list[float]] = {n: [] for n in sessions}
        for _ in range(rounds):
            for name, sess in sessions.items():
                sess.run(["logits"], data)  # untimed run at the switch
                start = clock()
                sess.run(["logits"], data)
                times[name].append(1e3 * (clock() - start))
        medians = {n: round(statistics.median(t), 3) for n, t in times.items()}
        results[label] = {
            **{f"{n}_ms": v for n, v in medians.items()},
            **{
                f"{n}_speedup": round(
                    statistics.median(
                        [a / b for a, b in zip(times["exported"], times[n], strict=True)]
                    ),
                    3,
                )
                for n in ("batched", "loop", "MoE")
            },
            "max_abs_logit_diff": max(diffs.values()),
        }
        print(f"  {family} {label}: done; {_common.load_line()}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--family", choices=("qwen3-moe", "gpt-oss"), action="append")
    parser.add_argument("--scenario", action="append", help="only these scenarios (labels)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="1 thread, no spinning, the process's CPU time per run (what a loaded machine "
        "can still measure: wall time there is mostly other processes' turns)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 10)
    folder = _common.cache_dir(args.cache) / ("moe-optimum-quick" if args.quick else "moe-optimum")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"# Optimum experts benchmark; {_common.load_line()}")
    load_before = _common.load()
    families = args.family or LIFT_FAMILIES
    results = {
        f: measure(f, args.quick, rounds, folder, args.scenario, args.cpu_time) for f in families
    }
    rows = [
        [
            family,
            label,
            *(f"{r[f'{n}_ms']:.2f}" for n in ("exported", "batched", "loop", "MoE")),
            *(f"{r[f'{n}_speedup']:.2f}x" for n in ("batched", "loop", "MoE")),
        ]
        for family, by_label in results.items()
        for label, r in by_label.items()
    ]
    headers = ["family", "scenario", *(f"{n} (ms)" for n in ("exported", "batched", "loop", "MoE"))]
    headers += ["batched speedup", "loop speedup", "MoE speedup"]
    print(_common.table(headers, rows))
    payload = {
        "environment": _common.environment(),
        "load_before": load_before,
        "load_after": _common.load(),
        "threads": 1 if args.cpu_time else THREADS,
        "clock": "process CPU time" if args.cpu_time else "wall",
        "rounds": rounds,
        "results": results,
    }
    name = "moe-optimum-quick.json" if args.quick else "moe-optimum.json"
    if args.cpu_time:
        name = name.replace(".json", "-cpu-time.json")
    if args.scenario:
        name = name.replace(
            ".json", "-" + "-".join(x.replace(" ", "") for x in args.scenario) + ".json"
        )
    print(f"wrote {_common.write_json(_common.RESULTS / name, payload)}")
    return 0


LIFT_FAMILIES = ("qwen3-moe", "gpt-oss")

if __name__ == "__main__":
    sys.exit(main())
