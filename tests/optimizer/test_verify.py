"""Tests of the equivalence harness (epfuse.optimizer.verify) on the bundled example model."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from epfuse.examples import EXAMPLE_MODEL
from epfuse.optimizer.verify import (
    SCENARIOS,
    Scenario,
    assert_equivalent,
    compare_models,
    discover_io,
)
from epfuse.tolerances import TOLERANCES, Tolerance


@pytest.fixture(scope="module")
def example() -> onnx.ModelProto:
    return onnx.load(str(EXAMPLE_MODEL))


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model.SerializeToString())


def _perturb_initializer(model: onnx.ModelProto, name_part: str, index: int, delta: float):
    model = _copy(model)
    (init,) = [t for t in model.graph.initializer if name_part in t.name]
    arr = numpy_helper.to_array(init).copy()
    arr.flat[index] += delta
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    return model


def test_discover_io(example):
    io = discover_io(example)
    assert io.input_ids == "input_ids"
    assert io.attention_mask == "attention_mask"
    assert io.position_ids == "position_ids"
    assert io.logits == "logits"
    assert io.dtype == "float32"
    assert io.vocab_size == 256
    assert [(s.past, s.present) for s in io.kv] == [
        (f"past_key_values.{layer}.{kv}", f"present.{layer}.{kv}")
        for layer in range(2)
        for kv in ("key", "value")
    ]
    assert {(s.num_kv_heads, s.head_dim) for s in io.kv} == {(2, 16)}


def test_self_comparison_passes():
    result = compare_models(EXAMPLE_MODEL, EXAMPLE_MODEL)
    assert result.passed, str(result)
    assert [s.name for s in result.scenarios] == list(SCENARIOS)
    assert result.tolerance == TOLERANCES["float32"]
    for scenario in result.scenarios:
        assert scenario.skipped is None and scenario.error is None
        # logits (one per decode step in padded_decode) + 4 presents: bit-identical
        logits = 2 if scenario.name == "padded_decode" else 1
        assert len(scenario.comparisons) == logits + 4
        assert all(c.max_abs_err == 0.0 for c in scenario.comparisons)
    text = str(result)
    assert "PASSED" in text
    for name in SCENARIOS:
        assert name in text


def test_reported_shapes_follow_scenario_lengths():
    result = compare_models(
        EXAMPLE_MODEL,
        EXAMPLE_MODEL,
        prompt_len=20,
        decode_past_len=11,
        chunk_past_len=9,
        chunk_len=4,
        padded_lens=(20, 3),
    )
    assert result.passed, str(result)
    shapes = {s.name: {c.output: c.shape for c in s.comparisons} for s in result.scenarios}
    assert shapes["prompt"]["logits"] == (2, 20, 256)
    assert shapes["prompt"]["present.0.key"] == (2, 2, 20, 16)
    assert shapes["decode"]["logits"] == (2, 1, 256)
    assert shapes["decode"]["present.1.value"] == (2, 2, 12, 16)
    assert shapes["chunk"]["logits"] == (1, 4, 256)
    assert shapes["chunk"]["present.0.value"] == (1, 2, 13, 16)
    assert shapes["padded"]["logits"] == (2, 20, 256)


def test_dropped_attention_mask_fails_where_masking_matters(example):
    """Layer 0's Attention loses its (causal + padding) mask input.

    Single-token decode with an unpadded past needs no mask, so it still passes; every
    scenario with several new tokens must fail, on the logits and on layer 1's K/V, and so
    must decode after a padded prompt (the padding slots become visible).
    """
    broken = _copy(example)
    attention = next(n for n in broken.graph.node if n.op_type == "Attention")
    assert len(attention.input) == 4
    del attention.input[3]

    result = compare_models(example, broken)
    assert not result.passed
    assert result.failed_scenarios() == ["prompt", "chunk", "padded", "padded_decode"]
    prompt = {c.output: c for c in result.scenario("prompt").comparisons}
    assert not prompt["logits"].passed and prompt["logits"].max_abs_err > 0.1
    assert prompt["present.0.key"].passed and prompt["present.0.value"].passed
    assert not prompt["present.1.key"].passed

    with pytest.raises(AssertionError) as info:
        assert_equivalent(example, broken)
    message = str(info.value)
    assert "FAILED" in message and "prompt" in message and "FAIL" in message


def test_realistic_weight_change_fails(example):
    # One element of layer 1's post-attention RMSNorm weight (~1 +- 0.1) moved by 0.05.
    changed = _perturb_initializer(example, "layers.1.post_attention_layernorm", 7, 0.05)
    result = compare_models(example, changed)
    assert result.failed_scenarios() == list(SCENARIOS)
    for scenario in result.scenarios:
        by_name = {c.output: c for c in scenario.comparisons}
        assert not by_name["logits"].passed
        # The norm sits after attention: the K/V cache is untouched.
        assert all(c.passed for c in scenario.comparisons if c.kind == "kv")


def test_rounding_level_change_passes(example):
    # A change at fp32 reordering scale must not fail (the tolerance is not absurdly tight).
    changed = _perturb_initializer(example, "layers.1.post_attention_layernorm", 7, 1e-6)
    result = compare_models(example, changed)
    assert result.passed, str(result)
    assert 0 < max(c.max_abs_err for s in result.scenarios for c in s.comparisons) < 1e-5


def test_tolerance_override(example):
    changed = _perturb_initializer(example, "layers.1.post_attention_layernorm", 7, 1e-6)
    result = compare_models(example, changed, tolerance=Tolerance(atol=1e-9, rtol=0.0))
    assert not result.passed


def test_optimized_model_that_does_not_load_is_a_failure(example):
    broken = _copy(example)
    node = next(n for n in broken.graph.node if n.op_type == "Attention")
    node.op_type, node.domain = "NoSuchAttention", "com.example"
    broken.opset_import.append(helper.make_opsetid("com.example", 1))
    result = compare_models(example, broken)
    assert not result.passed
    assert all(s.error and "failed to load" in s.error for s in result.scenarios)
    assert "failed to load" in str(result)


def _no_cache_model(scale: float = 1.0, elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """logits = Embedding(input_ids) @ W, masked by attention_mask: no past, no presents."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((32, 8)).astype(np.float32)
    proj = (rng.standard_normal((8, 32)) * scale).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
        helper.make_node("MatMul", ["h", "proj"], ["raw"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axis"], ["m3"]),
        helper.make_node("Mul", ["raw", "m3"], ["masked"]),
        helper.make_node("Cast", ["masked"], ["logits"], to=elem_type),
    ]
    graph = helper.make_graph(
        nodes,
        "no_cache",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("logits", elem_type, ["batch", "seq", 32])],
        initializer=[
            numpy_helper.from_array(emb, "emb"),
            numpy_helper.from_array(proj, "proj"),
            numpy_helper.from_array(np.array([-1], np.int64), "axis"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_model_without_cache_compares_prompt_logits():
    model = _no_cache_model()
    result = compare_models(model, model)
    assert result.passed, str(result)
    assert result.scenario("decode").skipped and result.scenario("chunk").skipped
    assert [c.output for c in result.scenario("prompt").comparisons] == ["logits"]
    assert "skipped" in str(result)

    result = compare_models(model, _no_cache_model(scale=1.001))
    assert result.failed_scenarios() == ["prompt", "padded"]


def test_bfloat16_outputs_are_compared_in_float32():
    model = _no_cache_model(elem_type=TensorProto.BFLOAT16)
    result = compare_models(model, model)
    assert result.dtype == "bfloat16"
    assert result.tolerance == TOLERANCES["bfloat16"]
    assert result.passed, str(result)


def test_an_onnx_ir_model_is_compared_without_being_changed():
    # verify reads the onnx_ir model it is given; the float32 boundary goes on a copy.
    model = ir.serde.deserialize_model(_no_cache_model(elem_type=TensorProto.BFLOAT16))
    nodes = len(model.graph)
    result = compare_models(model, model)
    assert result.passed, str(result)
    assert [v.dtype for v in model.graph.outputs] == [ir.DataType.BFLOAT16]
    assert len(model.graph) == nodes


def test_unknown_scenario_rejected():
    with pytest.raises(ValueError, match="unknown scenarios"):
        compare_models(EXAMPLE_MODEL, EXAMPLE_MODEL, scenarios=("prefill",))


def test_explicit_scenarios_set_batch_and_lengths():
    scenarios = [
        Scenario.prompt((5, 1, 3)),
        Scenario.continuation(3, 4, 1),
        Scenario.continuation(1, 0, 2),
        Scenario.continuation(1, 1, 4),
        Scenario.padded_decode((1, 4), steps=3),
    ]
    result = compare_models(EXAMPLE_MODEL, EXAMPLE_MODEL, scenarios=scenarios)
    assert result.passed, str(result)
    shapes = {
        s.name: [(c.output, c.shape, c.note) for c in s.comparisons] for s in result.scenarios
    }
    assert ("logits", (3, 5, 256), "") in shapes["prompt[5, 1, 3]"]
    assert ("logits", (3, 1, 256), "") in shapes["decode[b=3,past=4,new=1]"]
    assert ("present.0.key", (1, 2, 2, 16), "") in shapes["chunk[b=1,past=0,new=2]"]
    assert ("present.0.key", (1, 2, 5, 16), "") in shapes["chunk[b=1,past=1,new=4]"]
    padded = shapes["padded_decode[1, 4]x3"]
    assert [note for name, _, note in padded if name == "logits"] == ["step 1", "step 2", "step 3"]
    assert ("present.1.value", (2, 2, 7, 16), "prompt rows") in padded


def test_scenario_arguments_are_checked():
    with pytest.raises(ValueError, match="lens"):
        Scenario.prompt(())
    with pytest.raises(ValueError, match="lens"):
        Scenario.padded_decode((0, 2))
    with pytest.raises(ValueError, match="new_len"):
        Scenario.continuation(1, 2, 0)


def test_padded_decode_skips_when_the_original_depends_on_padding_slots():
    """A sliding window counted over cache slots (HF's torch23 form) sees the prompt's padding:
    a padded row then differs from the same row alone, so the scenario is out of contract."""
    from model_builder import DecoderConfig, build_decoder

    model = build_decoder(DecoderConfig(sliding_window=3, layers=1))
    result = compare_models(model, model, scenarios=[Scenario.padded_decode((6, 2))])
    (scenario,) = result.scenarios
    assert scenario.skipped and "differs from the row run alone" in scenario.skipped
    # Within the window the slots do not matter and the scenario runs.
    result = compare_models(model, model, scenarios=[Scenario.padded_decode((2, 1), steps=1)])
    assert result.scenarios[0].skipped is None and result.passed


def test_position_feed_extension_point_for_3d_positions(example):
    """Text-only positions for an mRoPE model's (3, batch, seq) input: all sections equal."""
    import dataclasses

    from epfuse.optimizer.verify import position_feed

    io = discover_io(example)
    assert not io.position_streams
    positions = np.array([[0, 1, 2], [5, 6, 7]])
    assert position_feed(io, positions).shape == (2, 3)
    fed = position_feed(dataclasses.replace(io, position_streams=True), positions)
    assert fed.shape == (3, 2, 3) and fed.dtype == np.int64
    assert all((fed[i] == positions).all() for i in range(3))


def test_carried_states_are_fed_and_compared(example):
    """A hybrid stack's conv/recurrent states: zeros on a prompt, the original's own states to
    continue, compared in full. A wrong state update is invisible on a first prompt (zeros)
    and caught once a real state is fed."""
    from model_builder import with_carried_state

    original = with_carried_state(example)
    io = discover_io(original)
    assert [(s.past, s.present, s.shape) for s in io.states] == [
        ("past_key_values.2.state", "present.2.state", (8, 3)),
        ("past_key_values.3.state", "present.3.state", (2, 4, 4)),
    ]
    result = compare_models(original, original)
    assert result.passed, str(result)
    compared = {c.output for s in result.scenarios for c in s.comparisons if c.kind == "state"}
    assert compared == {"present.2.state", "present.3.state"}

    broken = _copy(original)
    (half,) = [t for t in broken.graph.initializer if t.name == "_half"]
    half.CopyFrom(numpy_helper.from_array(np.array(0.6, np.float32), "_half"))
    result = compare_models(original, broken, scenarios=["prompt", "decode"])
    assert result.scenario("prompt").passed
    assert not result.scenario("decode").passed
