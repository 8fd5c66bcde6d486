"""Decode at long context with an int8 KV cache (``kv_cache="int8"``) vs the fp32 cache.

A Llama-shaped decoder with random weights (epfuse's test builder, torch.onnx opset-23 form:
hidden 512, 8 heads, 2 KV heads, head_dim 64, 4 layers, intermediate 1408, vocab 1024) is
optimized for cpu twice, ``optimize(model, "cpu")`` and ``optimize(model, "cpu",
kv_cache="int8")``, and both run on ORT's CPU EP with 2 intra-op threads (default graph
optimization level) for one decode token after a past of 2048 and 4096 tokens, interleaved
round by round; cells are medians, the speedup the median of per-round ratios. KV memory is the bytes of the past inputs fed.

Accuracy at the same lengths: the past is the fp32 model's own present after a real prompt of
that length; the int8 model gets it quantized with its scales (``float_cache_boundary``),
and the decode logits are compared (max |difference|, top-1 agreement over the batch rows).

    python benchmarks/kv_cache.py            # writes benchmarks/results/kv_cache.json
    python benchmarks/kv_cache.py --quick    # tiny shapes: checks the script works
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _common  # puts the checkout on sys.path
import numpy as np

THREADS = 2


def _session(proto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), options, ["CPUExecutionProvider"])


def _feeds(session, ids, past_len, past_arrays=None):
    batch, new = ids.shape
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((batch, past_len + new), np.int64),
        "position_ids": np.tile(np.arange(past_len, past_len + new, dtype=np.int64), (batch, 1)),
    }
    rng = np.random.default_rng(1)
    for i, meta in enumerate(i for i in session.get_inputs() if "past" in i.name):
        shape = (batch, meta.shape[1], past_len, meta.shape[3])
        if past_arrays is not None:
            feeds[meta.name] = past_arrays[i]
        elif meta.type == "tensor(int8)":
            feeds[meta.name] = rng.integers(-127, 128, shape, dtype=np.int8)
        else:
            feeds[meta.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)

    import onnx_ir as ir

    import epfuse
    from epfuse.optimizer.precision.kv_cache import float_cache_boundary
    from epfuse.testing.model_builder import DecoderConfig, build_decoder

    if args.quick:
        config = DecoderConfig(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128)
        lengths, rounds = [64, 128], 3
    else:
        config = DecoderConfig(
            layers=4,
            heads=8,
            kv_heads=2,
            head_dim=64,
            intermediate=1408,
            vocab=1024,
            max_positions=4160,
        )
        lengths, rounds = [2048, 4096], args.rounds
    print(_common.load_line())
    source = build_decoder(config)
    max_len = max(lengths) + 64
    t0 = time.perf_counter()
    fp32 = epfuse.optimize(source, "cpu", max_seq_len=max_len)
    t1 = time.perf_counter()
    int8, report = epfuse.optimize_with_report(source, "cpu", max_seq_len=max_len, kv_cache="int8")
    t2 = time.perf_counter()
    sessions = {"fp32 cache": _session(fp32), "int8 cache": _session(int8)}
    # the boundary is an onnx_ir transformation; the sessions take protobuf
    boundary = _session(ir.to_proto(float_cache_boundary(ir.from_proto(int8))))
    rng = np.random.default_rng(0)
    results = []
    for past_len in lengths:
        ids = rng.integers(0, config.vocab, (1, 1), dtype=np.int64)
        feeds = {name: _feeds(s, ids, past_len) for name, s in sessions.items()}
        times = {name: [] for name in sessions}
        for _ in range(rounds):
            for name, session in sessions.items():
                session.run(None, feeds[name])  # untimed run at each switch
                start = time.perf_counter()
                session.run(None, feeds[name])
                times[name].append((time.perf_counter() - start) * 1e3)
        kv_bytes = {
            name: sum(v.nbytes for k, v in f.items() if "past" in k) for name, f in feeds.items()
        }
        # accuracy: a real past of this length from the fp32 model, then one decode step
        batch = 2
        prompt = rng.integers(0, config.vocab, (batch, past_len), dtype=np.int64)
        fp32_session = sessions["fp32 cache"]
        outs = fp32_session.run(None, _feeds(fp32_session, prompt, 0))
        names = [o.name for o in fp32_session.get_outputs()]
        presents = [o for o, n in zip(outs, names, strict=True) if "present" in n]
        step = rng.integers(0, config.vocab, (batch, 1), dtype=np.int64)
        want = fp32_session.run(["logits"], _feeds(fp32_session, step, past_len, presents))[0]
        got = boundary.run(["logits"], _feeds(boundary, step, past_len, presents))[0]
        row = {
            "past": past_len,
            "ms": {name: statistics.median(t) for name, t in times.items()},
            "kv_mib": {name: b / 2**20 for name, b in kv_bytes.items()},
            "max_abs_logits_diff": float(np.abs(got - want).max()),
            "max_abs_logits": float(np.abs(want).max()),
            "top1_agreement": float((got[:, -1].argmax(-1) == want[:, -1].argmax(-1)).mean()),
        }
        # median of per-round paired ratios: a load spike hits both runs of a round alike
        pairs = zip(times["fp32 cache"], times["int8 cache"], strict=True)
        row["speedup"] = statistics.median(a / b for a, b in pairs)
        results.append(row)
        print(json.dumps(row))
    data = {
        "config": {
            k: getattr(config, k)
            for k in ("layers", "heads", "kv_heads", "head_dim", "vocab", "intermediate")
        },
        "threads": THREADS,
        "rounds": rounds,
        "optimize_s": {"fp32 cache": t1 - t0, "int8 cache (with calibration)": t2 - t1},
        "kv_cache": report.precision["kv_cache"],
        "results": results,
    }
    data["environment"] = _common.environment()
    data["load_after"] = _common.load()
    if not args.quick:
        print(f"wrote {_common.write_json(_common.RESULTS / 'kv_cache.json', data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
