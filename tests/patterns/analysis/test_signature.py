"""DecoderSignature finds roles by shape, dtype and consumers: renamed inputs keep their roles."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

from epfuse.patterns.analysis.signature import DecoderSignature, probe_array


def _signature(cfg: DecoderConfig, renames: dict[str, str] | None = None) -> DecoderSignature:
    model = ir.from_proto(build_decoder(cfg))
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if renames and value.name in renames:
            value.name = renames[value.name]
    return DecoderSignature.of(model)


def _layout(sig: DecoderSignature) -> list[tuple[str, str, str, int]]:
    return [(c.past.name, c.present.name, c.kind, c.layer) for c in sig.cache]


@pytest.mark.parametrize("style", ["torch23", "mobius", "torch18"])
def test_optimum_names(style):
    sig = _signature(DecoderConfig(style=style, layers=3))
    assert sig.tokens.name == "input_ids" and sig.token_kind == "ids"
    assert sig.attention_mask.name == "attention_mask"
    assert sig.position_ids.name == "position_ids" and not sig.position_streams
    assert sig.logits.name == "logits" and sig.vocab_size == 128
    assert sig.dtype == ir.DataType.FLOAT
    assert not sig.extra_inputs and not sig.extra_outputs
    assert _layout(sig) == [
        (f"past_key_values.{i}.{kind}", f"present.{i}.{kind}", kind, i)
        for i in range(3)
        for kind in ("key", "value")
    ]
    assert {(c.num_heads, c.head_size, c.heads_axis, c.head_size_axis) for c in sig.cache} == {
        (2, 16, 1, 3)
    }
    assert [(k.past.name, v.past.name) for k, v in sig.layers] == [
        (f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(3)
    ]


@pytest.mark.parametrize("style", ["torch23", "mobius", "torch18"])
def test_renamed_inputs_keep_their_roles(style):
    """No name says what an input is: the roles come from the graph alone."""
    layers = 3
    renames = {"input_ids": "a", "attention_mask": "b", "position_ids": "c", "logits": "out"}
    for i in range(layers):
        # Reversed layer numbers and no key/value word: a name would mislead.
        for j, kind in enumerate(("key", "value")):
            renames[f"past_key_values.{i}.{kind}"] = f"cache_{layers - i}_{j}"
            renames[f"present.{i}.{kind}"] = f"state_{layers - i}_{1 - j}"
    sig = _signature(DecoderConfig(style=style, layers=layers), renames)
    assert (sig.tokens.name, sig.attention_mask.name, sig.position_ids.name) == ("a", "b", "c")
    assert sig.logits.name == "out"
    assert _layout(sig) == [
        (renames[f"past_key_values.{i}.{kind}"], renames[f"present.{i}.{kind}"], kind, i)
        for i in range(layers)
        for kind in ("key", "value")
    ]


def test_3d_positions():
    sig = _signature(DecoderConfig(style="mobius", positions="mrope"))
    assert sig.position_ids.name == "position_ids" and sig.position_streams
    assert sig.attention_mask.name == "attention_mask"
    pos = probe_array(sig.position_ids, None, batch=2, seq=5, past=3)
    assert pos.shape == (3, 2, 5)


def test_dtype_and_probe_arrays_follow_roles():
    sig = _signature(DecoderConfig(style="mobius", dtype="float16"))
    assert sig.dtype == ir.DataType.FLOAT16
    shapes = {
        v.name: probe_array(v, None, batch=2, seq=5, past=3).shape
        for v in (sig.tokens, sig.attention_mask, sig.position_ids, sig.cache[0].past)
    }
    assert shapes == {
        "input_ids": (2, 5),
        "attention_mask": (2, 8),  # the mask spans past + new tokens
        "position_ids": (2, 5),
        "past_key_values.0.key": (2, 2, 3, 16),
    }
    assert probe_array(sig.attention_mask, sig.attention_mask, 2, 5, 3) is None


def test_unknown_input_is_extra_state():
    proto = build_decoder(DecoderConfig(style="mobius", layers=1))
    proto.graph.input.append(
        onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, [7])
    )
    sig = DecoderSignature.of(ir.from_proto(proto))
    assert [v.name for v in sig.extra_inputs] == ["extra"]
    assert sig.logits.name == "logits"
    assert np.dtype(sig.dtype.numpy()) == np.float32


def test_carried_state_is_extra_state_not_a_past():
    """A hybrid stack's conv/recurrent state (static after the batch, an output of the same
    shape) is recognised as state: the KV layout and the other roles are unchanged."""
    from model_builder import with_carried_state

    cfg = DecoderConfig(style="torch23", layers=2)
    plain = DecoderSignature.of(ir.from_proto(build_decoder(cfg)))
    sig = DecoderSignature.of(ir.from_proto(with_carried_state(build_decoder(cfg))))
    assert _layout(sig) == _layout(plain)
    assert [(s.past.name, s.present.name, s.shape) for s in sig.states] == [
        ("past_key_values.2.state", "present.2.state", (8, 3)),
        ("past_key_values.3.state", "present.3.state", (2, 4, 4)),
    ]
    assert not sig.extra_inputs and not sig.extra_outputs
    assert sig.tokens.name == "input_ids" and sig.logits.name == "logits"
    # probe_array sizes a state by its own dims, only the batch varies.
    state = sig.states[1].past
    assert probe_array(state, sig.attention_mask, 3, 5, 7).shape == (3, 2, 4, 4)
