"""RoPE of real Hugging Face Optimum exports (torch.onnx's TorchScript exporter, transformers
4.57) canonicalizes to what dynamo exports give: one ``RotaryEmbedding`` per Q and K reading
constant cos/sin caches at the ``position_ids`` input.

Optimum traces transformers 4.x's rotary module: inv_freq expanded (Cohere: ``repeat``-ed) to
a batch size whose dim shape inference cannot name, rotate-half slices at
``x.shape[-1] // 2`` computed in the graph, Cohere's ``repeat_interleave`` as a
Range/NonZero/GatherND chain. Only the RoPE rules run here (the attention lift of these
graphs is tested with the Optimum family tests); the canonicalized graph must compute what
the export computes in every scenario.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.optimizer.verify import compare_models
from epfuse.patterns import OptimizeOptions, RewriteContext
from epfuse.patterns.canonicalize.partial_rotary import PartialRotaryToRotaryDim
from epfuse.patterns.canonicalize.rope_caches import RopeCosSinToCaches
from epfuse.patterns.canonicalize.rotate_half import RotateHalfToRotaryEmbedding
from epfuse.testing.hf_families import ALL_FAMILIES

pytestmark = [pytest.mark.optimum, pytest.mark.slow]

RULES = (RotateHalfToRotaryEmbedding(), PartialRotaryToRotaryDim(), RopeCosSinToCaches())
# family -> RoPE interleaved
FAMILIES = {"llama3": 0, "mistral": 0, "cohere": 1}


def _canonicalize_rope(proto: onnx.ModelProto) -> ir.Model:
    model = ir.serde.deserialize_model(proto)
    _infer_types(model)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions())
    for _ in range(2):
        for node in list(model.graph):
            for rule in RULES:
                if node.graph is model.graph and (node.domain, node.op_type) == rule.anchor:
                    rule.apply(node, ctx)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_optimum_rope_becomes_cached_rotary_embedding(name, tmp_path):
    from epfuse.testing.optimum_export import export_optimum_decoder

    path = export_optimum_decoder(ALL_FAMILIES[name].make_config(), tmp_path / name)
    original = onnx.load(str(path))
    model = _canonicalize_rope(original)
    ropes = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 2 * 2  # Q and K of both layers
    for rope in ropes:
        assert rope.inputs[1].const_value is not None and rope.inputs[2].const_value is not None
        assert rope.inputs[1].const_value.shape[1] == 8  # head_dim 16 / 2
        assert rope.inputs[3] is not None and rope.inputs[3].name == "position_ids"
        assert rope.attributes["interleaved"].value == FAMILIES[name]
        assert "rotary_embedding_dim" not in rope.attributes
    result = compare_models(original, model, prompt_len=9, decode_past_len=8)
    assert result.passed, str(result)
