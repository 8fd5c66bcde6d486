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
    from epfuse.testing.hf_export import hf_reference
    from epfuse.tolerances import tolerance_for

    tol = tolerance_for("float32")
    rng = np.random.default_rng(7)
    batch = 2
    names = {i.name for i in exported.graph.input}
    kv = [i for i in exported.graph.input if i.name.startswith("past_key_values")]
    kv_heads, head = (d.dim_value for d in kv[0].type.tensor_type.shape.dim[1::2])
    positions = np.tile(np.arange(prompt, dtype=np.int64), (batch, 1))
    feeds = {
        "input_ids": rng.integers(0, 256, (batch, prompt), dtype=np.int64),
        "attention_mask": np.ones((batch, prompt), dtype=np.int64),
    }
    if "position_ids" in names:
        feeds["position_ids"] = positions
    feeds.update({i.name: np.zeros((batch, kv_heads, 0, head), np.float32) for i in kv})
    got = run_cpu(exported, feeds)
    want_logits, want_present = hf_reference(
        config, 0, feeds["input_ids"], feeds["attention_mask"], positions, None
    )
    np.testing.assert_allclose(got[0], want_logits, atol=tol.atol, rtol=tol.rtol)
    for g, w in zip(got[1:], want_present, strict=True):
        np.testing.assert_allclose(g, w, atol=tol.atol, rtol=tol.rtol)
