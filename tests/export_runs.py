"""Running a real export on ORT CPU the way the family tests check it against Hugging Face:
the session, the decoder's feeds (token ids, mask, positions, one array per past) and the
export-then-optimize step that each family test's fixture does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import epfuse
from epfuse.testing.hf_export import export_hf_decoder


def run_cpu(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Every output of ``model`` on ORT CPU (default graph optimizations)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def decoder_feeds(
    model: onnx.ModelProto, ids, mask, pos, past: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    """The decoder's inputs by name; ``past`` in the order of the model's past inputs."""
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    names = [i.name for i in model.graph.input if i.name.startswith("past_key_values")]
    feeds.update(zip(names, past, strict=True))
    return feeds


def export_and_optimize(config, path: Path, opset: int):
    """Export the Hugging Face ``config``'s model to ``path`` with torch.onnx dynamo at
    ``opset`` and optimize it for cpu: (original, optimized, report)."""
    export_hf_decoder(config, path, opset=opset)
    original = onnx.load(str(path))
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    return original, optimized, report


def assert_prompt_matches_hf(config, exported: onnx.ModelProto, prompt: int) -> None:
    """The exported graph is the Hugging Face model of ``config`` (installed transformers):
    logits and presents of a batch-2 first prompt of ``prompt`` tokens, at the fp32
    tolerance. An export without a ``position_ids`` input computes them itself."""
    assert_matches_hf(config, exported, prompt)


def assert_matches_hf(
    config, exported: onnx.ModelProto, prompt: int, *, decode: bool = False, seed: int = 7
) -> None:
    """:func:`assert_prompt_matches_hf`, then (``decode``) one decode step fed the presents
    the export returned: its logits and presents against Hugging Face's on the same past.
    Token ids are drawn from ``seed``."""
    from epfuse.testing.hf_export import hf_reference
    from epfuse.tolerances import tolerance_for

    tol = tolerance_for("float32")
    rng = np.random.default_rng(seed)
    batch = 2
    names = {i.name for i in exported.graph.input}
    kv = [i for i in exported.graph.input if i.name.startswith("past_key_values")]
    kv_heads, head = (d.dim_value for d in kv[0].type.tensor_type.shape.dim[1::2])
    past = [np.zeros((batch, kv_heads, 0, head), np.float32)] * len(kv)
    hf_past = None  # Hugging Face's first prompt has no cache at all
    done = 0
    for new in (prompt, 1) if decode else (prompt,):
        ids = rng.integers(0, 256, (batch, new), dtype=np.int64)
        mask = np.ones((batch, done + new), dtype=np.int64)
        positions = np.tile(np.arange(done, done + new, dtype=np.int64), (batch, 1))
        feeds = decoder_feeds(exported, ids, mask, positions, past)
        if "position_ids" not in names:
            del feeds["position_ids"]
        got = run_cpu(exported, feeds)
        want_logits, want_present = hf_reference(config, 0, ids, mask, positions, hf_past)
        np.testing.assert_allclose(got[0], want_logits, atol=tol.atol, rtol=tol.rtol)
        for g, w in zip(got[1:], want_present, strict=True):
            np.testing.assert_allclose(g, w, atol=tol.atol, rtol=tol.rtol)
        past = hf_past = got[1:]
        done += new


def padded_decode_logits_diff(
    original: onnx.ModelProto, optimized: onnx.ModelProto, lens: Sequence[int], steps: int = 2
) -> float:
    """Max |logits difference| over ``steps`` decode steps after a right-padded prompt of
    ``lens``, each model on its own cache (mask ``[1]*len + [0]*pad + [1]*(t+1)``, verify's
    ``padded_decode``), compared even where verify skips the scenario because the original's
    rows differ from the rows run alone (positions counted from the cache length)."""
    rng = np.random.default_rng(0)
    batch, width = len(lens), max(lens)
    heads = {i.name: i for i in original.graph.input if i.name.startswith("past_key_values")}
    dims = {n: v.type.tensor_type.shape.dim for n, v in heads.items()}
    vocab = next(o for o in original.graph.output if o.name == "logits")
    vocab_size = vocab.type.tensor_type.shape.dim[-1].dim_value or 32
    ids = rng.integers(0, vocab_size, (batch, width + steps), dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.asarray(lens)[:, None]).astype(np.int64)
    pos = np.broadcast_to(np.arange(width), (batch, width)).astype(np.int64)
    empty = [
        np.zeros((batch, d[1].dim_value, 0, d[3].dim_value), np.float32) for d in dims.values()
    ]
    worst = 0.0
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (original, optimized)
    ]
    pasts: list[list[np.ndarray]] = [empty, empty]
    step_mask = mask
    for t in range(steps + 1):
        if t == 0:
            tokens, positions = ids[:, :width], pos
        else:
            step_mask = np.concatenate([step_mask, np.ones((batch, 1), np.int64)], axis=1)
            tokens = ids[:, width + t - 1 : width + t]
            positions = np.asarray([[n + t - 1] for n in lens], np.int64)
        logits = []
        for i, (model, session) in enumerate(zip((original, optimized), sessions, strict=True)):
            names = {v.name for v in session.get_inputs()}
            feeds = decoder_feeds(model, tokens, step_mask, positions, pasts[i])
            out = session.run(None, {k: v for k, v in feeds.items() if k in names})
            logits.append(out[0])
            pasts[i] = out[1:]
        if t:  # decode steps: every row's new token is valid
            worst = max(worst, float(np.abs(logits[0] - logits[1]).max()))
    return worst
