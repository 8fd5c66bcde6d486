"""``epfuse fuzz``: hypothesis-drawn scenarios for one pair of models, shrunk failures that
replay as ``epfuse verify`` command lines, roles as verify finds them."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import onnx
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import helper

import epfuse
from epfuse.optimizer.cli import EXIT_NOT_EQUIVALENT, main
from epfuse.testing.fuzz import fuzz_models

W = 8


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model.SerializeToString())


def _no_window(model: onnx.ModelProto) -> onnx.ModelProto:
    model = _copy(model)
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "GroupQueryAttention" and a.name == "local_window_size":
                a.i = -1
    return model


def _rename(model: onnx.ModelProto, renames: dict[str, str]) -> onnx.ModelProto:
    model = _copy(model)
    for vi in [*model.graph.input, *model.graph.output]:
        vi.name = renames.get(vi.name, vi.name)
    for node in model.graph.node:
        node.input[:] = [renames.get(x, x) for x in node.input]
        node.output[:] = [renames.get(x, x) for x in node.output]
    return model


def _embeds(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same decoder taking ``inputs_embeds``: the embedding Gather's output becomes the
    input (a VLM's language model is exported this way)."""
    model = _copy(model)
    g = model.graph
    gather = next(n for n in g.node if n.op_type == "Gather" and "input_ids" in n.input)
    table = next(t for t in g.initializer if t.name == gather.input[0])
    hidden = table.dims[1]
    g.node.remove(gather)
    ids = next(vi for vi in g.input if vi.name == "input_ids")
    g.input.remove(ids)
    elem = g.output[0].type.tensor_type.elem_type
    g.input.insert(
        0, helper.make_tensor_value_info(gather.output[0], elem, ["batch", "seq", hidden])
    )
    for node in g.node:  # shape reads of input_ids (GQA's batch, exporter Shape ops)
        node.input[:] = [gather.output[0] if x == "input_ids" else x for x in node.input]
    return model


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    cfg = DecoderConfig(style="torch23", sliding_window=W, softcap=5.0, layers=2)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    root = tmp_path_factory.mktemp("fuzz")
    paths = {}
    for name, model in (("a", original), ("b", optimized), ("nowin", _no_window(optimized))):
        paths[name] = str(root / f"{name}.onnx")
        onnx.save(model, paths[name])
    return paths


def test_honest_rewrite_passes(gemma2, tmp_path, capsys):
    report = tmp_path / "fuzz.json"
    code = main(["fuzz", gemma2["a"], gemma2["b"], "--examples", "20", "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.rstrip().endswith("PASS")
    data = json.loads(report.read_text())
    assert data["passed"] and data["examples"] == 20 and data["signature"]["max_len"] > W + 1


def test_lost_window_fails_with_a_minimal_replay(gemma2, tmp_path, capsys):
    report = tmp_path / "fuzz.json"
    code = main(["fuzz", gemma2["a"], gemma2["nowin"], "--json", str(report)])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_EQUIVALENT, out
    data = json.loads(report.read_text())["failure"]
    # Minimal: one scenario, just past the window.
    assert len(data["scenarios"]) == 1
    assert "worst: logits" in out or "worst: present" in out
    replay = next(line for line in out.splitlines() if line.startswith("replay: "))
    argv = shlex.split(replay.removeprefix("replay: "))
    assert argv[:2] == ["epfuse", "verify"] and argv == shlex.split(data["replay"])
    assert main(argv[1:]) == EXIT_NOT_EQUIVALENT
    replayed = capsys.readouterr().out
    assert f"FAIL ({data['scenarios'][0]})" in replayed


def test_derandomized_by_default_and_seeded_on_request(gemma2):
    runs = [fuzz_models(gemma2["a"], gemma2["nowin"], examples=30) for _ in range(2)]
    assert runs[0].failure.scenarios == runs[1].failure.scenarios
    assert runs[0].failure.seed == runs[1].failure.seed
    seeded = fuzz_models(gemma2["a"], gemma2["nowin"], examples=30, seed=5)
    assert not seeded.passed


def test_max_len_and_budget(gemma2):
    # prompts and pasts up to 3, chunks up to 5 new tokens: no row sees more than W keys, so
    # the lost window cannot show
    short = fuzz_models(gemma2["a"], gemma2["nowin"], examples=20, max_len=W - 5)
    assert short.passed
    assert short.signature.max_len == W - 5
    spent = fuzz_models(gemma2["a"], gemma2["b"], examples=1000, budget=0.5)
    assert spent.passed and spent.budget_spent and spent.examples < 1000


def test_roles_as_verify_finds_them():
    """Renamed pasts/presents, inputs_embeds and mRoPE (3, B, S) positions."""
    cfg = DecoderConfig(style="torch23", layers=1)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    renames = {f"past_key_values.0.{kv}": f"cache_in_{kv}" for kv in ("key", "value")}
    renames |= {f"present.0.{kv}": f"cache_out_{kv}" for kv in ("key", "value")}
    assert fuzz_models(original, _rename(optimized, renames), examples=10).passed

    embeds = _embeds(original)
    result = fuzz_models(embeds, _embeds(optimized), examples=10)
    assert result.passed
    broken = _embeds(build_decoder(DecoderConfig(style="torch23", layers=1, seed=1)))
    assert not fuzz_models(embeds, broken, examples=10).passed

    mrope = build_decoder(DecoderConfig(style="mobius", positions="mrope", layers=1))
    assert fuzz_models(mrope, epfuse.optimize(mrope, "cpu"), examples=10).passed


def test_model_without_positions_or_cache():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "verify_tests", Path(__file__).with_name("test_verify.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _no_cache_model = module._no_cache_model
    model = _no_cache_model()
    result = fuzz_models(model, model, examples=10)
    assert result.passed and not result.signature.has_cache
    assert not fuzz_models(model, _no_cache_model(scale=1.01), examples=10).passed


def test_bad_arguments_are_one_line(gemma2, capsys):
    assert main(["fuzz", gemma2["a"], gemma2["b"], "--examples", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["epfuse: error: --examples must be positive"]


def test_import_epfuse_does_not_import_hypothesis():
    code = (
        "import sys, epfuse, epfuse.optimizer.cli, epfuse.optimizer.verify; "
        "assert 'hypothesis' not in sys.modules, 'hypothesis imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
