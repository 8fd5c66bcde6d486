"""The softmax NaN guard over a -inf mask (torch's SDPA in TorchScript/Optimum exports) is
proven inert by evaluating the mask, and the lifted layer keeps padding rows finite."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.errors import UnsupportedModelError
from epfuse.optimizer.verify import assert_equivalent


def _with_infinite_mask(cfg: DecoderConfig, *, padding_only: bool = False):
    """The torch18 builder decoder with its additive mask ``Where(m, 0, -inf)`` (Optimum's
    form) instead of ``finfo.min``; ``padding_only`` makes the mask padding without causality
    (not a decoder mask: the guard must stay)."""
    model = ir.from_proto(build_decoder(cfg))
    graph = model.graph
    (name,) = [n for n in graph.initializers if n.startswith("const_min_f")]
    value = graph.initializers[name]
    value.const_value = ir.tensor(np.array(-np.inf, dtype=cfg.np_dtype), name=name)
    if padding_only:
        where = next(u.node for u in value.uses() if u.node.op_type == "Where")
        cast = next(
            n for n in graph if n.op_type == "Cast" and n.outputs[0].name == "attention_mask_bool"
        )
        axes = ir.Value(name="pad_axes", const_value=ir.tensor(np.array([1, 2], np.int64)))
        graph.initializers["pad_axes"] = axes
        unsq = ir.node("Unsqueeze", [cast.outputs[0], axes], name="pad_only")
        unsq.outputs[0].name = "pad_only_mask"
        graph.insert_after(cast, unsq)
        where.replace_input_with(0, unsq.outputs[0])
    return ir.to_proto(model)


@pytest.mark.parametrize("window", [None, 3])
def test_guard_over_infinite_mask_is_proven_inert(window):
    cfg = DecoderConfig(style="torch18", sliding_window=window)
    original = _with_infinite_mask(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    assert [layer.result for layer in report.layers] == ["GroupQueryAttention(do_rotary=1)"] * (
        cfg.layers
    ), report.summary()
    ops = {n.op_type for n in optimized.graph.node}
    assert not ops & {"Softmax", "IsNaN"}
    # Right-padded rows past the window see no key at all: the lifted mask must stay finite
    # there (the standard form is checked, not only GQA, which reads no mask).
    standard, _ = epfuse.optimize_with_report(original, "default")
    assert "IsNaN" not in {n.op_type for n in standard.graph.node}
    for opt in (optimized, standard):
        assert_equivalent(original, opt, prompt_len=9, decode_past_len=7)


def test_guard_stays_when_the_mask_is_not_a_decoder_mask():
    original = _with_infinite_mask(DecoderConfig(style="torch18", layers=1), padding_only=True)
    with pytest.raises(UnsupportedModelError, match=r"NaN guard is kept.*not causal"):
        epfuse.optimize_with_report(original, "default")
