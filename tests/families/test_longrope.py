"""LongRoPE (tiny Phi-3.5-mini, and Phi-4-mini with partial rotary 0.75) exported by
torch.onnx at opsets 18 and 23, end to end on CPU.

Hugging Face picks the long or short rescale factors per call
(``max(position_ids) + 1 > original_max_position_embeddings``, here 16) and scales cos/sin by
one attention factor either way; the export keeps that switch as a ``Where`` on ``inv_freq``.

1. the export is the Hugging Face model at lengths below, at and above the switch;
2. on cpu every layer becomes GroupQueryAttention with do_rotary=1 whose cos/sin caches are
   ``Where(the export's own condition, long caches, short caches)``, the caches equal to
   Hugging Face's frequencies times its attention factor;
3. the result is equivalent in verify's scenarios below, at and above the switch, and across
   it (a decode or chunk whose past was rotated short); the default ``verify`` reads the
   switch and catches a rewrite that always takes one side;
4. on an EP whose GQA has no fused rotary the rotation stays outside, reported, equivalent.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from export_runs import assert_matches_hf, export_and_optimize
from onnx import numpy_helper

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.verify import Scenario, compare_models
from epfuse.optimizer.verify.limits import read_limits
from epfuse.testing.hf_families import LONGROPE_FAMILIES, LONGROPE_ORIGINAL_MAX

pytestmark = pytest.mark.slow

T = LONGROPE_ORIGINAL_MAX


def scenarios() -> list[Scenario]:
    """Lengths below, at and above the switch, and continuations across it."""
    return [
        Scenario.prompt((T - 4, T - 4), name="prompt<T"),
        Scenario.prompt((T, T), name="prompt=T"),
        Scenario.prompt((T + 3, T + 3), name="prompt>T"),
        Scenario.prompt((T + 3, T - 6), name="padded>T"),  # the batch's max picks for row 1
        Scenario.continuation(2, T - 1, 1, name="decode=T"),
        Scenario.continuation(2, T, 1, name="decode>T"),  # past rotated short, new token long
        Scenario.continuation(1, T - 2, 3, name="chunk_across_T"),
        Scenario.continuation(1, T + 2, 3, name="chunk>T"),
        Scenario.padded_decode((T - 2, T - 8), name="padded_decode<T"),
        Scenario.padded_decode((T + 3, T + 1), name="padded_decode>T"),
    ]


@pytest.fixture(
    scope="module",
    params=[(f, o) for f in LONGROPE_FAMILIES for o in (18, 23)],
    ids=[f"{f}-opset{o}" for f in LONGROPE_FAMILIES for o in (18, 23)],
)
def exported(request, tmp_path_factory):
    name, opset = request.param
    path = tmp_path_factory.mktemp("longrope") / f"{name}_{opset}.onnx"
    original, optimized, report = export_and_optimize(
        LONGROPE_FAMILIES[name].make_config(), path, opset
    )
    return name, original, optimized, report


def test_export_matches_hugging_face_on_both_sides(exported):
    name, original, _, _ = exported
    config = LONGROPE_FAMILIES[name].make_config()
    for prompt in (T - 4, T, T + 3):
        # then one decode step: at T it crosses to the long factors
        assert_matches_hf(config, original, prompt, decode=True, seed=prompt)


def _hf_caches(config, rows: int):
    """float64 (cos, sin) of Hugging Face's long and short frequencies times its attention
    factor, as (long, short) pairs."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS["longrope"]
    long, factor = init(config, "cpu", seq_len=T + 1)
    short, factor_short = init(config, "cpu", seq_len=T)
    assert factor == factor_short and factor > 1.0  # one attention factor for both
    angles = np.arange(rows, dtype=np.float64)[:, None]
    out = []
    for freqs in (long, short):
        theta = angles * freqs.double().numpy()[None, :]
        out.append((np.cos(theta) * factor, np.sin(theta) * factor))
    return out


def test_every_layer_fuses_the_switched_caches(exported):
    name, _, optimized, report = exported
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    for layer in report.layers:
        details = "; ".join(layer.notes + layer.reasons)
        assert layer.result == "GroupQueryAttention(do_rotary=1)", details
        assert "LongRoPE caches chosen per call" in details
    ops = [n.op_type for n in optimized.graph.node]
    for op in ("Cos", "Sin", "RotaryEmbedding", "Attention"):
        assert op not in ops, op
    producers = {o: n for n in optimized.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in optimized.graph.initializer}
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    rows = inits[producers[gqa[0].input[7]].input[1]].shape[0]
    assert {(layer.facts.do_rotary, layer.facts.rotary_cache_rows) for layer in report.layers} == {
        (True, rows)
    }  # the report's facts read the switched caches' rows too
    (long_cos, long_sin), (short_cos, short_sin) = _hf_caches(
        LONGROPE_FAMILIES[name].make_config(), rows
    )
    # float32 angles of positions up to `rows`: rounding grows with the position
    atol = 1e-6 + 2e-7 * rows
    for node in gqa:
        for slot, long, short in ((7, long_cos, short_cos), (8, long_sin, short_sin)):
            where = producers[node.input[slot]]
            assert where.op_type == "Where"
            assert producers[where.input[0]].op_type == "Greater"  # the export's condition
            np.testing.assert_allclose(inits[where.input[1]], long, atol=atol)
            np.testing.assert_allclose(inits[where.input[2]], short, atol=atol)
    assert ops.count("Where") == 2  # one switch per cache, shared by the layers


def test_optimized_is_equivalent_on_both_sides_of_the_switch(exported):
    name, original, optimized, _ = exported
    result = compare_models(original, optimized, scenarios=scenarios())
    assert result.passed, str(result)
    assert all(s.skipped is None and s.error is None for s in result.scenarios), str(result)
    worst = {
        s.name: max(c.max_abs_err for c in s.comparisons if c.kind == "logits")
        for s in result.scenarios
    }
    print(f"\n{name}: max |dlogits| " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def _one_side(optimized: onnx.ModelProto, side: int) -> onnx.ModelProto:
    """The defect: GQA reads one cache pair for every length (side 1 long, 2 short)."""
    broken = onnx.ModelProto()
    broken.CopyFrom(optimized)
    producers = {o: n for n in broken.graph.node for o in n.output}
    for node in broken.graph.node:
        if node.op_type == "GroupQueryAttention":
            for slot in (7, 8):
                node.input[slot] = producers[node.input[slot]].input[side]
    return broken


def test_default_verify_reads_the_switch_and_catches_one_sided_caches(exported):
    _, original, optimized, _ = exported
    limits = read_limits(original, optimized)
    assert T in limits.thresholds, limits.describe()
    assert compare_models(original, optimized).passed
    for side in (1, 2):
        result = compare_models(original, _one_side(optimized, side))
        assert not result.passed, f"side {side}\n{result}"


def test_without_fused_rotary_the_rotation_stays_outside(exported):
    _, original, _, _ = exported
    no_rotary = get_ep("cpu").variant("cpu-no-fused-rotary", gqa={"fused_rotary": False})
    kept, report = epfuse.optimize_with_report(original, no_rotary)
    assert report.fused_layers == 2
    for layer in report.layers:
        assert layer.result == "GroupQueryAttention(do_rotary=0)", layer
        assert any("has no fused rotary" in n for n in layer.notes + layer.reasons), layer
    # the canonical switched caches stay in front of the kept RotaryEmbedding
    assert [n.op_type for n in kept.graph.node].count("RotaryEmbedding") == 4
    result = compare_models(original, kept, scenarios=scenarios())
    assert result.passed, str(result)
