"""The torch.onnx exports (dynamo and TorchScript) of a tiny Hugging Face Llama match the torch
model they came from, at lengths other than the traced ones."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from epfuse.examples import EXAMPLE_MODEL
from epfuse.optimizer.verify import compare_models
from epfuse.testing.hf_export import (
    export_hf_decoder,
    hf_reference,
    past_input_names,
    tiny_llama_config,
)
from epfuse.testing.hf_families import tiny_dims

# torch and transformers are optional (the ``export`` extra); hf_export imports them lazily.
pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ATOL = RTOL = 1e-4
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 256


@pytest.fixture(scope="module", params=["dynamo", "torchscript"])
def exported(request, tmp_path_factory) -> str:
    """The dynamo export at opset 23, and torch.onnx's TorchScript exporter (``dynamo=False``,
    the one Optimum drives) at 14, its lowest opset with the ops a decoder needs."""
    path = tmp_path_factory.mktemp("export") / f"tiny-llama-{request.param}.onnx"
    dynamo = request.param == "dynamo"
    export_hf_decoder(tiny_llama_config(), path, opset=23 if dynamo else 14, seed=0, dynamo=dynamo)
    return str(path)


@pytest.fixture(scope="module")
def session(exported) -> ort.InferenceSession:
    return ort.InferenceSession(exported, providers=["CPUExecutionProvider"])


def _run(session, ids, mask, pos, past):
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    feed.update(zip(past_input_names(LAYERS), past, strict=True))
    out = session.run(None, feed)
    return out[0], out[1:]


def _empty_past(batch):
    return [np.zeros((batch, KV_HEADS, 0, HEAD_DIM), np.float32) for _ in range(2 * LAYERS)]


def _assert_close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL, err_msg=what)


def _prompt_inputs(rng: np.random.Generator, batch: int, prompt: int):
    """(ids, mask, positions) of an unpadded first prompt of ``prompt`` tokens."""
    ids = rng.integers(0, VOCAB, (batch, prompt), dtype=np.int64)
    mask = np.ones((batch, prompt), np.int64)
    return ids, mask, np.tile(np.arange(prompt, dtype=np.int64), (batch, 1))


def _decode_inputs(rng: np.random.Generator, batch: int, past: int):
    """(ids, mask, positions) of one new token on a past of ``past`` tokens."""
    ids = rng.integers(0, VOCAB, (batch, 1), dtype=np.int64)
    return ids, np.ones((batch, past + 1), np.int64), np.full((batch, 1), past, np.int64)


def test_graph_interface(exported):
    model = onnx.load(exported)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer), (
        "single file, no external data"
    )
    opset = 23 if exported.endswith("-dynamo.onnx") else 14
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    assert [i.name for i in model.graph.input] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        *past_input_names(LAYERS),
    ]
    assert model.graph.output[0].name == "logits"
    assert len(model.graph.output) == 1 + 2 * LAYERS
    past = model.graph.input[3].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in past] == ["batch", KV_HEADS, "past", HEAD_DIM]


def _assert_prompt_then_decode_match(session, config, seed: int, rng, batch: int, prompt: int):
    """A first prompt of ``prompt`` tokens, then one token decoded on the export's own cache:
    logits and presents of both against Hugging Face's model of ``config`` with weights from
    ``seed``. Returns the prompt's (ids, mask, positions) and the export's prompt logits."""
    ids, mask, pos = _prompt_inputs(rng, batch, prompt)
    logits, presents = _run(session, ids, mask, pos, _empty_past(batch))
    ref_logits, ref_presents = hf_reference(config, seed, ids, mask, pos, None)
    _assert_close(logits, ref_logits, "prompt logits")
    for i, (got, ref) in enumerate(zip(presents, ref_presents, strict=True)):
        _assert_close(got, ref, f"prompt present {i}")
    new_ids, new_mask, new_pos = _decode_inputs(rng, batch, prompt)
    new_logits, next_presents = _run(session, new_ids, new_mask, new_pos, presents)
    ref_logits, ref_next = hf_reference(config, seed, new_ids, new_mask, new_pos, presents)
    _assert_close(new_logits, ref_logits, "decode logits")
    for i, (got, ref) in enumerate(zip(next_presents, ref_next, strict=True)):
        assert got.shape == (batch, KV_HEADS, prompt + 1, HEAD_DIM)
        _assert_close(got, ref, f"decode present {i}")
    return (ids, mask, pos), logits


def test_prompt_and_decode_match_torch(session):
    rng = np.random.default_rng(0)
    _, logits = _assert_prompt_then_decode_match(session, tiny_llama_config(), 0, rng, 2, 7)
    # Attention must be non-trivial for this check to mean anything.
    assert np.abs(logits).max() > 1.0


def test_right_padded_prompt_matches_torch_on_valid_rows(session):
    config = tiny_llama_config()
    rng = np.random.default_rng(1)
    lens = (7, 4)
    ids = rng.integers(0, VOCAB, (2, 7), dtype=np.int64)
    mask = np.array([[1] * n + [0] * (7 - n) for n in lens], np.int64)
    pos = np.tile(np.arange(7, dtype=np.int64), (2, 1))
    logits, presents = _run(session, ids, mask, pos, _empty_past(2))
    ref_logits, ref_presents = hf_reference(config, 0, ids, mask, pos, None)
    for b, n in enumerate(lens):
        _assert_close(logits[b, :n], ref_logits[b, :n], f"padded logits row {b}")
        for got, ref in zip(presents, ref_presents, strict=True):
            _assert_close(got[b, :, :n], ref[b, :, :n], f"padded present row {b}")


@pytest.mark.parametrize("exported", ["dynamo"], indirect=True)
def test_bundled_example_is_this_export(exported):
    """scripts/make_example.py output: the bundled model computes exactly what a fresh one does."""
    result = compare_models(EXAMPLE_MODEL, exported)
    assert result.passed, str(result)
    assert max(c.max_abs_err for s in result.scenarios for c in s.comparisons) == 0.0


def test_sliding_window_export_matches_torch(tmp_path):
    """A prompt longer than the window, then decode: the generic full-cache export is exact."""
    from transformers import MistralConfig

    config = MistralConfig(**tiny_dims(vocab_size=VOCAB, sliding_window=4))
    path = export_hf_decoder(config, tmp_path / "mistral-sw4.onnx", seed=3)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    prompt, logits = _assert_prompt_then_decode_match(session, config, 3, rng, 2, 10)
    # The window matters: the same weights without it give different logits.
    config_full = MistralConfig(**{**config.to_dict(), "sliding_window": None})
    full_logits, _ = hf_reference(config_full, 3, *prompt, None)
    assert np.abs(full_logits - logits).max() > 1e-2
