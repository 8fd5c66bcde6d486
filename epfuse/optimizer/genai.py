"""Package an optimized model for onnxruntime-genai: ``model.onnx`` + ``genai_config.json``.

onnxruntime-genai drives a decoder through the names and sizes in ``genai_config.json``
(the schema its own builder, ``onnxruntime_genai.models.builder``, writes). With
``search.past_present_share_buffer`` it allocates each layer's KV cache once, at
``(batch, kv_heads, max_length, head_size)``, and binds the same buffer as ``past_*`` input
and ``present_*`` output. That is only correct when every past tensor is read by nothing but
the past input of a ``GroupQueryAttention`` whose present output is the matching graph output:
GQA then writes the new K/V in place at ``seqlens_k`` and never reads the buffer's length.
Any other reader (a ``Shape`` of the past, a ``Concat``, a standard ``Attention``) would see
``max_length`` instead of the past length, so :func:`share_buffer_blocker` checks exactly this
on the graph and the config only asks for sharing when nothing blocks it.

``total_sequence_length`` for GQA is ``Shape(attention_mask)[1]`` (built by the GQA lowering);
genai feeds the mask at the current total length in both modes, so no post-pass is needed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import onnx_ir as ir

from epfuse.capabilities import EPCapabilities, get_ep
from epfuse.errors import ConfigError, OutputError, UnsupportedModelError
from epfuse.patterns.analysis.head_counts import HeadCounts, count_heads
from epfuse.patterns.analysis.signature import DecoderSignature
from epfuse.patterns.base import AttentionFacts

from .io import check_output, reason, save_model, write_text
from .report import Report

CONFIG_NAME = "genai_config.json"

# genai's session_options.provider_options names (from its builder and runtime strings).
_GENAI_PROVIDERS = {
    "cuda": "cuda",
    "dml": "dml",
    "webgpu": "webgpu",
    "trt-rtx": "NvTensorRtRtx",
    "qnn": "qnn",
    "openvino": "OpenVINO",
}

# Files onnxruntime-genai reads for its tokenizer, copied when a Hugging Face folder is given.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)

_GQA = ("com.microsoft", "GroupQueryAttention")


@dataclasses.dataclass
class KVNames:
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    num_layers: int

    def layer(self, index: int) -> tuple[str, str, str, str]:
        return (
            self.past_key % index,
            self.past_value % index,
            self.present_key % index,
            self.present_value % index,
        )


@dataclasses.dataclass
class GenaiPackage:
    """What :func:`write_genai_package` wrote and decided."""

    directory: Path
    config: dict[str, Any]
    share_buffer: bool
    share_buffer_blocker: str | None
    """Why the KV buffer cannot be shared (None when it is shared)."""
    copied: list[str]


def _template(names: list[str], what: str) -> str:
    """The ``%d`` template that writes ``names[i]`` from layer ``i`` (genai's config names
    each cache kind by one template)."""
    common: set[str] | None = None
    for layer, name in enumerate(names):
        found = {
            name[: m.start()] + "%d" + name[m.end() :]
            for m in re.finditer(r"\d+", name)
            if int(m.group()) == layer
        }
        common = found if common is None else common & found
    if not common or len(common) != 1:
        raise UnsupportedModelError(
            f"cannot find one {what} name template with the layer number "
            f"(names: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        )
    return next(iter(common))


def kv_names(model: ir.Model, signature: DecoderSignature | None = None) -> KVNames:
    """The past/present name templates genai needs (``past_key_values.%d.key`` ...), for the
    caches :class:`DecoderSignature` finds (by consumer, not by name) in layer order."""
    sig = signature or DecoderSignature.of(model)
    layers = sig.layers
    if not layers:
        raise UnsupportedModelError(
            f"cannot pair the {len(sig.cache)} past inputs into per-layer keys and values"
        )
    if any(c.present is None for pair in layers for c in pair):
        raise UnsupportedModelError("a past input has no present output")
    columns = {
        "past key": [k.past.name for k, _ in layers],
        "past value": [v.past.name for _, v in layers],
        "present key": [k.present.name for k, _ in layers],
        "present value": [v.present.name for _, v in layers],
    }
    return KVNames(*(_template(names, what) for what, names in columns.items()), len(layers))


def hybrid_blocker(sig: DecoderSignature) -> None:
    """Refuse a hybrid stack (conv/recurrent state carried between steps) in one line.

    onnxruntime-genai 0.18 runs such models only in the layout its own builder writes (per-layer
    ``layer_types``, conv/recurrent state groups, a conv window of kernel - 1 columns where
    Hugging Face keeps kernel), none of which this packager writes or has been run against.
    """
    if sig.states:
        names = ", ".join(st.past.name for st in sig.states[:2])
        more = ", ..." if len(sig.states) > 2 else ""
        raise UnsupportedModelError(
            f"hybrid model ({len(sig.states)} conv/recurrent state inputs: {names}{more}): "
            "onnxruntime-genai needs its own hybrid support (its builder's state layout), "
            "which --genai does not write; the optimized model runs in onnxruntime as is"
        )


def share_buffer_blocker(model: ir.Model, names: KVNames | None = None) -> str | None:
    """Why past and present cannot share one buffer in ``model``, or None when they can.

    Sharing is safe when, in every layer, the past key/value inputs are read only as inputs
    3/4 of one GroupQueryAttention (or by a ``Shape`` of axes other than the sequence) and
    its outputs 1/2 are the present key/value outputs.
    """
    names = names or kv_names(model)
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    for layer in range(names.num_layers):
        past_k, past_v, present_k, present_v = names.layer(layer)
        gqa = None
        for name, index in ((past_k, 3), (past_v, 4)):
            value = inputs[name]
            for use in value.uses():
                node = use.node
                if _reads_no_sequence_axis(node):
                    continue  # batch, heads or head size: the same in the shared buffer
                if (node.domain, node.op_type) != _GQA:
                    return (
                        f"{name} is read by {node.op_type} {node.name!r}, not only by "
                        "GroupQueryAttention (the attention of this layer was not fused, or "
                        "the graph reads the past length)"
                    )
                if use.idx != index:
                    return f"{name} feeds GroupQueryAttention input {use.idx}, not {index}"
                if gqa is not None and node is not gqa:
                    return f"{name} feeds more than one GroupQueryAttention"
                gqa = node
            if not any((u.node.domain, u.node.op_type) == _GQA for u in value.uses()):
                return f"{name} is not read by a GroupQueryAttention"
        assert gqa is not None
        for name, index in ((present_k, 1), (present_v, 2)):
            value = outputs[name]
            if value.producer() is not gqa or value.index() != index:
                return f"{name} is not output {index} of the GroupQueryAttention reading the past"
    return None


_GENAI_TYPES = {"hunyuan_v1_dense": "hunyuandensev1", "gpt_oss": "gptoss"}
"""Hugging Face ``model_type`` -> genai's ``model.type`` where they are spelled differently
(genai's builder writes the architecture name without ``For...``, lowercased:
``HunYuanDenseV1ForCausalLM`` -> ``hunyuandensev1``); genai 0.18 refuses other spellings
(``Unsupported model_type in config.json: hunyuan_v1_dense``)."""


def _reads_no_sequence_axis(node: ir.Node) -> bool:
    """A ``Shape(past, start, end)`` whose slice leaves out axis 2: the shared buffer
    (batch, kv_heads, max_length, head_size) differs from the past only on that axis
    (dynamo exports read the batch size off a past: ``Shape(past, 0, 1)``)."""
    if (node.domain, node.op_type) != ("", "Shape"):
        return False
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", 4)
    start, end = (i + 4 if i < 0 else i for i in (start, end))
    return not start <= 2 < end


def _dim(value: ir.Value, axis: int) -> int | None:
    if value.shape is None or len(value.shape) <= axis:
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"{path}: not a JSON file ({first})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# config.json keys that say what the decoder is; one at least must be there.
_STRUCTURE_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "hidden_size",
    "head_dim",
)


def check_hf_config(hf_config_dir: str | Path) -> dict[str, Any]:
    """The (text) config of a Hugging Face folder, or ConfigError when it is not JSON or
    describes no decoder; :func:`genai_config` then checks it against the graph."""
    path = Path(hf_config_dir) / "config.json"
    hf = _read_json(path)
    text = hf.get("text_config", hf)
    if not isinstance(text, dict) or not any(k in text for k in _STRUCTURE_KEYS):
        raise ConfigError(
            f"{path}: describes no decoder (none of {', '.join(_STRUCTURE_KEYS)}); "
            "pass the folder of this model's Hugging Face config"
        )
    return text


def _embedding_width(ids: ir.Value) -> int | None:
    """Hidden size from the token embedding: a Gather of a 2-D constant by the token ids."""
    for user, _ in ids.uses():
        if user.op_type == "Gather" and user.inputs[0] is not None:
            table = user.inputs[0].const_value
            if table is not None and len(table.shape) == 2:
                return int(table.shape[1])
    return None


def _check_against_graph(path: str, text: dict[str, Any], found: dict[str, int | None]) -> None:
    """Refuse a config.json that contradicts what the graph itself says."""
    wrong = [
        f"{key} {text[key]} (the graph has {value})"
        for key, value in found.items()
        if value is not None and key in text and text[key] is not None and text[key] != value
    ]
    if wrong:
        raise ConfigError(
            f"{path}: does not describe this model: {'; '.join(wrong)}"
            " (pass the Hugging Face folder this model was exported from)"
        )


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value) if value is not None else None


def genai_config(
    model: ir.Model,
    report: Report | None,
    ep: str | EPCapabilities = "cpu",
    *,
    hf_config_dir: str | Path | None = None,
    filename: str = "model.onnx",
    share_buffer: bool | None = None,
) -> tuple[dict[str, Any], str | None]:
    """``(genai_config, share_buffer_blocker)`` for ``model`` as its builder would write it.

    ``share_buffer`` None asks for sharing exactly when :func:`share_buffer_blocker` finds
    nothing against it; True raises when something does.
    """
    record = get_ep(ep)
    graph = model.graph
    sig = DecoderSignature.of(model)
    hybrid_blocker(sig)
    names = kv_names(model, sig)
    blocker = share_buffer_blocker(model, names)
    if share_buffer and blocker:
        raise UnsupportedModelError(f"past and present cannot share one buffer: {blocker}")
    share = blocker is None if share_buffer is None else share_buffer

    hf = _read_json(Path(hf_config_dir) / "config.json") if hf_config_dir else {}
    text = hf.get("text_config", hf)
    if hf_config_dir:
        check_hf_config(hf_config_dir)
    gen = _read_json(Path(hf_config_dir) / "generation_config.json") if hf_config_dir else {}

    io_inputs: dict[str, str] = {}
    if sig.tokens is None or sig.token_kind != "ids":
        raise UnsupportedModelError("the model has no input_ids input")
    io_inputs["input_ids"] = sig.tokens.name
    if sig.attention_mask is not None:
        io_inputs["attention_mask"] = sig.attention_mask.name
    if sig.position_ids is not None:
        io_inputs["position_ids"] = sig.position_ids.name
    io_inputs["past_key_names"] = names.past_key
    io_inputs["past_value_names"] = names.past_value
    if sig.logits is None:
        raise UnsupportedModelError("the model has no logits output")
    logits = sig.logits

    first_key = sig.layers[0][0]
    kv_heads, head_size = first_key.num_heads, first_key.head_size
    gqa = [n for n in graph if (n.domain, n.op_type) == _GQA]
    facts = _fused_facts(report)
    heads = graph_heads = None
    if facts:  # what the optimizer fused, as its report states it
        heads = graph_heads = facts[0].num_heads
    elif gqa:  # a model without epfuse's report (a genai or mobius build)
        heads = graph_heads = gqa[0].attributes["num_heads"].value
    else:
        heads = text.get("num_attention_heads")
        attention = [n for n in graph if (n.domain, n.op_type) == ("", "Attention")]
        if attention:
            found = count_heads(attention[0])
            if isinstance(found, HeadCounts):
                heads = graph_heads = found.q_heads
    kv_heads = kv_heads or text.get("num_key_value_heads")
    head_size = head_size or text.get("head_dim")
    if not all(isinstance(x, int) for x in (heads, kv_heads, head_size)):
        raise UnsupportedModelError(
            "cannot tell head counts and head size from the graph (pass hf_config_dir)"
        )
    if hf_config_dir:
        _check_against_graph(
            str(Path(hf_config_dir) / "config.json"),
            text,
            {
                "num_attention_heads": graph_heads,
                "num_key_value_heads": first_key.num_heads,
                "head_dim": first_key.head_size,
                "num_hidden_layers": names.num_layers,
                "vocab_size": sig.vocab_size,
                "hidden_size": _embedding_width(sig.tokens),
            },
        )
    vocab = sig.vocab_size or text.get("vocab_size")

    context = _context_length(gqa, report, text, facts)

    ids = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = gen.get(key, text.get(key))
        ids[key] = value
    eos = ids["eos_token_id"]
    pad = _first_id(ids["pad_token_id"])
    if pad is None and eos is not None:
        pad = _first_id(eos)  # as genai's builder does for models without a pad token
    provider_options = []
    if record.name in _GENAI_PROVIDERS:
        provider_options.append({_GENAI_PROVIDERS[record.name]: {}})
    model_type = str(text.get("model_type") or hf.get("model_type") or "llama")
    model_type = _GENAI_TYPES.get(model_type, model_type)
    config = {
        "model": {
            "bos_token_id": _first_id(ids["bos_token_id"]),
            "context_length": context,
            "decoder": {
                "session_options": {
                    "log_id": "onnxruntime-genai",
                    "provider_options": provider_options,
                },
                "filename": filename,
                "head_size": head_size,
                "hidden_size": int(text.get("hidden_size") or heads * head_size),
                "inputs": io_inputs,
                "outputs": {
                    "logits": logits.name,
                    "present_key_names": names.present_key,
                    "present_value_names": names.present_value,
                },
                "num_attention_heads": heads,
                "num_hidden_layers": names.num_layers,
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": model_type,
            "vocab_size": vocab,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": share,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config["model"][key] is None:
            # genai rejects null; absent, it uses its defaults (eos and pad 0).
            del config["model"][key]
    return config, blocker


def _fused_facts(report: Report | None) -> list[AttentionFacts]:
    """The facts of the layers the report says were fused (none without a report)."""
    if report is None:
        return []
    return [layer.facts for layer in report.layers if layer.fused and layer.facts is not None]


def _context_length(
    gqa: list[ir.Node], report: Report | None, text: dict[str, Any], facts: list[AttentionFacts]
) -> int:
    """Rows of the fused cos/sin caches (GQA rejects longer sequences); else the model's limit.
    The rows are the report's facts where it has them, else read off the GQA nodes."""
    if facts:
        rows = [f.rotary_cache_rows for f in facts if f.rotary_cache_rows]
    else:
        rows = [
            _dim(n.inputs[7], 0)
            for n in gqa
            if len(n.inputs) > 7 and n.inputs[7] is not None and _dim(n.inputs[7], 0)
        ]
    if rows:
        return min(rows)
    limits = [text.get("max_position_embeddings")]
    if report is not None:
        limits.append(report.options.get("max_seq_len"))
    limits = [int(x) for x in limits if x]
    if not limits:
        raise UnsupportedModelError("cannot tell the context length (pass hf_config_dir)")
    return min(limits)


