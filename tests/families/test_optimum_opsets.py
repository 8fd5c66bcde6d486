"""Optimum exports at ``--opset 14`` and ``17`` are raised to opset 23 and canonicalize as the
default-opset (18) export does, staying equal to the export in every scenario.

Below 18 ReduceMean takes its axes as an attribute (converted in place by ``_opset``), and
ops revised after 14 (LessOrEqual, Pow, Where, ...) must keep their meaning at 23. Llama and
one sliding-window family (Mistral, lengths past the window) are exported with Optimum and run
through the whole pass manager (the API would stop at "no attention" where a layer is kept);
RMSNorm and RoPE must be lifted, no reason may cite the opset, and the result must compute
what the export computes (logits and present K/V on valid rows).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import PassManager
from epfuse.optimizer.verify import compare_models
from epfuse.patterns import OptimizeOptions
from epfuse.testing.hf_families import ALL_FAMILIES, SLIDING_WINDOW

pytestmark = [pytest.mark.slow, pytest.mark.optimum]

W = SLIDING_WINDOW
CASES = [(name, opset) for name in ("llama3", "mistral") for opset in (14, 17)]


@pytest.mark.parametrize(("name", "opset"), CASES, ids=[f"{n}-opset{o}" for n, o in CASES])
def test_low_opset_export_is_raised_and_stays_equal(name, opset, tmp_path):
    from epfuse.testing.optimum_export import export_optimum_decoder

    config = ALL_FAMILIES[name].make_config()
    path = export_optimum_decoder(config, tmp_path / name, opset=opset)
    original = onnx.load(str(path))
    assert original.opset_import[0].version == opset

    model = ir.serde.deserialize_model(original)
    report = PassManager().run(model, get_ep("cpu"), "float32", OptimizeOptions())
    assert model.opset_imports[""] == 23, report.summary()
    reasons = [r for rule in report.rules for r in rule.kept_reasons]
    reasons += [r for layer in report.layers for r in layer.reasons]
    assert not [r for r in reasons if "opset" in r], report.summary()
    ops = [n.op_type for n in model.graph]
    layers = config.num_hidden_layers
    norms = ops.count("RMSNormalization") + ops.count("SkipSimplifiedLayerNormalization")
    assert norms == 2 * layers + 1, report.summary()  # residual Adds fused into the latter
    assert "ReduceMean" not in ops
    assert ops.count("RotaryEmbedding") + ops.count("GroupQueryAttention") >= layers

    result = compare_models(original, model, prompt_len=2 * W + 1, decode_past_len=2 * W)
    assert result.passed, str(result)
