"""ORT CPU's com.microsoft::MoE against the loop over the experts, one experts block alone, at
the expert shapes of real MoE models: the measurement behind the cpu record's
``experts_loop_min_decode_weights`` (float32).

Each shape builds the two forms ``epfuse`` emits for one batched experts region, from the same
random weights (scaled by 1/sqrt(fan-in)): ``MoE`` (``experts-to-moe``'s node: interleaved
SwiGLU, router softmax, top k, renormalized) and ``loop`` (``legalize-experts-to-loop``'s
per-expert ``NonZero`` / ``Gather`` / MLP / ``ScatterND`` add, fed by a Softmax / TopK /
renormalize router in standard ops). Both are run on the same tokens and router logits at
1 token (decode) up to 256 tokens (prefill), ORT CPU EP, 2 intra-op threads: the mean over
five router draws of each draw's median; their outputs are compared (a fast wrong block is not
a result).

Shapes: a tiny block (what the test families use), a Mixtral-like block (few wide experts),
Qwen3-30B-A3B's expert count (128 experts, top 8) at half its width, its width (2048 / 768)
with 64 experts, the whole Qwen3-30B-A3B block (2.4 GB of float32 weights, saved as external
data) and a GPT-OSS-like block (biases, clamped SwiGLU).

    python benchmarks/moe_shapes.py            # writes benchmarks/results/moe-shapes.json
    python benchmarks/moe_shapes.py --quick    # the tiny block only
    python benchmarks/moe_shapes.py --float16  # float16 (the loop cannot run on CPU there)
    python benchmarks/moe_shapes.py --only Qwen3  # a subset (writes moe-shapes-only.json)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common  # puts the checkout on sys.path
import numpy as np

THREADS = 2
TOKENS = (1, 4, 16, 64, 256)
# Router draws per token count, times averaged: which experts a token picks moves MoE's time by
# up to 1.5x at decode (the kernel splits the experts, not the work, across its threads).
DRAWS = 5
# name: (hidden, expert intermediate, experts, top k, biases and clamped SwiGLU)
SHAPES = {
    "tiny (256 / 512, 8 experts, top 2)": (256, 512, 8, 2, False),
    "tiny GPT-OSS-like (256 / 512, 8 experts, top 2, clamped)": (256, 512, 8, 2, True),
    "Mixtral-like (1024 / 3584, 8 experts, top 2)": (1024, 3584, 8, 2, False),
    "Qwen3-30B-A3B experts (1024 / 384, 128 experts, top 8)": (1024, 384, 128, 8, False),
    "Qwen3-30B-A3B width (2048 / 768, 64 experts, top 8)": (2048, 768, 64, 8, False),
    "Qwen3-30B-A3B width (2048 / 768, 96 experts, top 8)": (2048, 768, 96, 8, False),
    "Qwen3-30B-A3B (2048 / 768, 128 experts, top 8)": (2048, 768, 128, 8, False),
    "GPT-OSS-like (1440 / 1440, 32 experts, top 4, clamped)": (1440, 1440, 32, 4, True),
}


def experts_record(shape, dtype):
    """The rules' own description of a batched experts region (``lower.moe._Experts``)."""
    import onnx_ir as ir

    from epfuse.patterns.lower import moe

    hidden, inter, experts, k, gpt_oss = shape
    rng = np.random.default_rng(0)
    f32 = np.float32  # drawn in float32: the largest block's float64 draw would need 5 GB
    w1 = rng.standard_normal((experts, 2 * inter, hidden), f32) / f32(np.sqrt(hidden))
    w2 = rng.standard_normal((experts, hidden, inter), f32) / f32(np.sqrt(inter))
    b1 = f32(0.1) * rng.standard_normal((experts, 2 * inter), f32) if gpt_oss else None
    b2 = f32(0.1) * rng.standard_normal((experts, hidden), f32) if gpt_oss else None
    elem = ir.DataType.FLOAT16 if dtype == np.float16 else ir.DataType.FLOAT

    def value(name, dims=None):
        return ir.Value(name=name, type=ir.TensorType(elem), shape=dims and ir.Shape(dims))

    tokens, logits, weights = value("x", ["T", hidden]), value("r", ["T", experts]), value("w")
    index = ir.Value(name="index", type=ir.TensorType(ir.DataType.INT64))

    def cast(a):
        return None if a is None else a.astype(dtype)

    fc1 = moe._Linear(tokens, cast(w1), cast(b1), index, [])
    fc2 = moe._Linear(tokens, cast(w2), cast(b2), index, [])
    halves = np.arange(inter)
    gate, up = (2 * halves, 2 * halves + 1) if gpt_oss else (halves, inter + halves)
    return moe._Experts(
        tokens,
        logits,
        k,
        fc1,
        fc2,
        gate,
        up,
        alpha=1.702 if gpt_oss else 1.0,
        beta=1.0 if gpt_oss else 0.0,
        limit=7.0 if gpt_oss else None,
        weights=weights,
    )