def write_genai_package(
    model: ir.Model,
    report: Report | None,
    outdir: str | Path,
    *,
    hf_config_dir: str | Path | None = None,
    ep: str | EPCapabilities | None = None,
    filename: str = "model.onnx",
    share_buffer: bool | None = None,
    protected: dict[Path, str] | None = None,
) -> GenaiPackage:
    """Write ``outdir/model.onnx``, ``outdir/genai_config.json`` and the tokenizer files.

    ``ep`` defaults to the report's EP. Tokenizer files (and ``generation_config.json``) are
    copied from ``hf_config_dir`` when given; genai cannot load a model folder without a
    tokenizer, but a caller feeding token ids directly does not need one. ``protected``:
    files (resolved) that must not be written over (the input's, see ``io.files_read``).
    """
    if ep is None:
        ep = report.ep if report is not None else "cpu"
    config, blocker = genai_config(
        model, report, ep, hf_config_dir=hf_config_dir, filename=filename, share_buffer=share_buffer
    )
    outdir = Path(outdir)
    protected = dict(protected or {})
    check_output(outdir, protected, directory=True)
    copies = []
    if hf_config_dir is not None:
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            source = Path(hf_config_dir) / name
            if source.is_file() and source.resolve() != (outdir / name).resolve():
                copies.append(name)
    for name in (CONFIG_NAME, *copies):
        check_output(outdir / name, protected)
    outdir.mkdir(parents=True, exist_ok=True)
    save_model(model, outdir / filename, protected=protected)
    write_text(outdir / CONFIG_NAME, json.dumps(config, indent=4) + "\n")
    copied = []
    for name in copies:
        try:
            shutil.copyfile(Path(hf_config_dir) / name, outdir / name)
        except OSError as err:
            raise OutputError(f"cannot write {outdir / name}: {reason(err)}") from None
        copied.append(name)
    share = config["search"]["past_present_share_buffer"]
    return GenaiPackage(outdir, config, share, blocker, copied)
