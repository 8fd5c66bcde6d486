"""fp16, int4 and int8-KV-cache models package for onnxruntime-genai (its config has no dtype field: genai
reads the I/O types from the model) and generate there what the model itself computes."""

import numpy as np
import onnxruntime as ort
import pytest

import epfuse
from epfuse.optimizer.genai import write_genai_package

og = pytest.importorskip("onnxruntime_genai")

PROMPT = [1, 5, 7, 9, 11]
NEW = 8


def _ort_greedy(path, prompt, n):
    """Greedy tokens of the model in a plain ORT loop (past in the model's own dtype)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if "past" in i.name]
    dtypes = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}
    dtype = dtypes.get(pasts[0].type, np.float32)
    feed_past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype) for i in pasts}
    presents = [o.name for o in session.get_outputs() if "present" in o.name]
    ids, total, tokens = np.array([prompt], np.int64), len(prompt), []
    for _ in range(n):
        feed = {
            "input_ids": ids,
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(total - ids.shape[1], total, dtype=np.int64)[None],
            **feed_past,
        }
        out = session.run(["logits", *presents], feed)
        tokens.append(int(out[0][0, -1].argmax()))
        feed_past = dict(zip([i.name for i in pasts], out[1:], strict=True))
        ids, total = np.array([[tokens[-1]]], np.int64), total + 1
    return tokens


@pytest.mark.parametrize(
    ("precision", "kv_cache"), [("fp16", None), ("int4", None), ("fp32", "int8"), ("int4", "int8")]
)
def test_package_generates_in_genai(example_model, tmp_path, precision, kv_cache):
    """kv_cache int8: genai allocates the shared buffer in the past's dtype (int8) and the
    scales are initializers, so the package runs as is."""
    model, report = epfuse.optimize_with_report(
        example_model, "cpu", precision=precision, max_seq_len=128, kv_cache=kv_cache
    )
    package = write_genai_package(model, report, tmp_path / f"{precision}-{kv_cache}")
    assert package.share_buffer
    og_model = og.Model(str(package.directory))
    params = og.GeneratorParams(og_model)
    params.set_search_options(max_length=len(PROMPT) + NEW, do_sample=False)
    generator = og.Generator(og_model, params)
    generator.append_tokens(np.array([PROMPT], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    got = [int(t) for t in generator.get_sequence(0)][len(PROMPT) :]
    assert got == _ort_greedy(package.directory / "model.onnx", PROMPT, NEW)
