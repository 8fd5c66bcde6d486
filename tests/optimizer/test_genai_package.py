"""genai_config.json from the optimized graph, the share-buffer check and ``epfuse optimize --genai``
on the bundled torch.onnx export (runs without onnxruntime-genai; generation is tested in
test_genai_generate.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

import epfuse
from epfuse.errors import UnsupportedModelError
from epfuse.optimizer.cli import main
from epfuse.optimizer.genai import (
    genai_config,
    kv_names,
    share_buffer_blocker,
    write_genai_package,
)


@pytest.fixture(scope="module")
def fused(example_model):
    return epfuse.optimize_with_report(example_model, "cpu")


@pytest.fixture(scope="module")
def unfused(example_model):
    return epfuse.optimize_with_report(example_model, "default")


def test_name_templates_of_a_torch_onnx_export(fused):
    names = kv_names(fused[0])
    assert (names.past_key, names.past_value) == (
        "past_key_values.%d.key",
        "past_key_values.%d.value",
    )
    assert (names.present_key, names.present_value) == ("present.%d.key", "present.%d.value")
    assert names.num_layers == 2


def test_name_templates_follow_the_graph_not_the_words(fused):
    """Keys and values are told apart by the GroupQueryAttention slot that reads them: names
    without a key/value word (and listed values first) still give the right templates."""
    model = ir.from_proto(ir.to_proto(fused[0]))
    renames = {}
    for i in range(2):
        renames[f"past_key_values.{i}.key"] = f"cache_b_{i}"  # 'b' for the key, 'a' for the value
        renames[f"past_key_values.{i}.value"] = f"cache_a_{i}"
        renames[f"present.{i}.key"] = f"state_b_{i}"
        renames[f"present.{i}.value"] = f"state_a_{i}"
    for value in [*model.graph.inputs, *model.graph.outputs]:
        value.name = renames.get(value.name, value.name)
    names = kv_names(model)
    assert (names.past_key, names.past_value) == ("cache_b_%d", "cache_a_%d")
    assert (names.present_key, names.present_value) == ("state_b_%d", "state_a_%d")
    assert names.num_layers == 2
    assert share_buffer_blocker(model, names) is None


def test_fused_graph_reads_the_past_only_through_gqa(fused):
    """After fusion the mask subgraph (which read Shape(past)) is gone: sharing is safe."""
    model = fused[0]
    assert share_buffer_blocker(model) is None
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values"):
            assert {(u.node.op_type, u.idx) for u in value.uses()} <= {
                ("GroupQueryAttention", 3),
                ("GroupQueryAttention", 4),
            }


def test_a_shape_of_the_past_blocks_sharing(example_model):
    model, _ = epfuse.optimize_with_report(example_model, "cpu")
    past = next(v for v in model.graph.inputs if v.name == "past_key_values.1.value")
    shape = ir.node("Shape", [past], name="reads_past_length")
    model.graph.append(shape)
    shape.outputs[0].name = "past_shape"
    model.graph.outputs.append(shape.outputs[0])
    reason = share_buffer_blocker(model)
    assert reason is not None and "read by Shape 'reads_past_length'" in reason


@pytest.mark.parametrize(("start", "end", "blocks"), [(0, 1, False), (3, 4, False), (2, 3, True)])
def test_only_a_shape_of_the_sequence_axis_blocks_sharing(example_model, start, end, blocks):
    """Shape(past, 0, 1) (a dynamo export reading the batch off a past) reads the same in the
    shared (batch, heads, max_length, head) buffer; a slice over axis 2 does not."""
    model, _ = epfuse.optimize_with_report(example_model, "cpu")
    past = next(v for v in model.graph.inputs if v.name == "past_key_values.1.value")
    shape = ir.node("Shape", [past], {"start": start, "end": end}, name="reads_past")
    model.graph.append(shape)
    shape.outputs[0].name = "past_shape"
    model.graph.outputs.append(shape.outputs[0])
    reason = share_buffer_blocker(model)
    assert (reason is not None) == blocks, reason
    if blocks:
        assert "read by Shape 'reads_past'" in reason


def test_genai_model_type_is_genais_spelling(fused, tmp_path):
    """genai 0.18 refuses 'hunyuan_v1_dense': the config says 'hunyuandensev1', as genai's
    builder writes it (the architecture name without ForCausalLM, lowercased)."""
    model, report = fused
    hf = {"model_type": "hunyuan_v1_dense", "num_hidden_layers": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config, _ = genai_config(model, report, "cpu", hf_config_dir=tmp_path)
    assert config["model"]["type"] == "hunyuandensev1"


def test_unfused_attention_cannot_share_and_says_why(unfused):
    model, report = unfused
    reason = share_buffer_blocker(model)
    assert "past_key_values.0.key is read by Attention" in reason
    config, blocker = genai_config(model, report, "default")
    assert blocker == reason
    assert config["search"]["past_present_share_buffer"] is False
    with pytest.raises(UnsupportedModelError, match="cannot share one buffer"):
        genai_config(model, report, "default", share_buffer=True)


def test_config_matches_the_builder_schema(fused):
    model, report = fused
    config, _ = genai_config(model, report, "cpu")
    decoder = config["model"]["decoder"]
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "position_ids": "position_ids",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (4, 2)
    assert (decoder["head_size"], decoder["num_hidden_layers"]) == (16, 2)
    assert decoder["session_options"]["provider_options"] == []
    # context length = rows of the fused cos/sin caches (GQA input 7) = report max_seq_len
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert config["model"]["context_length"] == gqa.inputs[7].shape[0]
    assert config["model"]["context_length"] == report.options["max_seq_len"]
    assert config["search"]["max_length"] == config["model"]["context_length"]
    assert config["search"]["past_present_share_buffer"] is True
    assert config["model"]["vocab_size"] == 256
    # no HF folder: unknown special tokens are left out (genai rejects null)
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & set(config["model"])


def test_provider_options_name_the_ep(fused):
    config, _ = genai_config(fused[0], fused[1], "cuda")
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]


def test_hf_folder_supplies_token_ids_and_tokenizer(tmp_path, fused):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": 64, "eos_token_id": 7})
    )
    (hf / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 5, "eos_token_id": [9, 7], "pad_token_id": 3})
    )
    (hf / "tokenizer.json").write_text("{}")
    package = write_genai_package(fused[0], fused[1], tmp_path / "out", hf_config_dir=hf)
    model = package.config["model"]
    assert (model["type"], model["bos_token_id"], model["pad_token_id"]) == ("qwen2", 5, 3)
    assert model["eos_token_id"] == [9, 7]
    assert set(package.copied) == {"tokenizer.json", "generation_config.json"}
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    written = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert written == package.config


def test_cli_writes_a_genai_folder(tmp_path, example_model, capsys):
    out = tmp_path / "pkg"
    assert main(["optimize", str(example_model), "-o", str(out), "--genai"]) == 0
    printed = capsys.readouterr().out
    assert "share one KV buffer" in printed
    config = json.loads((out / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    saved = ir.load(out / "model.onnx")
    assert sum(n.op_type == "GroupQueryAttention" for n in saved.graph) == 2


def test_cli_explains_an_unshared_buffer(tmp_path, example_model, capsys):
    out = tmp_path / "pkg"
    assert main(["optimize", str(example_model), "-o", str(out), "--genai", "--ep", "default"]) == 0
    printed = capsys.readouterr().out
    assert "cannot share one KV buffer (past_key_values.0.key is read by Attention" in printed
    assert (
        json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"]
        is False
    )


def test_cli_hf_config_needs_genai(tmp_path, example_model, capsys):
    assert main(["optimize", str(example_model), "--hf-config", str(tmp_path)]) == 1
    assert "--hf-config needs --genai" in capsys.readouterr().err
    assert main(["optimize", str(example_model), "--genai", "--hf-config", str(tmp_path)]) == 1
    assert "no config.json" in capsys.readouterr().err


def test_packaged_model_still_runs_as_plain_ort(tmp_path, fused):
    """The packaged model is the optimized model unchanged (no post-pass edits the graph)."""
    import onnxruntime as ort

    package = write_genai_package(fused[0], fused[1], tmp_path / "pkg")
    session = ort.InferenceSession(str(package.directory / "model.onnx"))
    feed = {
        "input_ids": np.array([[1, 2, 3]], np.int64),
        "attention_mask": np.ones((1, 3), np.int64),
        "position_ids": np.arange(3, dtype=np.int64)[None],
    }
    for name in (f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")):
        feed[name] = np.zeros((1, 2, 0, 16), np.float32)
    logits = session.run(["logits"], feed)[0]
    assert logits.shape == (1, 3, 256) and np.isfinite(logits).all()


def test_a_hybrid_model_is_refused_in_one_line(example_model):
    """Conv/recurrent state (a hybrid stack) needs genai's own hybrid support."""
    import onnx
    from model_builder import with_carried_state

    model = ir.from_proto(with_carried_state(onnx.load(str(example_model))))
    with pytest.raises(UnsupportedModelError, match="genai needs its own hybrid support") as err:
        genai_config(model, None, "cpu")
    assert "\n" not in str(err.value)
