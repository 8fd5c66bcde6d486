"""Tests of the equivalence harness (epfuse.optimizer.verify) on the bundled example model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from epfuse.examples import EXAMPLE_MODEL
from epfuse.optimizer.tolerances import TOLERANCES, Tolerance
from epfuse.optimizer.verify import SCENARIOS, assert_equivalent, compare_models, discover_io


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
        # logits + 4 presents, identical models on the same EP: bit-identical
        assert len(scenario.comparisons) == 5
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
    scenario with several new tokens must fail, on the logits and on layer 1's K/V.
    """
    broken = _copy(example)
    attention = next(n for n in broken.graph.node if n.op_type == "Attention")
    assert len(attention.input) == 4
    del attention.input[3]

    result = compare_models(example, broken)
    assert not result.passed
    assert result.failed_scenarios() == ["prompt", "chunk", "padded"]
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


def test_unknown_scenario_rejected():
    with pytest.raises(ValueError, match="unknown scenarios"):
        compare_models(EXAMPLE_MODEL, EXAMPLE_MODEL, scenarios=("prefill",))
