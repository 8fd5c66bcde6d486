"""What the peers fuse on Hugging Face Optimum exports, and whether their output stays equal.

Optimum (``optimum-cli export onnx --task text-generation-with-past``, TorchScript exporter)
made most downloadable ONNX LLMs; users who want them faster try ORT's own
``onnxruntime.transformers.optimizer.optimize_model`` (with ``num_heads``/``hidden_size``
given; ORT has no ``llama`` model type, so ``gpt2`` (its generic decoder fusions) and
``qwen3`` (the Llama-like decoder type added in ORT 1.2x) are both tried) and onnxscript's
``optimize_for_ort``. This script exports tiny random-weight Llama, Qwen2, Mistral, Phi-3 and
Gemma-2 checkpoints with Optimum at opset 18 (its default) and 14, runs each optimizer, counts
the fused ops (attention: com.microsoft Attention / MultiHeadAttention / GroupQueryAttention;
RotaryEmbedding; SimplifiedLayerNormalization incl. its Skip form, or ONNX RMSNormalization)
before and after, and compares each output with the export on ORT CPU
(``epfuse.optimizer.verify.compare_models``: prompt, decode with a real past, chunked prefill,
right-padded batch, decode after a padded prompt; lengths past Mistral's sliding window).
epfuse itself is run on the same files for reference.

Needs the ``optimum`` extra (its own venv: optimum-onnx pins transformers 4.57)::

    PYTHONPATH=. /path/to/optimum-venv/bin/python benchmarks/peers_optimum.py

Writes ``benchmarks/results/peers_optimum.json`` and prints the README's table.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import tempfile
import traceback
from pathlib import Path

import _common  # puts the checkout on sys.path

FAMILIES = ("llama3", "qwen2", "mistral", "phi3", "gemma2")
OPSETS = (18, 14)
ORT_TYPES = ("gpt2", "qwen3")

ATTENTION = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention"}
ROPE = {"RotaryEmbedding"}
NORM = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"}


def _counts(model) -> dict[str, int]:
    ops = collections.Counter()
    for node in model.graph.node:
        if node.op_type in ATTENTION and (
            node.domain == "com.microsoft" or node.op_type == "Attention"
        ):
            ops["attention"] += 1
        if node.op_type in ROPE:
            ops["rope"] += 1
        if node.op_type in NORM:
            ops["norm"] += 1
    return {k: ops.get(k, 0) for k in ("attention", "rope", "norm")}


def _equal(original: Path, candidate, window: int | None) -> str:
    from epfuse.optimizer.verify import compare_models

    prompt = 2 * window + 1 if window else 7
    try:
        result = compare_models(
            str(original), candidate, prompt_len=prompt, decode_past_len=prompt - 1
        )
    except Exception as err:  # a peer may rename or drop I/O
        return f"not comparable: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
    if result.passed:
        return "equal"
    crashed = [s.name for s in result.scenarios if s.error]
    if crashed:
        return "FAILS TO RUN: " + ", ".join(crashed)
    return "DIFFERS: " + ", ".join(result.failed_scenarios())


def _export(name: str, opset: int, cache: Path) -> Path:
    from epfuse.testing.hf_families import ALL_FAMILIES
    from epfuse.testing.optimum_export import export_optimum_decoder

    out = cache / f"optimum-{name}-opset{opset}"
    path = out / "model.onnx"
    if not path.exists():
        export_optimum_decoder(ALL_FAMILIES[name].make_config(), out, opset=opset)
    return path


def _ort(path: Path, model_type: str, config) -> dict:
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        optimizer = optimize_model(
            str(path),
            model_type=model_type,
            num_heads=config.num_attention_heads,
            hidden_size=config.hidden_size,
        )
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"}
    model = optimizer.model
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ort.onnx"
        onnx.save(model, str(out))
        return {"after": _counts(model), "equal": _equal(path, str(out), _window(config))}


def _onnxscript(path: Path, config) -> dict:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    try:
        model = ir.load(str(path))
        model, _ = optimize_for_ort(model)
        proto = ir.to_proto(model)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"}
    return {"after": _counts(proto), "equal": _equal(path, proto, _window(config))}


def _epfuse(path: Path, config) -> dict:
    import onnx_ir as ir

    import epfuse

    try:
        model, report = epfuse.optimize_with_report(str(path), "cpu")
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    proto = ir.to_proto(model)
    return {
        "after": _counts(proto),
        "fused_layers": report.fused_layers,
        "equal": _equal(path, proto, _window(config)),
    }


def _window(config) -> int | None:
    return (
        getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True)
        else None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help="export cache folder")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--opsets", nargs="*", type=int, default=list(OPSETS))
    args = parser.parse_args()

    import onnx

    from epfuse.testing.hf_families import ALL_FAMILIES

    cache = _common.cache_dir(args.cache)
    rows = []
    for name in args.families:
        config = ALL_FAMILIES[name].make_config()
        for opset in args.opsets:
            try:
                path = _export(name, opset, cache)
            except Exception:
                rows.append(
                    {"family": name, "opset": opset, "export_error": traceback.format_exc(limit=1)}
                )
                continue
            row = {
                "family": name,
                "opset": opset,
                "layers": config.num_hidden_layers,
                "before": _counts(onnx.load(str(path))),
                "ort": {t: _ort(path, t, config) for t in ORT_TYPES},
                "onnxscript": _onnxscript(path, config),
                "epfuse": _epfuse(path, config),
            }
            rows.append(row)
            print(name, opset, row, flush=True)

    env = _common.environment()
    for package in ("onnxscript", "optimum-onnx", "transformers", "torch"):
        env[package] = importlib.metadata.version(package)
    _common.write_json(_common.RESULTS / "peers_optimum.json", {"environment": env, "rows": rows})
    print()
    print(_markdown(rows, env))


def _cell(result: dict) -> str:
    if "error" in result:
        error = result["error"]
        if "(kept: " in error:  # epfuse's refusal: the first reason a layer was kept
            return "refused: " + error.split("(kept: ")[1].split(": ", 1)[1].split(";")[0].rstrip(
                ")"
            )
        return f"error ({error[:60]})"
    a = result["after"]
    return f"{a['attention']} / {a['rope']} / {a['norm']}, {result['equal'].split(':')[0].lower()}"


def _markdown(rows: list[dict], env: dict) -> str:
    headers = ["export", "before", "ORT gpt2", "ORT qwen3", "onnxscript", "epfuse cpu"]
    body = []
    for row in rows:
        if "export_error" in row:
            body.append([f"{row['family']} opset {row['opset']}", "export failed", "", "", "", ""])
            continue
        b = row["before"]
        body.append(
            [
                f"{row['family']} opset {row['opset']}",
                f"{b['attention']} / {b['rope']} / {b['norm']}",
                _cell(row["ort"]["gpt2"]),
                _cell(row["ort"]["qwen3"]),
                _cell(row["onnxscript"]),
                _cell(row["epfuse"]),
            ]
        )
    versions = ", ".join(
        f"{k} {env[k]}"
        for k in ("onnxruntime", "onnxscript", "optimum-onnx", "transformers", "torch")
    )
    return (
        "cells: attention / RotaryEmbedding / RMSNorm ops after, then equal to the export or not "
        f"({versions})\n\n" + _common.table(headers, body)
    )


if __name__ == "__main__":
    main()
