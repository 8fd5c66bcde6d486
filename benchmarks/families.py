"""The README's family x exporter table: per tiny family, what ``optimize(ep="cpu")`` fuses and
how far the result is from the export, per scenario.

Each family of ``epfuse.testing.hf_families`` (dense, MoE, sinks, LongRoPE) is exported with
torch.onnx's dynamo exporter at opset 18 and 23 (``--exporter dynamo``, transformers 5.x), or
with Hugging Face Optimum at its default opset (``--exporter optimum``, in the optimum venv:
transformers 4.57); each export is optimized for cpu and compared with itself on ORT CPU
(``compare_models``: prompt, decode with a real past, chunked prefill, right-padded batch,
decode after a padded prompt; prompt 2W + 1 and past 2W, past the sliding window W = 4).
A row records layers fused / total, what each layer became (GQA's do_rotary, window, softcap,
head_sink; MoE nodes; experts lowered to the loop over the experts), the reasons for anything
kept, and the max |logits difference| per scenario (``skip`` where ``verify`` skips it, with
its reason in the JSON).

    PYTHONPATH=. python benchmarks/families.py --exporter dynamo
    PYTHONPATH=. /path/to/optimum-venv/bin/python benchmarks/families.py --exporter optimum

Writes ``benchmarks/results/families-<exporter>.json`` (one record per family and opset; with
``--families``, those families' records are replaced and the others kept) and prints markdown
rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
import traceback
from pathlib import Path

import onnx

import epfuse
from epfuse.optimizer.verify import compare_models
from epfuse.testing import hf_families as H

W = H.SLIDING_WINDOW
SCENARIOS = ("prompt", "decode", "chunk", "padded", "padded_decode")


def _families(exporter: str) -> dict[str, H.Family]:
    families = {**H.FAMILIES, **H.MORE_FAMILIES}
    if exporter == "dynamo":  # transformers 5.x only (batched_mm experts, LongRoPE's config)
        for extra in (
            "MOE_FAMILIES",
            "KEPT_EXPERTS_FAMILIES",
            "SINK_FAMILIES",
            "LONGROPE_FAMILIES",
        ):
            families.update(getattr(H, extra, {}))
    else:  # GPT-OSS's config builds under 4.57 too (optimum-onnx 0.1.0 exports it)
        families.update(H.SINK_FAMILIES)
    return families


def _gqa_summary(model: onnx.ModelProto) -> str:
    """``GQA(do_rotary=...)`` per distinct attribute set, with counts; MoE nodes."""
    kinds: collections.Counter[str] = collections.Counter()
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            parts = [f"do_rotary={a.get('do_rotary', 0)}"]
            if a.get("rotary_interleaved"):
                parts.append("interleaved")
            if a.get("local_window_size", -1) > 0:
                parts.append(f"window {a['local_window_size']}")
            if a.get("softcap", 0.0):
                parts.append(f"softcap {a['softcap']:g}")
            if len(node.input) > 11 and node.input[11]:
                parts.append("head_sink")
            kinds[f"GQA({', '.join(parts)})"] += 1
        elif node.op_type == "MoE":
            kinds["MoE"] += 1
    return ", ".join(f"{n} x {k}" for k, n in kinds.items())


def measure(name: str, family: H.Family, exporter: str, opset: int | None, tmp: Path) -> dict:
    record: dict = {"family": name, "exporter": exporter, "opset": opset}
    start = time.perf_counter()
    try:
        config = family.make_config()
        if exporter == "optimum":
            from epfuse.testing.optimum_export import export_optimum_decoder

            if name == "phi2":  # Optimum's Phi config reads no num_key_value_heads
                config.num_key_value_heads = config.num_attention_heads
            path = export_optimum_decoder(config, tmp / name, opset=opset)
        else:
            from epfuse.testing.hf_export import export_hf_decoder

            path = export_hf_decoder(config, tmp / f"{name}-{opset}.onnx", opset=opset)
    except Exception as err:  # the exact error goes into the table
        record["error"] = f"export: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
        return record
    original = onnx.load(str(path))
    record["opset"] = original.opset_import[0].version
    try:
        optimized, report = epfuse.optimize_with_report(original, "cpu")
    except Exception as err:
        record["error"] = f"optimize: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
        return record
    record["layers"] = len(report.layers)
    record["fused"] = report.fused_layers
    record["into"] = _gqa_summary(optimized)
    looped = next((r.rewritten for r in report.rules if r.name == "legalize-experts-to-loop"), 0)
    if looped:
        record["into"] += f", experts loop x {looped}"
    kept = []
    for i, layer in enumerate(report.layers):
        notes = [n for note in layer.notes for n in note.split("; ") if "kept" in n]
        for why in notes + list(layer.reasons):
            kept.append(f"layer {i}: {why}")
    record["kept"] = kept
    record["warnings"] = list(report.warnings)
    result = compare_models(
        original,
        optimized,
        prompt_len=2 * W + 1,
        decode_past_len=2 * W,
        chunk_past_len=2 * W,
        chunk_len=3,
        padded_lens=(2 * W + 1, W - 1),
    )
    record["passed"] = result.passed
    scenarios = {}
    for s in result.scenarios:
        if s.skipped:
            scenarios[s.name] = {"skipped": s.skipped}
        elif s.error:
            scenarios[s.name] = {"error": s.error[:300]}
        else:
            logits = [c.max_abs_err for c in s.comparisons if c.kind == "logits"]
            scenarios[s.name] = {"max_abs_logits": max(logits), "passed": s.passed}
    record["scenarios"] = scenarios
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def row(r: dict) -> str:
    opset = r["opset"] if r["exporter"] == "dynamo" else f"optimum ({r['opset']})"
    if "error" in r:
        return f"| {r['family']} | {opset} | — | — | — | {r['error']} |"
    cells = []
    for name in SCENARIOS:
        s = r["scenarios"].get(name, {})
        cells.append(f"{s['max_abs_logits']:.1e}" if "max_abs_logits" in s else "skip")
    kept = sorted({k.split(": ", 1)[1] for k in r["kept"]})
    return (
        f"| {r['family']} | {opset} | {r['fused']} / {r['layers']} | {r['into']} | "
        f"{' / '.join(cells)}{'' if r['passed'] else ' FAIL'} | {'; '.join(kept) or '—'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exporter", choices=("dynamo", "optimum"), default="dynamo")
    parser.add_argument("--families", nargs="*", help="names (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    families = _families(args.exporter)
    names = args.families or list(families)
    opsets = (18, 23) if args.exporter == "dynamo" else (None,)
    out = args.out or Path(__file__).parent / "results" / f"families-{args.exporter}.json"
    records = []
    if args.families and out.exists():  # a subset re-measured: the other records stay
        records = [r for r in json.loads(out.read_text()) if r["family"] not in names]
    with tempfile.TemporaryDirectory(prefix="epfuse-families-") as tmp:
        for name in names:
            for opset in opsets:
                try:
                    record = measure(name, families[name], args.exporter, opset, Path(tmp))
                except Exception:
                    record = {"family": name, "exporter": args.exporter, "opset": opset}
                    record["error"] = traceback.format_exc().splitlines()[-1][:300]
                records.append(record)
                print(row(record), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
