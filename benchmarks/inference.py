"""Inference speed of the epfuse-optimized graph, side by side with what it competes with.

A Llama-shaped decoder with random weights (hidden 512, 8 heads, 2 KV heads, 4 layers, vocab
1024, 4096 positions) is exported with torch.onnx at opset 18 and 23, each export is optimized
with ``epfuse.optimize(path, "cpu")``, and -- when onnxruntime-genai is installed -- its model
builder makes a model from the same weights (``-p fp32 -e cpu``). Every candidate runs in
ONNX Runtime's Python API on the CPU EP with 2 intra-op threads (default graph optimization
level, as a user would run it), fed identical inputs, for:

- ``prefill 256``: a 256-token prompt, no past
- ``decode past 512`` / ``decode past 2048``: one new token after a KV cache of that length
- ``chunk 64 @ 1024``: a 64-token chunk after a past of 1024 (chunked prefill)

The candidates are interleaved round by round (so a load spike on the shared machine hits all
of them alike), with one untimed run at each switch; each cell is the median over all timed
runs. Logits of every candidate are
compared to the original export's on each scenario (a fast wrong model is not a result).

    python benchmarks/inference.py            # full run, writes benchmarks/results/inference.json
    python benchmarks/inference.py --quick    # tiny model and shapes: checks the script works
    python benchmarks/inference.py --profile "decode past 2048"   # ORT per-op profile as well
    python benchmarks/inference.py --precision int4   # the int4 table (inference-int4.json)

``--precision int4`` compares int4-weight models made from the same fp32 weights: epfuse's
``optimize(export, "cpu", precision="int4")``, the genai builder's ``-p int4 -e cpu``, and the
unfused export quantized the same way (epfuse's ``quantize_int4``: onnxruntime's
MatMulNBitsQuantizer, block 32, symmetric, accuracy level 4). Their logits are compared with
the quantized opset-23 export's, with a looser bound (``INT4_LOGIT_ATOL``): int4 models of
the same weights agree only as closely as their int8 activation rounding does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _common  # puts the checkout on sys.path
import numpy as np

SEED = 0
THREADS = 2
# fp32 logits of the same weights agree far closer than this; more means another function.
LOGIT_ATOL = 1e-3
# int4 models of the same weights and quantizer: identical int4 numbers, but MatMulNBits at
# accuracy level 4 rounds activations to int8 per block, so ulp-level differences upstream
# (fused vs unfused norms) can flip one rounding step. A wrong model is off by >> 1.
INT4_LOGIT_ATOL = 0.25


@dataclass(frozen=True)
class Scenario:
    name: str
    past: int
    seq: int


FULL_SCENARIOS = (
    Scenario("prefill 256", 0, 256),
    Scenario("decode past 512", 512, 1),
    Scenario("decode past 2048", 2048, 1),
    Scenario("chunk 64 @ 1024", 1024, 64),
)
QUICK_SCENARIOS = (
    Scenario("prefill 32", 0, 32),
    Scenario("decode past 64", 64, 1),
    Scenario("decode past 256", 256, 1),
    Scenario("chunk 16 @ 128", 128, 16),
)


def model_config(quick: bool):
    from transformers import LlamaConfig

    if quick:
        return LlamaConfig(
            vocab_size=256,
            # Not 256: the genai builder takes any Linear with vocab_size outputs for lm_head.
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=1024,
            rope_theta=10000.0,
        )
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    )


def config_key(config) -> str:
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    name: str
    path: Path
    build_seconds: float | None = None
    note: str = ""


def export_cached(config, opset: int, folder: Path) -> tuple[Path, float | None]:
    from epfuse.testing.hf_export import export_hf_decoder

    path = folder / f"export-opset{opset}.onnx"
    if path.exists():
        return path, None
    start = time.perf_counter()
    tmp = folder / f".tmp-export-opset{opset}.onnx"
    export_hf_decoder(config, tmp, opset=opset, seed=SEED)
    os.replace(tmp, path)
    return path, time.perf_counter() - start


def optimize_to(src: Path, dst: Path, precision: str = "auto") -> tuple[float, str]:
    """Optimize ``src`` for the CPU EP (always re-run: this is the code under test)."""
    import epfuse
    from epfuse.optimizer.io import save_model

    start = time.perf_counter()
    model, report = epfuse.optimize_with_report(str(src), "cpu", precision=precision)
    seconds = time.perf_counter() - start
    save_model(model, dst)
    fused = sum(1 for layer in report.layers if layer.fused)
    reasons = sorted({r for layer in report.layers for r in layer.reasons})
    note = f"{fused}/{len(report.layers)} layers fused"
    if reasons and fused < len(report.layers):
        note += f" (kept: {reasons[0][:120]})"
    return seconds, note


def quantize_export(src: Path, dst: Path) -> tuple[float, str]:
    """The unfused export with int4 weights: the same quantizer and options as epfuse's."""
    from epfuse.optimizer.io import load_model, save_model
    from epfuse.optimizer.precision import Int4Options
    from epfuse.optimizer.precision.int4 import quantize_int4

    start = time.perf_counter()
    model = load_model(src)
    summary = quantize_int4(model, Int4Options())
    seconds = time.perf_counter() - start
    save_model(model, dst)
    return seconds, f"{summary.matmuls} MatMuls quantized, no fusion"


