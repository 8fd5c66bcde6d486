"""The test decoders live in ``epfuse.testing.model_builder`` (importable, so that
``epfuse.testing.strategies.decoder_configs`` can draw them for users' suites too); tests
keep importing them as ``model_builder``."""

from epfuse.testing.model_builder import *  # noqa: F403
from epfuse.testing.model_builder import (  # noqa: F401  (names tests use explicitly)
    DecoderConfig,
    build_decoder,
    decoder_feeds,
    decoder_weights,
    image_positions,
    mrope_streams,
    rope_caches,
)