def _session(graph, opsets):
    """A CPU session of ``graph``, saved with its weights as external data (a whole
    Qwen3-30B-A3B block is past protobuf's 2 GB)."""
    import tempfile
    from pathlib import Path

    import onnx_ir as ir
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    graph.opset_imports.update(opsets)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{graph.name}.onnx"
        ir.save(ir.Model(graph, ir_version=10), path, external_data=f"{graph.name}.data")
        # ORT reads external data at session creation, so the folder may go afterwards.
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def sessions(e):
    """(MoE, loop) sessions, both reading (x, router logits r)."""
    import onnx_ir as ir

    from epfuse.patterns._graph import Builder
    from epfuse.patterns.lower import moe

    def block(name, body):
        x = ir.Value(name="x", type=e.tokens.type, shape=e.tokens.shape)
        r = ir.Value(name="r", type=e.logits.type, shape=e.logits.shape)
        graph = ir.Graph([x, r], [], nodes=[], name=name)
        builder = Builder(graph, None, name)
        y = body(builder, x, r)
        graph.extend(builder.nodes)
        y.type = e.tokens.type
        graph.outputs.append(y)
        return graph

    def fused(b, x, r):
        fc1, b1, fc2, b2 = moe._moe_arrays(e, False, e.fc1.weight.dtype)
        inputs = [x, r, b.const("fc1", fc1), None, b.const("fc2", fc2)]
        if b1 is not None:
            inputs[3:] = [b.const("b1", b1), inputs[4], b.const("b2", b2)]
        attrs = moe._moe_attributes(e, 1)
        return b.op("MoE", inputs, attrs, domain="com.microsoft")

    def loop(b, x, r):
        probs = b.op("Softmax", [r], {"axis": -1})
        k = b.const("k", np.array([e.k], np.int64))
        top, index = b.op("TopK", [probs, k], {"axis": -1}, num_outputs=2)
        total = b.op("ReduceSum", [top, b.const("last", np.array([-1], np.int64))])
        return moe._emit_loop(b, e, x, index, b.op("Div", [top, total]))

    both = {"": 18, "com.microsoft": 1}
    return _session(block("moe", fused), both), _session(block("loop", loop), {"": 18})


def median_ms(session, feeds, rounds):
    session.run(None, feeds)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--float16", action="store_true")
    parser.add_argument("--only", help="run the shapes whose name contains this text")
    args = parser.parse_args(argv)
    dtype = np.float16 if args.float16 else np.float32
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    if args.only:
        shapes = {name: shape for name, shape in shapes.items() if args.only in name}
    print(f"# experts block: MoE vs loop; {_common.load_line()}")
    load_before = _common.load()
    results, rows = {}, []
    for name, shape in shapes.items():
        e = experts_record(shape, dtype)
        moe_session, loop_session = sessions(e)
        rng = np.random.default_rng(1)
        results[name] = {}
        for tokens in (1, 4) if args.quick else TOKENS:
            draws = [
                {
                    "x": rng.standard_normal((tokens, shape[0])).astype(dtype),
                    "r": rng.standard_normal((tokens, shape[2])).astype(dtype),
                }
                for _ in range(DRAWS)
            ]
            try:
                diff = max(
                    float(
                        np.abs(
                            moe_session.run(None, feeds)[0].astype(np.float32)
                            - loop_session.run(None, feeds)[0].astype(np.float32)
                        ).max()
                    )
                    for feeds in draws
                )
            except Exception as err:  # float16: no ScatterND add on CPU
                results[name][tokens] = {"loop_error": str(err).splitlines()[0][:200]}
                rows.append([name, str(tokens), "-", "loop cannot run", "-"])
                continue
            assert diff < 1e-2, f"{name} at {tokens} tokens: MoE and loop differ by {diff}"
            rounds = 8 if tokens < 64 else 3
            moe_ms = statistics.mean(median_ms(moe_session, f, rounds) for f in draws)
            loop_ms = statistics.mean(median_ms(loop_session, f, rounds) for f in draws)
            results[name][tokens] = {
                "moe_ms": round(moe_ms, 3),
                "loop_ms": round(loop_ms, 3),
                "loop_speedup": round(moe_ms / loop_ms, 3),
                "max_abs_diff": diff,
            }
            rows.append(
                [name, str(tokens), f"{moe_ms:.3f}", f"{loop_ms:.3f}", f"{moe_ms / loop_ms:.2f}x"]
            )
            print(f"  {name}, {tokens} tokens: done", flush=True)
        del moe_session, loop_session, e
    print(_common.table(["experts block", "tokens", "MoE (ms)", "loop (ms)", "loop speedup"], rows))
    payload = {
        "environment": _common.environment(),
        "load_before": load_before,
        "load_after": _common.load(),
        "threads": THREADS,
        "dtype": np.dtype(dtype).name,
        "results": results,
    }
    name = "moe-shapes" + ("-quick" if args.quick else "") + ("-float16" if args.float16 else "")
    name += "-only" if args.only else ""
    print(f"wrote {_common.write_json(_common.RESULTS / (name + '.json'), payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
