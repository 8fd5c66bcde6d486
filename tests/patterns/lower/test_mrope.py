"""3-D mRoPE: MRotaryEmbedding (or per-stream caches + Where) and GQA with do_rotary=0, proven
equal to the unfused graph on ORT CPU for text-only and image-like position streams."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder, image_positions, mrope_streams

import epfuse
from epfuse.capabilities import DTYPES, all_eps, get_ep
from epfuse.optimizer.verify import assert_equivalent, compare_models
from epfuse.patterns.analysis.mrope_sections import (
    INTERLEAVED,
    SECTIONED,
    interleaved_streams,
    layout_of,
)
from epfuse.patterns.analysis.signature import probe_array

# Long enough that text follows the image in every scenario (image tokens are 2..7).
LENGTHS = dict(prompt_len=10, decode_past_len=9, chunk_past_len=6, chunk_len=4)


def _cfg(layout: str, **kw) -> DecoderConfig:
    return DecoderConfig(style="mobius", positions="mrope", mrope_layout=layout, **kw)


def _nodes(model: onnx.ModelProto, op: str):
    return [n for n in model.graph.node if n.op_type == op]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _cpu_without_mrotary():
    """The CPU record minus MRotaryEmbedding: the plain-rotation path on the same kernels."""
    return get_ep("cpu").variant("cpu-no-mrope", mrotary_embedding=False)


def _both_position_kinds(original, optimized):
    assert_equivalent(original, optimized, **LENGTHS)  # text only: T == H == W
    return assert_equivalent(original, optimized, position_streams=image_positions, **LENGTHS)


@pytest.mark.parametrize("layout", ["sectioned", "interleaved"])
def test_builder_mrope_lowers_to_mrotary_embedding(layout):
    cfg = _cfg(layout)
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rotations = _nodes(optimized, "MRotaryEmbedding")
    assert len(rotations) == 2 * cfg.layers
    for node in rotations:
        attrs = _attrs(node)
        assert attrs["mrope_section"] == list(cfg.sections)
        assert attrs["mrope_layout"] == (SECTIONED if layout == "sectioned" else INTERLEAVED)
        assert node.input[1] == "position_ids"
    gqa = _nodes(optimized, "GroupQueryAttention")
    assert len(gqa) == cfg.layers
    assert all(_attrs(n)["do_rotary"] == 0 and len(n.input) <= 7 for n in gqa)
    assert not _nodes(optimized, "Where") and not _nodes(optimized, "RotaryEmbedding")
    for layer in report.layers:
        assert "3-D mRoPE positions" in " ".join(layer.notes)
    _both_position_kinds(original, optimized)


@pytest.mark.parametrize("layout", ["sectioned", "interleaved"])
def test_plain_rotation_path_equals_mrotary_path(layout):
    original = build_decoder(_cfg(layout))
    fused = epfuse.optimize(original, "cpu")
    plain, report = epfuse.optimize_with_report(original, _cpu_without_mrotary())
    assert not _nodes(plain, "MRotaryEmbedding")
    assert len(_nodes(plain, "RotaryEmbedding")) == 4
    assert all(_attrs(n)["do_rotary"] == 0 for n in _nodes(plain, "GroupQueryAttention"))
    assert all("3-D mRoPE positions" in " ".join(layer.notes) for layer in report.layers)
    _both_position_kinds(original, plain)
    result = compare_models(fused, plain, position_streams=image_positions, **LENGTHS)
    assert result.passed, str(result)


def test_partial_rotary_and_fp16():
    cfg = _cfg("sectioned", head_dim=32, rotary_dim=16)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    for node in _nodes(optimized, "MRotaryEmbedding"):
        assert _attrs(node)["rotary_embedding_dim"] == 16
    _both_position_kinds(original, optimized)
    half = build_decoder(_cfg("interleaved", dtype="float16"))
    optimized = epfuse.optimize(half, "cpu")
    assert len(_nodes(optimized, "MRotaryEmbedding")) == 4
    _both_position_kinds(half, optimized)


def test_unrecognised_stream_mix_is_kept_with_reason():
    """Columns mixed in neither layout (T and H swapped): the rotation stays as built."""
    cfg = _cfg("sectioned")
    model = build_decoder(cfg)
    streams = mrope_streams(cfg)
    swapped = np.where(streams == 0, 1, np.where(streams == 1, 0, 2))
    for init in model.graph.initializer:
        if init.name == "mrope_is_t":
            init.CopyFrom(onnx.numpy_helper.from_array(swapped == 0, init.name))
        elif init.name == "mrope_is_h":
            init.CopyFrom(onnx.numpy_helper.from_array(swapped == 1, init.name))
    optimized, report = epfuse.optimize_with_report(model, "cpu")
    assert not _nodes(optimized, "MRotaryEmbedding")
    assert all(_attrs(n)["do_rotary"] == 0 for n in _nodes(optimized, "GroupQueryAttention"))
    mrope = next(r for r in report.rules if r.name == "mrope")
    assert mrope.kept == 4 and mrope.rewritten == 0
    for layer in report.layers:
        assert "neither the sectioned nor the interleaved" in " ".join(layer.notes)
    _both_position_kinds(model, optimized)


def _derived_positions_model(dtype: str) -> onnx.ModelProto:
    """A 1-D-RoPE builder model whose (B, S) positions are Gather(position_ids (3, B, S), 0):
    constant caches and 2-D positions, yet derived, so do_rotary=1 would be unproven."""
    model = build_decoder(DecoderConfig(style="mobius", dtype=dtype))
    graph = model.graph
    for node in graph.node:
        node.input[:] = ["derived_positions" if i == "position_ids" else i for i in node.input]
    zero = onnx.numpy_helper.from_array(np.array(0, dtype=np.int64), "stream_t")
    graph.initializer.append(zero)
    graph.node.insert(
        0,
        onnx.helper.make_node(
            "Gather", ["position_ids", "stream_t"], ["derived_positions"], axis=0
        ),
    )
    pos = next(i for i in graph.input if i.name == "position_ids")
    pos.CopyFrom(
        onnx.helper.make_tensor_value_info(
            "position_ids", onnx.TensorProto.INT64, [3, "batch", "seq"]
        )
    )
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_ep_ever_gets_do_rotary_1_from_3d_positions(dtype):
    models = {
        "sectioned": build_decoder(_cfg("sectioned", dtype=dtype)),
        "interleaved": build_decoder(_cfg("interleaved", dtype=dtype)),
        "derived": _derived_positions_model(dtype),
    }
    fused = 0
    for ep in all_eps():
        for name, model in models.items():
            optimized, report = epfuse.optimize_with_report(model, ep)
            fused += len(_nodes(optimized, "GroupQueryAttention"))
            for node in _nodes(optimized, "GroupQueryAttention"):
                assert _attrs(node).get("do_rotary", 0) == 0, (ep.name, dtype, name)
                assert len(node.input) <= 7 or not node.input[7], (ep.name, dtype, name)
            for layer in report.layers:
                if layer.result.startswith("GroupQueryAttention"):
                    notes = " ".join(layer.notes)
                    why = "computed in the graph" if name == "derived" else "3-D mRoPE positions"
                    assert why in notes, (ep.name, dtype, name, notes)
    assert fused > 0  # some EP runs GQA for every dtype: the assertions above were exercised


def test_derived_positions_stay_equal_on_cpu():
    model = _derived_positions_model("float32")
    optimized = epfuse.optimize(model, "cpu")
    assert all(_attrs(n)["do_rotary"] == 0 for n in _nodes(optimized, "GroupQueryAttention"))
    assert_equivalent(model, optimized, **LENGTHS)


def test_layout_of():
    assert layout_of(np.array([0, 0, 1, 1, 1, 2, 2, 2])) == (SECTIONED, (2, 3, 3))
    assert layout_of(np.zeros(8, dtype=np.int64)) == (SECTIONED, (8, 0, 0))
    inter = interleaved_streams(8, (2, 3, 3))  # W's third slot falls off the end: 3, 3, 2
    assert inter.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert layout_of(inter) == (INTERLEAVED, (3, 3, 2))
    assert np.array_equal(interleaved_streams(8, (3, 3, 2)), inter)
    assert layout_of(np.array([1, 0, 2, 0, 1, 2, 0, 0])) is None


def test_mask_probes_size_position_streams():
    """A (3, B, S) position input read through Shape by the mask subgraph can be probed."""
    pos = ir.Value(
        name="position_ids",
        shape=ir.Shape([3, "batch", "seq"]),
        type=ir.TensorType(ir.DataType.INT64),
    )
    mask = ir.Value(
        name="attention_mask",
        shape=ir.Shape(["batch", "total"]),
        type=ir.TensorType(ir.DataType.INT64),
    )
    array = probe_array(pos, mask, batch=2, seq=5, past=3)
    assert array is not None and array.shape == (3, 2, 5) and array.dtype == np.int64


@pytest.mark.parametrize("sections", [(8, 0, 0), (0, 8, 0), (0, 0, 8)])
def test_single_stream_sections(sections):
    """Empty sections are valid for MRotaryEmbedding (one stream drives every column)."""
    original = build_decoder(_cfg("sectioned", mrope_section=sections))
    optimized = epfuse.optimize(original, "cpu")
    for node in _nodes(optimized, "MRotaryEmbedding"):
        assert _attrs(node)["mrope_section"] == list(sections)
    assert len(_nodes(optimized, "MRotaryEmbedding")) == 4
    assert_equivalent(original, optimized, position_streams=image_positions, **LENGTHS)