def genai_available() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def save_hf_model(config, folder: Path) -> Path:
    """The same seeded random-weight model the exports come from, with a tiny tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from epfuse.testing.hf_export import hf_model

    hf_dir = folder / "hf"
    if (hf_dir / "config.json").exists():
        return hf_dir
    tmp = folder / ".tmp-hf"
    shutil.rmtree(tmp, ignore_errors=True)
    model = hf_model(config, SEED)
    model.save_pretrained(tmp)
    vocab = {f"t{i}": i for i in range(int(config.vocab_size))}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(tmp)
    os.replace(tmp, hf_dir)
    return hf_dir


def build_genai(config, folder: Path, precision: str = "fp32") -> tuple[Path, float | None]:
    out = folder / f"genai-{precision}-cpu"
    model = out / "model.onnx"
    if model.exists():
        return model, None
    hf_dir = save_hf_model(config, folder)
    tmp = folder / ".tmp-genai"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(tmp),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(folder / "genai-cache"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (tmp / "model.onnx").exists():
        raise RuntimeError(
            "onnxruntime-genai builder failed:\n" + (proc.stdout + proc.stderr)[-4000:]
        )
    os.replace(tmp, out)
    return model, time.perf_counter() - start


# ----------------------------------------------------------------------------- running


def make_session(path: Path, profile_prefix: str | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@dataclass
class ScenarioData:
    """One set of inputs shared by every candidate (mapped onto each one's input names)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    past: list[np.ndarray]


def scenario_data(config, scenario: Scenario) -> ScenarioData:
    rng = np.random.default_rng(1234 + scenario.past * 7 + scenario.seq)
    layers = int(config.num_hidden_layers)
    kv = int(config.num_key_value_heads)
    head = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    total = scenario.past + scenario.seq
    return ScenarioData(
        input_ids=rng.integers(0, int(config.vocab_size), (1, scenario.seq), dtype=np.int64),
        attention_mask=np.ones((1, total), dtype=np.int64),
        position_ids=np.arange(scenario.past, total, dtype=np.int64)[None, :],
        past=[
            rng.standard_normal((1, kv, scenario.past, head)).astype(np.float32)
            for _ in range(2 * layers)
        ],
    )


def feeds_for(session, data: ScenarioData) -> dict[str, np.ndarray]:
    """Map the shared inputs onto a session's inputs (all candidates share the I/O contract)."""
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        name = inp.name
        if name == "input_ids":
            feeds[name] = data.input_ids
        elif name == "attention_mask":
            feeds[name] = data.attention_mask
        elif name == "position_ids":
            feeds[name] = data.position_ids
        elif name.startswith("past_key_values."):
            _, layer, kind = name.split(".")
            feeds[name] = data.past[2 * int(layer) + (0 if kind == "key" else 1)]
        else:
            raise ValueError(f"unexpected input {name!r} {inp.shape} {inp.type}")
        if "int32" in inp.type and feeds[name].dtype == np.int64:
            feeds[name] = feeds[name].astype(np.int32)
    return feeds


def time_interleaved(
    sessions: dict[str, object],
    feeds: dict[str, dict],
    rounds: int,
    per_round: int,
    warmup: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(per-run ms, per-round median ms); candidates alternate every round, rotating order."""
    names = list(sessions)
    for name in names:
        for _ in range(warmup):
            sessions[name].run(["logits"], feeds[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    per_round_median: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            sess, f = sessions[name], feeds[name]
            # One untimed run first: the previous candidate's ORT threads may still be
            # spinning (allow_spinning) and would slow this candidate's first run.
            sess.run(None, f)
            this_round = []
            for _ in range(per_round):
                start = time.perf_counter_ns()
                sess.run(None, f)
                this_round.append((time.perf_counter_ns() - start) / 1e6)
            times[name].extend(this_round)
            per_round_median[name].append(statistics.median(this_round))
    return times, per_round_median


def profile_ops(path: Path, feeds: dict, runs: int) -> list[tuple[str, float, int]]:
    """ORT profile: (op type, ms per run, node count) sorted by time, for one candidate."""
    with tempfile.TemporaryDirectory(prefix="epfuse-prof-") as tmp:
        sess = make_session(path, profile_prefix=str(Path(tmp) / "prof"))
        for _ in range(runs + 1):
            sess.run(None, feeds)
        trace = sess.end_profiling()
        events = json.loads(Path(trace).read_text())
    # Drop the first run (allocations, kernel selection): keep events after its end.
    runs_ev = sorted(
        (ev for ev in events if ev.get("cat") == "Session" and ev.get("name") == "model_run"),
        key=lambda ev: ev["ts"],
    )
    first_end = runs_ev[0]["ts"] + runs_ev[0]["dur"] if runs_ev else 0
    per_op: dict[str, list[float]] = {}
    nodes: dict[str, set[str]] = {}
    for ev in events:
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        if ev["ts"] < first_end:
            continue
        op = ev["args"].get("op_name", "?")
        per_op.setdefault(op, []).append(ev["dur"] / 1000.0)
        nodes.setdefault(op, set()).add(ev["name"])
    total_runs = runs
    rows = [(op, sum(d) / total_runs, len(nodes[op])) for op, d in per_op.items()]
    return sorted(rows, key=lambda r: -r[1])


def graph_summary(path: Path) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return {
        "nodes": len(model.graph.node),
        "ops": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        "inputs": [i.name for i in model.graph.input][:4],
    }


# ----------------------------------------------------------------------------- main


@dataclass
class Result:
    scenario: str
    candidate: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    max_abs_logit_diff: float | None = None
    extra: dict = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short shapes, few runs")
    parser.add_argument("--cache", help="export cache folder (default ~/.cache/epfuse-bench)")
    parser.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per scenario")
    parser.add_argument("--per-round", type=int, help="timed runs per candidate per round")
    parser.add_argument("--no-genai", action="store_true", help="skip the genai builder model")
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="SCENARIO",
        help="also print ORT's per-op-type profile of every candidate for this scenario",
    )
    parser.add_argument("--opsets", default="18,23", help="comma-separated export opsets")
    parser.add_argument(
        "--precision",
        choices=("fp32", "int4"),
        default="fp32",
        help="int4: compare int4-weight models (epfuse, genai builder, quantized export)",
    )
    args = parser.parse_args(argv)
    int4 = args.precision == "int4"
    tag = "-int4" if int4 else ""
    suffix = " int4" if int4 else ""

    quick = args.quick
    rounds = args.rounds or (3 if quick else 30)
    per_round = args.per_round or (3 if quick else 4)
    scenarios = QUICK_SCENARIOS if quick else FULL_SCENARIOS
    config = model_config(quick)
    folder = _common.cache_dir(args.cache) / f"inference-{config_key(config)}"
    folder.mkdir(parents=True, exist_ok=True)
    out_path = args.out or _common.RESULTS / (
        f"inference{tag}-quick.json" if quick else f"inference{tag}.json"
    )

    print(f"# inference benchmark ({'quick' if quick else 'full'}); {_common.load_line()}")
    print(f"# cache: {folder}")
    load_before = _common.load()

    from epfuse.errors import UnsupportedModelError

    candidates: list[Candidate] = []
    skipped: dict[str, str] = {}
    originals: dict[int, str] = {}
    for opset in (int(x) for x in args.opsets.split(",")):
        path, export_s = export_cached(config, opset, folder)
        name = f"export opset {opset}{suffix}"
        if int4:
            quantized = folder / f"export-opset{opset}-int4.onnx"
            q_s, q_note = quantize_export(path, quantized)
            candidates.append(Candidate(name, quantized, q_s, q_note))
        else:
            candidates.append(Candidate(name, path, export_s))
        originals[opset] = name
        opt_path = folder / f"epfuse-opset{opset}{tag}.onnx"
        try:
            opt_s, note = optimize_to(path, opt_path, "int4" if int4 else "auto")
        except UnsupportedModelError as err:
            skipped[f"epfuse opset {opset}{suffix}"] = f"not optimized: {err}"
            print(f"  opset {opset}: epfuse did not optimize it: {err}")
            continue
        candidates.append(Candidate(f"epfuse opset {opset}{suffix}", opt_path, opt_s, note))
        print(f"  opset {opset}: optimized in {opt_s:.2f} s, {note}")
    genai_note = None
    if not args.no_genai and genai_available():
        try:
            path, build_s = build_genai(config, folder, args.precision)
            candidates.append(Candidate(f"genai builder{suffix}", path, build_s))
        except Exception as err:  # the builder is an optional comparison, never fatal
            genai_note = f"genai builder failed: {str(err)[:300]}"
            print("  " + genai_note)
    else:
        genai_note = "onnxruntime-genai not installed (or --no-genai)"

    summaries = {c.name: graph_summary(c.path) for c in candidates}
    sessions = {c.name: make_session(c.path) for c in candidates}
    reference = originals.get(23) or next(iter(originals.values()))

    results: list[Result] = []
    paired: dict[str, dict[str, list[float]]] = {}
    profiles: dict[str, dict[str, list]] = {}
    for scenario in scenarios:
        data = scenario_data(config, scenario)
        feeds = {name: feeds_for(sess, data) for name, sess in sessions.items()}
        ref_logits = sessions[reference].run(["logits"], feeds[reference])[0]
        diffs = {
            name: float(np.abs(sess.run(["logits"], feeds[name])[0] - ref_logits).max())
            for name, sess in sessions.items()
        }
        times, round_medians = time_interleaved(
            sessions, feeds, rounds=rounds, per_round=per_round, warmup=2 if quick else 3
        )
        for name, values in times.items():
            q = np.percentile(values, [10, 90])
            results.append(
                Result(
                    scenario=scenario.name,
                    candidate=name,
                    median_ms=statistics.median(values),
                    p10_ms=float(q[0]),
                    p90_ms=float(q[1]),
                    runs=len(values),
                    max_abs_logit_diff=diffs[name],
                )
            )
        paired[scenario.name] = round_medians
        print(f"  {scenario.name}: done; {_common.load_line()}")
        if scenario.name in args.profile:
            profiles[scenario.name] = {}
            for cand in candidates:
                rows = profile_ops(cand.path, feeds[cand.name], runs=10 if quick else 30)
                profiles[scenario.name][cand.name] = rows
    load_after = _common.load()

    # ----------------------------------------------------------------- report
    names = [c.name for c in candidates]
    by = {(r.scenario, r.candidate): r for r in results}
    headers = ["scenario", *[f"{n} (ms)" for n in names]]
    rows = [[s.name, *[f"{by[(s.name, n)].median_ms:.2f}" for n in names]] for s in scenarios]
    print()
    print(_common.table(headers, rows))

    ratio_specs: list[tuple[str, str, str]] = []
    optimized = {opset: f"epfuse opset {opset}{suffix}" for opset in originals}
    optimized = {k: v for k, v in optimized.items() if v in names}
    for opset, orig in originals.items():
        if opset in optimized:
            ratio_specs.append((f"opset {opset}: export / epfuse", orig, optimized[opset]))
    builder = f"genai builder{suffix}"
    if builder in names:
        for opset, opt in optimized.items():
            ratio_specs.append((f"opset {opset}: genai / epfuse", builder, opt))
    if 18 in originals and 23 in optimized:
        ratio_specs.append(("export opset 18 / epfuse opset 23", originals[18], optimized[23]))
    ratio_rows = []
    ratios: dict[str, dict[str, float]] = {}
    for label, num, den in ratio_specs:
        ratios[label] = {}
        cells = []
        for s in scenarios:
            # Paired by round (both measured within seconds of each other), then the median
            # over rounds: robust to the load drifting during the run.
            value = statistics.median(
                a / b for a, b in zip(paired[s.name][num], paired[s.name][den], strict=True)
            )
            ratios[label][s.name] = value
            cells.append(f"{value:.2f}x")
        ratio_rows.append([label, *cells])
    print()
    print("speed-up (>1: epfuse faster; median over rounds of the per-round ratio)")
    print(_common.table(["ratio", *[s.name for s in scenarios]], ratio_rows))
    print()
    print(f"max |logits - export opset {reference.split()[-1]} logits|:")
    mismatched = set()
    for s in scenarios:
        print(
            f"  {s.name}: "
            + ", ".join(f"{n} {by[(s.name, n)].max_abs_logit_diff:.1e}" for n in names)
        )
        atol = INT4_LOGIT_ATOL if int4 else LOGIT_ATOL
        mismatched |= {n for n in names if by[(s.name, n)].max_abs_logit_diff > atol}
    for name in sorted(mismatched):
        print(f"  WARNING: {name} computes different logits (> {atol}): its time is moot")
    for cand in candidates:
        built = f"; built in {cand.build_seconds:.1f} s" if cand.build_seconds else ""
        print(
            f"  {cand.name}: {summaries[cand.name]['nodes']} nodes{built}"
            + (f"; {cand.note}" if cand.note else "")
        )
    if genai_note:
        print(f"  note: {genai_note}")
    for name, why in skipped.items():
        print(f"  note: no '{name}' candidate: {why}")
    for scen, per_cand in profiles.items():
        print(f"\nORT profile, {scen} (ms per run by op type, node count):")
        for cand, rows_ in per_cand.items():
            top = ", ".join(f"{op} {ms:.2f} ({n})" for op, ms, n in rows_[:8])
            print(f"  {cand}: {top}")
    print(f"\n# {_common.load_line()}")

    payload = {
        "benchmark": "inference",
        "quick": quick,
        "precision": args.precision,
        "environment": _common.environment(),
        "load_before": load_before,
        "load_after": load_after,
        "config": {
            k: config.to_dict()[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "max_position_embeddings",
            )
        },
        "threads": THREADS,
        "rounds": rounds,
        "per_round": per_round,
        "candidates": [
            {**asdict(c), "path": str(c.path), "graph": summaries[c.name]} for c in candidates
        ],
        "genai_note": genai_note,
        "skipped": skipped,
        "mismatched": sorted(mismatched),
        "results": [asdict(r) for r in results],
        "ratios": ratios,
        "profiles": profiles,
    }
    _common.write_json(out_path, payload)
    print(f"# wrote {out_path}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
