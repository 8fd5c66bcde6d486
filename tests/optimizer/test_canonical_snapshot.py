"""The rollback's reuse of canonicalization: ``PassManager.canonicalize`` does not depend on
``skip_layers``, so lowering copies of one canonical run (``RunState.copy``) gives exactly
the model and report of a whole run with each skip set."""

from __future__ import annotations

import re

import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import PassManager
from epfuse.optimizer.precision import choose
from epfuse.patterns import RULES, OptimizeOptions

CASES = [
    ("cpu", DecoderConfig(layers=3, interleaved=True, sliding_window=3, softcap=20.0)),
    ("cpu", DecoderConfig(layers=3, style="torch18", rotary_dim=8)),
    ("cpu", DecoderConfig(layers=3, style="mobius", qk_norm=True)),
    ("cpu", DecoderConfig(layers=3, style="mobius", positions="mrope")),
    ("cuda", DecoderConfig(layers=3)),  # converted to float16 in PRECISION
    ("dml", DecoderConfig(layers=3)),  # legalized
]


def _text(model: ir.Model) -> str:
    """The model as text, with the names onnx-ir numbers unnamed values by at serialization
    (``val_N``: the copy was serialized once more, so its counter differs) made equal."""
    text = onnx.printer.to_text(ir.to_proto(model))
    return re.sub(r"\bval_\d+\b", "val_#", text)


def _comparable(report) -> dict:
    data = report.to_dict()
    data.pop("seconds")
    return data


@pytest.mark.parametrize(("ep", "cfg"), CASES, ids=lambda x: getattr(x, "style", x))
def test_lowering_a_canonical_copy_equals_a_whole_run(ep, cfg):
    proto = build_decoder(cfg)
    record = get_ep(ep)
    plan = choose("auto", record, "float32", None)
    manager = PassManager(RULES)
    # skip_layers given here must not matter: canonicalize never reads them
    canonical = manager.canonicalize(
        ir.serde.deserialize_model(proto),
        record,
        "float32",
        OptimizeOptions(skip_layers=frozenset({0, 1, 2})),
        precision=plan,
    )
    for skip in (frozenset(), frozenset({1}), frozenset({0, 2})):
        whole = ir.serde.deserialize_model(proto)
        expected = manager.run(
            whole, record, "float32", OptimizeOptions(skip_layers=skip), precision=plan
        )
        copy = canonical.copy()
        got = manager.lower(copy, skip)
        assert _comparable(got) == _comparable(expected)
        assert _text(copy.ctx.model) == _text(whole)
    assert any(layer.fused for layer in expected.layers) or ep == "dml"
