"""Optimized torch.onnx exports run in onnxruntime-genai and generate Hugging Face's tokens.

For tiny random-weight Llama, Qwen2 and Mistral (sliding window 8, shorter than the prompts),
exported with torch.onnx at opset 23 and 18 and optimized for the CPU EP with ``--genai``:
greedy generation of 32 new tokens with onnxruntime-genai (KV buffer shared between past and
present) equals ``transformers`` ``generate`` token for token, for one prompt and for a batch
of two prompts of different lengths. The batch is right-padded, which is what genai's own
``Tokenizer.encode_batch`` produces (checked below) and what GroupQueryAttention's contract
(``seqlens_k``) expects; each row is compared with HF generating that prompt alone.

Gemma 1, OLMo, Nemotron, Ernie 4.5 and HunYuan dense (the hf_families configs, opset 23) give
HF's tokens as well, one prompt and a right-padded batch (``test_more_families_...``).

The same holds for Hugging Face Optimum exports (TorchScript exporter, Optimum's default
opset) of Llama and Mistral: those parameters are marked ``optimum`` and run in the optimum
venv, where ``transformers`` is the 4.57 release Optimum exported from.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import epfuse
from epfuse.optimizer.genai import GenaiPackage, write_genai_package
from epfuse.testing.hf_export import export_hf_decoder, hf_model
from epfuse.testing.hf_families import tiny_dims
from epfuse.tolerances import tolerance_for

pytest.importorskip("torch")
pytest.importorskip("transformers")
og = pytest.importorskip("onnxruntime_genai")

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PAD, BOS, EOS = 0, 1, 2
VOCAB = 256
MAX_SEQ_LEN = 256  # rows of the fused cos/sin caches = genai context_length
# Drawn at random (seed 2026) and kept because, for all three families, HF's top-2 logit
# margin at every one of the 32 steps is >= 1.5x the near-tie bound of _assert_same_generation.
PROMPTS = (
    [BOS, 218, 48, 9, 164, 95, 121, 23, 96, 165, 92],
    [BOS, 187, 235, 74, 163],
)
_DIMS = tiny_dims(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def _config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(**_DIMS)
    if family == "qwen2":
        return Qwen2Config(**_DIMS)
    if family == "mistral-sw8":
        return MistralConfig(**_DIMS, sliding_window=8)
    raise ValueError(family)


FAMILIES = {"llama": 0, "qwen2": 1, "mistral-sw8": 2}  # family -> weight seed


def save_tiny_tokenizer(directory: Path) -> None:
    """A 64-token byte-level BPE saved as a Hugging Face fast tokenizer (no hub needed).

    onnxruntime-genai's tokenizer (onnxruntime-extensions) loads BPE tokenizer.json files; a
    WordLevel model fails to load with "Cannot know how to parse line".
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False
    )
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(directory))


@dataclasses.dataclass
class Family:
    name: str
    config: object
    hf: object  # the torch model
    plain: Path  # the torch.onnx export
    package: GenaiPackage
    report: epfuse.Report
    model: object  # og.Model, loaded once


OPTIMUM = "optimum"  # in place of an opset: exported with Optimum at its default opset


@pytest.fixture(
    scope="module",
    params=[f"{n}@{opset}" for n in FAMILIES for opset in (23, 18)]
    + [pytest.param(f"{n}@{OPTIMUM}", marks=pytest.mark.optimum) for n in ("llama", "mistral-sw8")],
)
def family(request, tmp_path_factory) -> Family:
    name, opset = request.param.split("@")
    root = tmp_path_factory.mktemp(f"genai-{name}-{opset}")
    return _package(name, _config(name), FAMILIES[name], opset, root)


