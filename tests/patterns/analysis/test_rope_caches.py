"""The RoPE cache proofs as run analyses: one evaluation for every RotaryEmbedding that
reads the same cos/sin, cached by the values themselves."""

from __future__ import annotations

import onnx_ir as ir
from model_builder import DecoderConfig, build_decoder

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import OptimizeOptions, RewriteContext
from epfuse.patterns.analysis import rope_caches
from epfuse.patterns.analysis.rope_caches import CacheSpec, RopeCacheProof
from epfuse.patterns.canonicalize.rope_caches import RopeCosSinToCaches


def test_every_rotation_of_one_cos_sin_shares_one_evaluation(monkeypatch):
    model = ir.from_proto(build_decoder(DecoderConfig(style="torch23", layers=3)))
    _infer_types(model)  # the rule needs the rotated input's dtype
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(256))
    calls = []
    prove = rope_caches._prove
    monkeypatch.setattr(
        rope_caches, "_prove", lambda *a, **k: calls.append(a[1:3]) or prove(*a, **k)
    )
    ropes = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 6
    found = [RopeCosSinToCaches().apply(node, ctx) for node in ropes]
    assert all(f is not None and f.note.startswith("cos/sin caches of 256") for f in found)
    assert len(calls) == 1  # one proof for the six rotations
    # Each rotation now reads the one pair of constant caches.
    assert len({(n.inputs[1], n.inputs[2]) for n in ropes}) == 1
    assert ropes[0].inputs[1].is_initializer()


def test_a_proof_is_keyed_by_its_values_and_caches():
    model = ir.from_proto(build_decoder(DecoderConfig(style="torch23", layers=1)))
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(256))
    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    cos, sin = rope.inputs[1], rope.inputs[2]
    positions = next(v for v in model.graph.inputs if v.name == "position_ids")
    freqs = next(n for n in model.graph if n.op_type == "Mul" and n.outputs[0].name == "freqs")
    inv_freq = next(v.const_value.numpy() for v in freqs.inputs if v.const_value is not None)
    spec = CacheSpec.of(inv_freq.reshape(-1), 1.0, ir.DataType.FLOAT, 256)
    proof = ctx.analysis(RopeCacheProof, cos, sin, positions, spec, "")
    assert proof == RopeCacheProof(shared=False)
    assert ctx.analysis(RopeCacheProof, cos, sin, positions, spec, "") is proof
    # Other frequencies are other caches: a new key, and not what cos/sin compute.
    wrong = CacheSpec.of(inv_freq.reshape(-1) * 2, 1.0, ir.DataType.FLOAT, 256)
    refused = ctx.analysis(RopeCacheProof, cos, sin, positions, wrong, "")
    assert "do not match" in refused.reason
