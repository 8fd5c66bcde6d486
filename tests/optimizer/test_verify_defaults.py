"""``epfuse verify`` with default arguments: lengths read from both graphs (windows, length
thresholds, position limits), roles found by shape and consumer, one-line failures."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import TensorProto, helper, numpy_helper

import epfuse
from epfuse.optimizer.cli import EXIT_NOT_EQUIVALENT, main
from epfuse.optimizer.verify import compare_models, discover_io
from epfuse.optimizer.verify.limits import Limits, default_lengths, read_limits

W = 8  # longer than the historical default prompt (7)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model.SerializeToString())


def _no_window(model: onnx.ModelProto) -> onnx.ModelProto:
    model = _copy(model)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for a in node.attribute:
                if a.name == "local_window_size":
                    a.i = -1
    return model


def _rename_input(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    model = _copy(model)
    for vi in model.graph.input:
        if vi.name == old:
            vi.name = new
    for node in model.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
    return model


@pytest.mark.parametrize("style", ["torch23", "torch18", "mobius"])
def test_windows_are_read_from_both_graphs(style):
    original = build_decoder(DecoderConfig(style=style, sliding_window=W, layers=2))
    optimized = epfuse.optimize(original, "cpu")
    from_original = read_limits(original)
    assert set(from_original.windows) == {W}  # the export's mask, proven by evaluation
    assert all("evaluated" in w for w in from_original.windows[W])
    both = read_limits(original, optimized)
    assert any("local_window_size" in w for w in both.windows[W])
    lengths = default_lengths(both)
    assert lengths["prompt_len"] > W + 1 and lengths["chunk_past_len"] + 3 > W + 1
    assert both.max_positions is not None  # cos/sin cache rows


@pytest.mark.parametrize(
    "cfg",
    [
        DecoderConfig(style="torch23", sliding_window=W, layers=2),  # Mistral-like
        DecoderConfig(style="torch23", sliding_window=W, softcap=5.0, layers=2),  # Gemma-2
    ],
    ids=["mistral", "gemma2"],
)
def test_default_lengths_catch_a_dropped_window(cfg):
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    assert compare_models(original, optimized).passed
    failed = compare_models(original, _no_window(optimized)).failed_scenarios()
    assert {"prompt", "decode", "chunk"} <= set(failed)


def test_a_builder_that_dropped_the_mask_window_is_caught(tmp_path, capsys):
    """A mobius-like build of the same weights without the window in its mask."""
    cfg = DecoderConfig(style="torch23", sliding_window=W, softcap=5.0, layers=2)
    original = build_decoder(cfg)
    honest = build_decoder(DecoderConfig(**{**cfg.__dict__, "style": "mobius"}))
    dropped = build_decoder(
        DecoderConfig(**{**cfg.__dict__, "style": "mobius", "sliding_window": None})
    )
    for name, model in (("a", original), ("honest", honest), ("dropped", dropped)):
        onnx.save(model, tmp_path / f"{name}.onnx")
    assert main(["verify", str(tmp_path / "a.onnx"), str(tmp_path / "honest.onnx")]) == 0
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "a.onnx"), str(tmp_path / "dropped.onnx")])
    assert code == EXIT_NOT_EQUIVALENT
    out = capsys.readouterr().out
    assert f"lengths: sliding window {W}" in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL (prompt")


def test_length_threshold_is_passed():
    """A LongRoPE-like switch (Greater(seq_len, 20)) makes the prompt longer than 20."""
    model = build_decoder(DecoderConfig(style="mobius", layers=1))
    g = model.graph
    g.initializer.append(numpy_helper.from_array(np.array(20, np.int64), "orig_max"))
    g.node.extend(
        [
            helper.make_node("Shape", ["input_ids"], ["thr_shape"], start=1, end=2),
            helper.make_node("Greater", ["thr_shape", "orig_max"], ["thr_long"]),
        ]
    )
    g.output.append(helper.make_tensor_value_info("thr_long", TensorProto.BOOL, [1]))
    limits = read_limits(model)
    assert 20 in limits.thresholds
    assert default_lengths(limits)["prompt_len"] > 20


def test_padded_decode_stays_below_a_threshold():
    """Both sides of a length threshold run by default: the prompt, decode and chunk above
    it, the padded decode (each model its own prompt, then 2 steps) at or below it. With a
    sliding window the padded decode keeps the prompt's lengths (beyond the window)."""
    lengths = default_lengths(Limits(thresholds={20: ["x"]}), steps=2)
    assert lengths["prompt_len"] > 20
    below = lengths["padded_decode_lens"]
    assert max(below) + 2 <= 20 and len(set(below)) == 2
    windowed = default_lengths(Limits(windows={8: ["w"]}, thresholds={20: ["x"]}))
    assert "padded_decode_lens" not in windowed
    assert "padded_decode_lens" not in default_lengths(Limits(windows={8: ["w"]}))


