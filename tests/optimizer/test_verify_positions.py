"""verify feeds (3, batch, seq) mRoPE positions: text-only by default, or a caller's streams."""

from __future__ import annotations

import numpy as np
import onnx
from model_builder import DecoderConfig, build_decoder, image_positions

from epfuse.optimizer.verify import compare_models, discover_io, text_positions


def test_discovers_position_streams():
    io = discover_io(build_decoder(DecoderConfig(style="mobius", positions="mrope")))
    assert io.position_streams
    assert not discover_io(build_decoder(DecoderConfig(style="mobius"))).position_streams


def test_text_positions_broadcast():
    pos = np.array([[0, 1, 2], [4, 5, 6]])
    streams = text_positions(pos)
    assert streams.shape == (3, 2, 3) and all((s == pos).all() for s in streams)


def test_custom_streams_reach_the_model():
    """Keeping only the T stream differs from the original on image positions alone."""
    cfg = DecoderConfig(style="mobius", positions="mrope")
    original = build_decoder(cfg)
    t_only = build_decoder(cfg)
    for init in t_only.graph.initializer:
        if init.name == "mrope_is_t":
            init.CopyFrom(onnx.numpy_helper.from_array(np.ones(8, dtype=bool), init.name))
    assert compare_models(original, t_only, prompt_len=10, decode_past_len=9).passed
    # decode token 5 and chunk tokens 5..7 are image tokens: every scenario sees T != H != W
    image = compare_models(
        original,
        t_only,
        prompt_len=10,
        decode_past_len=5,
        chunk_past_len=5,
        position_streams=image_positions,
    )
    assert not image.passed
    assert set(image.failed_scenarios()) == {"prompt", "decode", "chunk", "padded", "padded_decode"}
