"""The mask proof (``analysis.mask_proof``) proves causal + padding (and sliding windows) by evaluating the graph."""

import numpy as np
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

from epfuse.capabilities import get_ep
from epfuse.patterns import OptimizeOptions, RewriteContext
from epfuse.patterns.analysis.manager import Unproven
from epfuse.patterns.analysis.mask_proof import MaskProof, attention_mask_proof


def _first_attention(cfg):
    model = ir.from_proto(build_decoder(cfg))
    node = next(n for n in model.graph if n.op_type == "Attention")
    return model, node


def _analyze(model, node, max_seq_len=512):
    """The proof's answer, a reason string when unproven (what the assertions read)."""
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(max_seq_len))
    found = attention_mask_proof(ctx, node)
    return found.reason if isinstance(found, Unproven) else found


@pytest.mark.parametrize("style", ["torch23", "mobius"])
def test_causal_padding_is_proven(style):
    model, node = _first_attention(DecoderConfig(style=style))
    result = _analyze(model, node)
    assert isinstance(result, MaskProof), result
    assert result.kind == "causal_padding" and result.window is None
    assert result.attention_mask.name == "attention_mask"


@pytest.mark.parametrize(("style", "window"), [("torch23", 5), ("mobius", 3), ("torch23", 300)])
def test_sliding_window_width_is_measured(style, window):
    model, node = _first_attention(DecoderConfig(style=style, sliding_window=window))
    result = _analyze(model, node)
    assert isinstance(result, MaskProof), result
    assert (result.kind, result.window) == ("sliding_window", window)


def test_window_beyond_max_seq_len_is_plain_causal():
    model, node = _first_attention(DecoderConfig(sliding_window=1000))
    result = _analyze(model, node, max_seq_len=512)
    assert isinstance(result, MaskProof) and result.window is None


def test_non_causal_mask_is_rejected():
    model, node = _first_attention(DecoderConfig(style="mobius"))
    node.attributes["is_causal"] = ir.AttrInt64("is_causal", 0)
    result = _analyze(model, node)
    assert isinstance(result, str) and "not causal + padding" in result


def _replace_mask_with_additive(model, node, allowed_value: float):
    graph = model.graph
    mask = node.inputs[3]
    zero = ir.Value(name="m_zero", const_value=ir.tensor(np.array(allowed_value, np.float32)))
    neg = ir.Value(name="m_neg", const_value=ir.tensor(np.array(-np.inf, np.float32)))
    graph.initializers["m_zero"], graph.initializers["m_neg"] = zero, neg
    where = ir.node("Where", [mask, zero, neg], name="additive")
    where.outputs[0].name = "additive_mask"
    graph.insert_before(node, where)
    node.replace_input_with(3, where.outputs[0])


def test_additive_mask_is_proven():
    model, node = _first_attention(DecoderConfig())
    _replace_mask_with_additive(model, node, 0.0)
    assert isinstance(_analyze(model, node), MaskProof)


def test_bias_is_rejected():
    model, node = _first_attention(DecoderConfig())
    _replace_mask_with_additive(model, node, 0.5)
    result = _analyze(model, node)
    assert isinstance(result, str) and "bias" in result


def test_mask_read_from_another_input_is_rejected():
    model, node = _first_attention(DecoderConfig(style="mobius"))
    graph = model.graph
    positions = next(v for v in graph.inputs if v.name == "position_ids")
    cast = ir.node("Cast", [positions], {"to": ir.DataType.BOOL}, name="pos_bool")
    cast.outputs[0].name = "pos_bool"
    graph.insert_before(node, cast)
    both = ir.node("And", [node.inputs[3], cast.outputs[0]], name="and_pos")
    both.outputs[0].name = "mask_and_pos"
    graph.insert_before(node, both)
    node.replace_input_with(3, both.outputs[0])
    result = _analyze(model, node)
    assert isinstance(result, str) and "not from one 2-D attention mask" in result


def test_no_mask_input():
    model, node = _first_attention(DecoderConfig(style="mobius"))
    node.replace_input_with(3, None)
    assert "no attention-mask input" in _analyze(model, node)


def _canonical(cfg):
    from epfuse.capabilities.registry import get_ep
    from epfuse.optimizer.manager import PassManager
    from epfuse.patterns import OptimizeOptions

    model = ir.from_proto(build_decoder(cfg))
    PassManager().canonicalize(model, get_ep("cpu"), "float32", OptimizeOptions())
    return model, [n for n in model.graph if n.op_type == "Attention"]


def test_mask_sliced_to_a_later_layers_key_is_cut_at_the_keys_shape():
    """transformers 4.x slices each layer's mask to key_states.shape[-2]: the last layer's mask
    reads, by shape, a key computed from both earlier layers. Its Shape is fed from the key's
    inferred shape (a ShapeCut), so the proof reads only attention_mask by value and runs no
    earlier layer; without that inferred shape the mask stays unproven."""
    from epfuse.patterns._evaluate import value_dependencies

    model, attentions = _canonical(DecoderConfig(style="torch18", mask_slice=True, layers=3))
    last = attentions[-1]
    cuts = []
    by_value, _ = value_dependencies(last.inputs[3], shape_cuts=(model.graph, cuts))
    assert [v.name for v in by_value] == ["attention_mask"]
    key_cuts = [c for c in cuts if c.value.producer().inputs[0].producer().op_type != "Shape"]
    assert key_cuts and all(not isinstance(d, int) for c in key_cuts for d in c.dims[:1])
    result = _analyze(model, last)
    assert isinstance(result, MaskProof) and result.kind == "causal_padding", result

    for cut in key_cuts:  # the key's shape unknown: evaluated through layers 0 and 1, refused
        source = cut.value.producer().inputs[0]
        source.shape = ir.Shape([None] * len(source.shape))
    result = _analyze(model, last)
    assert isinstance(result, str) and "not from one 2-D attention mask" in result


def test_shape_cut_vector_reads_input_dims_start_end_and_size():
    from epfuse.patterns._evaluate import ShapeCut

    shapes = {"input_ids": (3, 7), "past": (3, 2, 5, 16)}
    dims = (("input_ids", 0), 2, ("past", 2), 16)
    cut = ShapeCut(ir.Value(name="s"), dims)
    assert cut.vector(shapes.get).tolist() == [3, 2, 5, 16]
    assert ShapeCut(ir.Value(name="s"), dims, start=2, end=-1).vector(shapes.get).tolist() == [5]
    assert ShapeCut(ir.Value(name="s"), dims, size=True).vector(shapes.get) == 3 * 2 * 5 * 16
    assert ShapeCut(ir.Value(name="s"), (("missing", 0),)).vector(shapes.get) is None