def test_prompt_len_beyond_the_caches_is_refused(tmp_path, capsys):
    original = build_decoder(DecoderConfig(style="mobius", layers=1))
    onnx.save(original, tmp_path / "a.onnx")
    rows = read_limits(original).max_positions
    assert rows is not None
    args = ["verify", str(tmp_path / "a.onnx"), str(tmp_path / "a.onnx")]
    assert main([*args, "--prompt-len", "100000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"at most {rows}" in err[0] and "--prompt-len 100000" in err[0], err
    assert main([*args, "--prompt-len", str(rows - 2)]) == 0


@pytest.mark.parametrize("direction", ["original", "optimized"])
def test_renamed_token_input_in_either_direction(direction, tmp_path, capsys):
    original = build_decoder(DecoderConfig(style="torch23", layers=1))
    optimized = epfuse.optimize(original, "cpu")
    if direction == "original":
        original = _rename_input(original, "input_ids", "tokens")
    else:
        optimized = _rename_input(optimized, "input_ids", "tokens")
    io = discover_io(original if direction == "original" else optimized)
    assert io.input_ids == "tokens" and io.attention_mask == "attention_mask"
    onnx.save(original, tmp_path / "a.onnx")
    onnx.save(optimized, tmp_path / "b.onnx")
    assert main(["verify", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx")]) == 0
    out = capsys.readouterr().out
    assert f"matched ({direction}):" in out and "tokens=tokens" in out


def test_roles_by_consumer_not_name():
    """Every input renamed: tokens by the embedding gather, mask by its total-length dim,
    positions by the sequence dim, pasts by rank, paired in layer/key-value order."""
    model = build_decoder(DecoderConfig(style="torch23", layers=2))
    renames = {"input_ids": "a", "attention_mask": "b", "position_ids": "c"}
    for old, new in renames.items():
        model = _rename_input(model, old, new)
    io = discover_io(model)
    assert (io.input_ids, io.attention_mask, io.position_ids) == ("a", "b", "c")
    assert [s.past for s in io.kv][:2] == ["past_key_values.0.key", "past_key_values.0.value"]


def test_optimized_model_failing_to_run_is_one_line(tmp_path, capfd):
    """A kernel error in one scenario: one line naming it, and no ORT log on the terminal."""
    original = build_decoder(DecoderConfig(style="mobius", layers=1))
    broken = _copy(original)
    g = broken.graph
    (logits,) = [o for o in g.output if o.name == "logits"]
    for node in g.node:
        node.output[:] = ["logits_raw" if x == "logits" else x for x in node.output]
    # batch 2 only: the chunk scenario (batch 1) cannot reshape.
    g.initializer.append(numpy_helper.from_array(np.array([2, -1, 128], np.int64), "shape2"))
    g.node.append(helper.make_node("Reshape", ["logits_raw", "shape2"], ["logits"]))
    del logits
    onnx.save(original, tmp_path / "a.onnx")
    onnx.save(broken, tmp_path / "b.onnx")
    capfd.readouterr()
    assert main(["verify", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx")]) == 4
    captured = capfd.readouterr()
    lines = [line for line in captured.out.splitlines() if "failed to run" in line]
    assert len(lines) == 1, captured.out
    assert lines[0].startswith("optimized model failed to run in scenario chunk: ")
    assert "onnxruntime" not in captured.err.lower() and "[E:" not in captured.err


def test_skip_reasons_stay_out_of_the_table(capsys):
    original = build_decoder(DecoderConfig(style="torch23", sliding_window=3, layers=1))
    result = compare_models(original, original)
    assert result.scenario("padded_decode").skipped
    table = str(result).splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("scenario"))
    body = [line for line in table[header:] if not line.startswith("[")]
    assert max(len(line) for line in body) < 110
    assert any(line.startswith("[1] skipped: ") for line in table)
