"""The mRoPE builder graph: text positions give the 1-D decoder; each stream drives exactly the
columns its section assigns (checked with one-stream sections against the 1-D decoder)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from model_builder import DecoderConfig, build_decoder, decoder_feeds, image_positions

IDS = np.array([[3, 17, 42, 99, 5, 64, 120, 1, 2, 3]], dtype=np.int64)


def _run(cfg: DecoderConfig, position_ids=None) -> list[np.ndarray]:
    sess = ort.InferenceSession(
        build_decoder(cfg).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return sess.run(None, decoder_feeds(cfg, IDS, position_ids=position_ids))


@pytest.mark.parametrize("layout", ["sectioned", "interleaved"])
def test_text_positions_equal_1d_rope(layout):
    mrope = _run(DecoderConfig(style="mobius", positions="mrope", mrope_layout=layout))
    plain = _run(DecoderConfig(style="mobius"))
    for a, b in zip(mrope, plain, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stream", [0, 1, 2])
def test_one_stream_sections_follow_that_stream(stream):
    sections = [0, 0, 0]
    sections[stream] = 8
    cfg = DecoderConfig(style="mobius", positions="mrope", mrope_section=tuple(sections))
    streams = image_positions(np.arange(IDS.shape[1])[None])
    assert len({tuple(s.ravel()) for s in streams}) == 3  # distinct T, H, W
    mrope = _run(cfg, streams)
    plain = _run(DecoderConfig(style="mobius"), streams[stream])
    np.testing.assert_allclose(mrope[0], plain[0], atol=1e-5, rtol=1e-5)


def test_image_positions_layout():
    pos = image_positions(np.arange(10)[None])[:, 0]
    assert pos.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]