def _package(name: str, config, seed: int, opset: str, root: Path) -> Family:
    """Export ``config`` (seeded weights), optimize for cpu, package for genai, load it."""
    from transformers import GenerationConfig

    if opset == OPTIMUM:
        from epfuse.testing.optimum_export import export_optimum_decoder

        plain = export_optimum_decoder(config, root / "optimum", seed=seed)
    else:
        plain = export_hf_decoder(config, root / "plain.onnx", opset=int(opset), seed=seed)
    hf_dir = root / "hf"
    config.save_pretrained(str(hf_dir))
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(
        str(hf_dir)
    )
    save_tiny_tokenizer(hf_dir)
    optimized, report = epfuse.optimize_with_report(plain, "cpu", max_seq_len=MAX_SEQ_LEN)
    package = write_genai_package(optimized, report, root / "genai", hf_config_dir=hf_dir)
    return Family(
        name,
        config,
        hf_model(config, seed),
        plain,
        package,
        report,
        og.Model(str(package.directory)),
    )


def hf_generate(hf, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the raw logits at each step, (n, vocab), of ``transformers``."""
    import torch

    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.stack(out.logits)[:, 0].float().numpy()
    return out.sequences[0, len(prompt) :].tolist(), logits


def margins(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per step (EOS excluded: both sides suppress it, min_length)."""
    top2 = np.sort(np.delete(logits, EOS, axis=-1), axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def genai_generate(
    model, prompts, n: int = NEW_TOKENS, *, logits: bool = True
) -> tuple[list[list[int]], np.ndarray | None]:
    """Greedy generation in onnxruntime-genai from right-padded prompts.

    Returns the new tokens per row and the logits each step chose from, (rows, n, vocab)
    (``get_logits`` before ``generate_next_token`` runs the model for the pending tokens).
    """
    length = max(len(p) for p in prompts)
    params = og.GeneratorParams(model)
    params.set_search_options(
        max_length=length + n, min_length=length + n, do_sample=False, batch_size=len(prompts)
    )
    generator = og.Generator(model, params)
    ids = np.full((len(prompts), length), PAD, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    generator.append_tokens(ids)
    steps = []
    while not generator.is_done():
        if logits:
            steps.append(np.asarray(generator.get_logits()).reshape(len(prompts), -1))
        generator.generate_next_token()
    tokens = [list(map(int, generator.get_sequence(i)))[length:] for i in range(len(prompts))]
    return tokens, (np.stack(steps, axis=1) if logits else None)


def _assert_same_generation(got, got_logits, want, want_logits, what: str) -> None:
    """Same tokens, and every step's logits within the fp32 tolerance of HF's.

    Greedy tokens are only a fair test where no step is a near-tie: two implementations
    within the tolerance can pick different argmaxes when the top-2 margin is below twice the
    per-logit bound. The prompts were chosen so that HF's margins clear that bound; if a
    change of weights or prompts breaks this, the failure says so instead of flaking.
    """
    tol = tolerance_for("float32")
    bound = 2 * (tol.atol + tol.rtol * float(np.abs(want_logits).max()))
    margin = margins(want_logits)
    assert margin.min() > bound, (
        f"{what}: HF's top-2 logit margin {margin.min():.2e} at new token "
        f"{int(margin.argmin())} is a near-tie (< {bound:.1e}): choose another prompt"
    )
    if got != want:
        step = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        raise AssertionError(
            f"{what}: first difference at new token {step}: genai {got[step]}, HF "
            f"{want[step]}; HF margin there {margin[step]:.3g}\ngenai {got}\nHF    {want}"
        )
    np.testing.assert_allclose(got_logits, want_logits, atol=tol.atol, rtol=tol.rtol, err_msg=what)


def test_package_is_fused_and_shares_the_buffer(family):
    assert family.report.fused_layers == len(family.report.layers) == 2
    assert family.package.share_buffer and family.package.share_buffer_blocker is None
    decoder = family.package.config["model"]["decoder"]
    assert decoder["inputs"]["position_ids"] == "position_ids"
    assert family.package.config["model"]["context_length"] == MAX_SEQ_LEN
    assert family.package.config["model"]["type"] == family.config.model_type
    if family.name == "mistral-sw8":
        assert all("sliding window 8" in layer.notes[0] for layer in family.report.layers)
    # genai really shares: the present output is the (batch, kv, max_length, head) buffer.
    params = og.GeneratorParams(family.model)
    params.set_search_options(max_length=40, do_sample=False)
    generator = og.Generator(family.model, params)
    generator.append_tokens(np.array([PROMPTS[1]], np.int32))
    generator.generate_next_token()
    assert np.asarray(generator.get_output("present.0.key")).shape == (1, 2, 40, 16)


def test_single_prompt_matches_hf_generate(family):
    want, want_logits = hf_generate(family.hf, PROMPTS[0])
    (got,), got_logits = genai_generate(family.model, [PROMPTS[0]])
    _assert_same_generation(got, got_logits[0], want, want_logits, f"{family.name} prompt")


def test_right_padded_batch_matches_hf_generate(family):
    got, got_logits = genai_generate(family.model, list(PROMPTS))
    for row, prompt in enumerate(PROMPTS):
        want, want_logits = hf_generate(family.hf, prompt)
        _assert_same_generation(
            got[row], got_logits[row], want, want_logits, f"{family.name} batch row {row}"
        )


# Every other family whose model type genai 0.18 runs (issue 12): family -> weight seed,
# chosen (like PROMPTS) so that HF's top-2 margin clears the near-tie bound at every step.
# genai refuses the families it has no type for (OLMo-2/3, GLM, Cohere, StableLM, Mixtral,
# Qwen3-MoE: "Unsupported model_type in config.json: olmo3").
MORE_FAMILIES = {
    "gemma": 0,
    "olmo": 1,
    "nemotron": 0,
    "ernie4_5": 0,
    "hunyuan-dense": 0,
    "qwen3": 0,
    "phi3": 0,
    "gemma2": 0,
    "gemma3": 0,
    "granite": 0,
    "smollm3": 0,
    "phi2": 0,
    "gpt-oss": 0,
    "llama3": 0,
    "llama-linear": 0,
    "llama-yarn": 0,
    "phimoe": 0,
}


@pytest.mark.parametrize("name", list(MORE_FAMILIES))
def test_more_families_generate_hf_tokens(name, tmp_path):
    """The opset-23 export, fused on cpu (every layer; Ernie 4.5 and HunYuan with RoPE
    outside GQA; PhiMoE's experts as the loop over the experts, GPT-OSS's as MoE), runs in
    genai with the shared buffer and gives HF's greedy tokens, one prompt and a right-padded
    batch."""
    from epfuse.testing.hf_families import ALL_FAMILIES, KEPT_EXPERTS_FAMILIES, SINK_FAMILIES

    config = {**ALL_FAMILIES, **SINK_FAMILIES, **KEPT_EXPERTS_FAMILIES}[name].make_config()
    for key, value in dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS).items():
        setattr(config, key, value)
    config.pad_token_id = PAD
    fam = _package(name, config, MORE_FAMILIES[name], "23", tmp_path)
    assert fam.report.fused_layers == len(fam.report.layers) >= 2, fam.report.summary()
    assert fam.package.share_buffer, fam.package.share_buffer_blocker
    got, got_logits = genai_generate(fam.model, list(PROMPTS))
    for row, prompt in enumerate(PROMPTS):
        want, want_logits = hf_generate(fam.hf, prompt)
        _assert_same_generation(got[row], got_logits[row], want, want_logits, f"{name} row {row}")
        if row == 0:
            (alone,), alone_logits = genai_generate(fam.model, [prompt])
            _assert_same_generation(alone, alone_logits[0], want, want_logits, f"{name} prompt")


@pytest.mark.parametrize("family", ["llama@23"], indirect=True)
def test_genai_tokenizer_pads_batches_on_the_right(family):
    """genai's own batching right-pads with pad_token_id: inside the GQA input contract."""
    assert "tokenizer.json" in family.package.copied
    tokenizer = og.Tokenizer(family.model)
    ids = tokenizer.encode_batch(["hello world the fox", "dog"]).as_numpy()
    short = tokenizer.encode("dog")
    assert ids.shape[0] == 2 and ids.shape[1] > len(short)
    assert ids[1, : len(short)].tolist() == list(short)
    assert (ids[1, len(short) :] == PAD).all()


@pytest.mark.parametrize("family", ["llama@23"], indirect=True)
def test_unfused_model_runs_without_a_shared_buffer(family, tmp_path):
    """Standard Attention reads the past itself: no sharing, and genai still matches HF."""
    optimized, report = epfuse.optimize_with_report(family.plain, "default")
    assert report.fused_layers == 0
    package = write_genai_package(optimized, report, tmp_path / "unfused")
    assert not package.share_buffer
    assert "read by Attention" in package.share_buffer_blocker
    assert package.config["search"]["past_present_share_buffer"] is False
    model = og.Model(str(package.directory))
    want, want_logits = hf_generate(family.hf, PROMPTS[0])
    (got,), got_logits = genai_generate(model, [PROMPTS[0]])
    _assert_same_generation(got, got_logits[0], want, want_logits, "unfused prompt")


@pytest.mark.parametrize("family", ["llama@23"], indirect=True)
def test_fused_model_also_runs_with_a_copied_cache(family, tmp_path):
    """past_present_share_buffer=false on the fused model: genai grows the cache by copying
    and GQA still reads only the first seqlens_k rows, so the batch still matches HF."""
    from epfuse.optimizer.io import load_model

    optimized = load_model(family.package.directory / "model.onnx")
    package = write_genai_package(optimized, family.report, tmp_path / "copied", share_buffer=False)
    assert package.share_buffer is False and package.share_buffer_blocker is None
    got, got_logits = genai_generate(og.Model(str(package.directory)), list(PROMPTS))
    for row, prompt in enumerate(PROMPTS):
        want, want_logits = hf_generate(family.hf, prompt)
        _assert_same_generation(
            got[row], got_logits[row], want, want_logits, f"copied-cache batch row {row}"
        )


def _python_loop(path: Path, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], float]:
    """Greedy decoding of an exported model with a plain ORT session (growing past): its
    tokens and the loop's seconds."""
    tokens, _, seconds = _export_loop(path, prompt, n)
    return tokens, seconds


def test_tokens_per_second_report(family):
    """Prints speed (never asserted); asserts only that all three paths agree on the tokens."""
    prompt = PROMPTS[0]
    # Medians of five runs, with the spread: the machine may be shared, single runs are noisy.
    plain = [_python_loop(family.plain, prompt) for _ in range(5)]
    fused = [_python_loop(family.package.directory / "model.onnx", prompt) for _ in range(5)]
    genai_generate(family.model, [prompt], logits=False)  # warm-up
    genai = []
    for _ in range(5):
        start = time.perf_counter()
        (tokens,), _ = genai_generate(family.model, [prompt], logits=False)
        genai.append((tokens, time.perf_counter() - start))

    def rate(runs) -> str:
        per_s = sorted(NEW_TOKENS / seconds for _, seconds in runs)
        return f"{per_s[len(per_s) // 2]:.0f} ({per_s[0]:.0f}-{per_s[-1]:.0f})"

    plain_tokens, fused_tokens, genai_tokens = plain[0][0], fused[0][0], genai[0][0]
    assert plain_tokens == fused_tokens == genai_tokens
    print(
        f"\n{family.name}: {NEW_TOKENS} new tokens, tokens/s median (min-max of 5): plain "
        f"export in a Python loop {rate(plain)}, optimized in a Python loop {rate(fused)}, "
        f"optimized in onnxruntime-genai {rate(genai)}"
    )


@pytest.mark.parametrize("family", ["llama@23"], indirect=True)
def test_int4_package_generates_the_unfused_int4_tokens(family, tmp_path):
    """An int4 package (--precision int4) runs in genai with the shared buffer; its greedy
    tokens are those of the unfused export quantized the same way (quantization changes them
    vs HF, fusion must not)."""
    from epfuse.optimizer.io import save_model

    optimized, report = epfuse.optimize_with_report(
        family.plain, "cpu", max_seq_len=MAX_SEQ_LEN, precision="int4"
    )
    assert report.precision["chosen"] == "int4" and report.fused_layers == 2
    package = write_genai_package(optimized, report, tmp_path / "int4")
    assert package.share_buffer
    unfused = epfuse.optimize(family.plain, "cpu", precision="int4", skip_layers={0, 1})
    save_model(unfused, tmp_path / "unfused-int4.onnx")
    want, _ = _python_loop(tmp_path / "unfused-int4.onnx", PROMPTS[0])
    (got,), _ = genai_generate(og.Model(str(package.directory)), [PROMPTS[0]], logits=False)
    assert got == want


# ---------------------------------------------------------------------------- LongRoPE
# Tiny Phi-3.5-mini / Phi-4-mini LongRoPE (switch at 16 positions): the package fuses the
# switched caches into GQA and genai runs it with the shared buffer. Hugging Face's
# ``generate`` recomputes the whole cache with the long factors when a sequence first
# crosses the switch (``Phi3ForCausalLM.prepare_inputs_for_generation``), which no KV-cache
# model does (the export, genai's own builder): up to the switch genai must give HF's tokens,
# across it the export's own greedy loop (HF's forward on its KV cache).


@pytest.fixture(scope="module", params=["phi3-longrope", "phi4-mini-longrope"])
def longrope(request, tmp_path_factory):
    from transformers import GenerationConfig

    from epfuse.testing.hf_families import LONGROPE_FAMILIES

    root = tmp_path_factory.mktemp(f"genai-{request.param}")
    config = LONGROPE_FAMILIES[request.param].make_config()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS, EOS, PAD
    plain = export_hf_decoder(config, root / "plain.onnx", opset=23, seed=0)
    hf_dir = root / "hf"
    config.save_pretrained(str(hf_dir))
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(
        str(hf_dir)
    )
    save_tiny_tokenizer(hf_dir)
    optimized, report = epfuse.optimize_with_report(plain, "cpu", max_seq_len=64)
    package = write_genai_package(optimized, report, root / "genai", hf_config_dir=hf_dir)
    return config, plain, package, report, og.Model(str(package.directory))


def _export_loop(path: Path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens and per-step logits of the export in a plain ORT loop (growing past),
    and the seconds the loop took (the session is made before the clock starts)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values")]
    past = [np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts]
    ids, total, tokens, logits = np.array([prompt], np.int64), len(prompt), [], []
    start = time.perf_counter()
    for _ in range(n):
        feed = {
            "input_ids": ids,
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(total - ids.shape[1], total, dtype=np.int64)[None],
            **{i.name: p for i, p in zip(pasts, past, strict=True)},
        }
        out = session.run(None, feed)
        logits.append(out[0][0, -1])
        tokens.append(int(logits[-1].argmax()))
        past, ids, total = out[1:], np.array([[tokens[-1]]], np.int64), total + 1
    return tokens, np.stack(logits), time.perf_counter() - start


def test_longrope_package_generates_across_the_switch(longrope):
    from epfuse.testing.hf_families import LONGROPE_ORIGINAL_MAX

    config, plain, package, report, model = longrope
    assert report.fused_layers == 2
    assert all("LongRoPE caches chosen per call" in layer.notes[0] for layer in report.layers)
    assert package.share_buffer and package.share_buffer_blocker is None
    prompt = PROMPTS[0]  # 11 tokens: 5 new ones reach the switch, 32 go well past it
    below = LONGROPE_ORIGINAL_MAX - len(prompt)
    want, want_logits = hf_generate(hf_model(config, 0), prompt, below)
    (got,), got_logits = genai_generate(model, [prompt], below)
    _assert_same_generation(got, got_logits[0], want, want_logits, "up to the switch")
    want, want_logits, _ = _export_loop(plain, prompt, NEW_TOKENS)
    (got,), got_logits = genai_generate(model, [prompt], NEW_TOKENS)
    _assert_same_generation(got, got_logits[0], want, want_logits, "across the switch")
