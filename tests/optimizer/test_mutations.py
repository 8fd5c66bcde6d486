"""Mutation check: inject known rewrite defects into correctly optimized models, one at a time,
and prove that the equivalence harness (``compare_models``, the default scenarios that
``epfuse verify`` and ``optimize(verify=True)`` run) FAILS on each.

Each test first shows the unmutated (or correctly constructed) model passes, so a failure is
caused by the injected defect alone. The defects are those seen in real rewriters (facts
file): a dropped padding mask, a lost ``interleaved``, a sliding window off by one, seqlens_k
off by one, fused rotary on non-contiguous positions, a wrongly packed QKV weight.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from model_builder import DecoderConfig, build_decoder
from onnx import helper, numpy_helper

import epfuse
from epfuse.optimizer.cli import EXIT_NOT_EQUIVALENT, main
from epfuse.optimizer.verify import compare_models
from epfuse.patterns import RULES, Rewritten
from epfuse.patterns._graph import Builder
from epfuse.patterns.lower.gqa import AttentionToGQA
from epfuse.patterns.reasons import ReasonCode
from epfuse.testing.strategies import check_equivalent, decoder_configs, scenario_lists


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model.SerializeToString())


def _gqa(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(name, value))


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _producer(model: onnx.ModelProto, value: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if value in n.output)


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _optimized(cfg: DecoderConfig, ep: str = "cpu") -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, ep, precision=cfg.dtype)
    assert compare_models(original, optimized).passed  # the control: no defect, no failure
    return original, optimized


def _assert_caught(original, mutant, **kwargs) -> list[str]:
    result = compare_models(original, mutant, **kwargs)
    assert not result.passed, f"the harness missed the defect:\n{result}"
    return result.failed_scenarios()


# --------------------------------------------------------------------------------- masks


def mutant_padding_dropped() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """GQA's seqlens_k = total - 1 for every row: the padding mask is lost."""
    original, mutant = _optimized(DecoderConfig(layers=2))
    g = mutant.graph
    g.initializer.append(numpy_helper.from_array(np.array(1, np.int32), "mut_one"))
    g.node.extend(
        [
            helper.make_node("Sub", ["epfuse_total_sequence_length", "mut_one"], ["mut_t1"]),
            helper.make_node("Shape", ["input_ids"], ["mut_batch"], start=0, end=1),
            helper.make_node("Expand", ["mut_t1", "mut_batch"], ["mut_seqlens"]),
        ]
    )
    for node in _gqa(mutant):
        node.input[5] = "mut_seqlens"
    return original, _sorted(mutant)


def test_seqlens_k_total_minus_one_for_every_row_is_caught():
    """The padding mask is dropped: GQA's seqlens_k = total - 1 for all rows.

    Only decode after a padded prompt can show this on valid rows (causality hides padded
    keys in a right-padded prompt), which is why the harness has that scenario.
    """
    original, mutant = mutant_padding_dropped()
    assert _assert_caught(original, mutant) == ["padded_decode"]


def test_attention_without_mask_is_caught():
    """The standard-ONNX output (``default`` EP) loses the Attention mask input."""
    original, mutant = mutant_attention_without_mask()
    assert _assert_caught(original, mutant) == ["padded_decode"]


def mutant_attention_without_mask() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original, mutant = _optimized(DecoderConfig(style="mobius", layers=2), ep="default")
    for node in mutant.graph.node:
        if node.op_type == "Attention":
            node.input[3] = ""  # is_causal=1 stays: only the padding is lost
    return original, mutant


def test_seqlens_k_equal_to_length_is_caught():
    """seqlens_k = ReduceSum(mask) instead of ReduceSum(mask) - 1."""
    original, mutant = mutant_seqlens_equal_to_length()
    failed = _assert_caught(original, mutant)
    assert "prompt" in failed and "decode" in failed


def mutant_seqlens_equal_to_length() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original, mutant = _optimized(DecoderConfig(layers=2))
    cast = _producer(mutant, "epfuse_seqlens_k")
    sub = _producer(mutant, cast.input[0])
    assert sub.op_type == "Sub"
    mutant.graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "mut_zero"))
    sub.input[1] = "mut_zero"
    return original, mutant


# ---------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("ep", ["cpu", "dml"])
def test_lost_interleaved_is_caught(ep):
    """cpu: GQA's rotary_interleaved flipped; dml: the RotaryEmbedding left outside GQA loses
    interleaved (the mobius rewriter's defect when it splits RoPE out for DML)."""
    original, mutant = mutant_lost_interleaved(ep)
    assert "prompt" in _assert_caught(original, mutant)


def mutant_lost_interleaved(ep: str = "cpu") -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original, mutant = _optimized(DecoderConfig(interleaved=True, layers=2), ep=ep)
    touched = 0
    for node in mutant.graph.node:
        if node.op_type == "GroupQueryAttention" and _attr(node, "do_rotary"):
            _set_attr(node, "rotary_interleaved", 0)
            touched += 1
        elif node.op_type == "RotaryEmbedding":
            _set_attr(node, "interleaved", 0)
            touched += 1
    assert touched
    return original, mutant


def test_fused_rotary_on_non_contiguous_positions_is_caught():
    """The original rotates by 2 * position_ids (computed in the graph); the mutant hands those
    ids to GQA with do_rotary=1, whose first prompt uses position_ids[0, 0] + arange."""
    cfg = DecoderConfig(style="mobius", layers=2)
    original = build_decoder(cfg)
    original.graph.initializer.append(numpy_helper.from_array(np.array(2, np.int64), "two"))
    original.graph.node.insert(0, helper.make_node("Mul", ["position_ids", "two"], ["pos2"]))
    for node in original.graph.node:
        if node.op_type == "RotaryEmbedding":
            node.input[3] = "pos2"
    # epfuse keeps such RoPE outside GQA (do_rotary=0), which is equivalent ...
    correct, report = epfuse.optimize_with_report(original, "cpu")
    assert {_attr(n, "do_rotary") for n in _gqa(correct)} == {0}
    assert all(ReasonCode.ROPE_POSITIONS in x.codes for x in report.layers), report.summary()
    assert compare_models(original, correct).passed
    # ... while fusing it is the defect.
    original, mutant = mutant_fused_rotary_on_doubled_positions()
    assert {_attr(n, "do_rotary") for n in _gqa(mutant)} == {1}
    failed = _assert_caught(original, mutant)
    assert "prompt" in failed and "padded" in failed


def _doubled_positions(model: onnx.ModelProto, consumers: str) -> onnx.ModelProto:
    model.graph.initializer.append(numpy_helper.from_array(np.array(2, np.int64), "two"))
    model.graph.node.insert(0, helper.make_node("Mul", ["position_ids", "two"], ["pos2"]))
    for node in model.graph.node:
        if node.op_type == consumers:
            node.input[3 if consumers == "RotaryEmbedding" else 9] = "pos2"
    return model


def mutant_fused_rotary_on_doubled_positions() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The original rotates by 2 * position_ids; GQA with do_rotary=1 is handed those ids."""
    cfg = DecoderConfig(style="mobius", layers=2)
    original = _doubled_positions(build_decoder(cfg), "RotaryEmbedding")
    mutant = _doubled_positions(epfuse.optimize(build_decoder(cfg), "cpu"), "GroupQueryAttention")
    return original, mutant


# ------------------------------------------------------------------------ sliding window


@pytest.mark.parametrize("delta", [1, -1])
@pytest.mark.parametrize("style", ["torch23", "mobius"])
def test_sliding_window_off_by_one_is_caught(style, delta):
    original, mutant = mutant_window(style, 3, 3 + delta)
    failed = _assert_caught(original, mutant)  # default lengths pass the window
    assert "prompt" in failed and "decode" in failed


def mutant_window(
    style: str, window: int, new: int, softcap: float = 0.0, layers: int = 2
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """GQA's local_window_size ``window`` replaced by ``new`` (-1: the window dropped)."""
    cfg = DecoderConfig(style=style, sliding_window=window, softcap=softcap, layers=layers)
    original, mutant = _optimized(cfg)
    for node in _gqa(mutant):
        assert _attr(node, "local_window_size") == window
        _set_attr(node, "local_window_size", new)
    return original, mutant


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["mistral", "gemma2"])
def test_dropped_window_longer_than_the_old_default_prompt_is_caught(softcap):
    """Window 8 > the historical default prompt of 7: mobius' cpu build of Gemma-2 (the
    window dropped) passed the old defaults; lengths are now read from the graphs."""
    original, mutant = mutant_window("torch23", 8, -1, softcap)
    failed = _assert_caught(original, mutant)
    assert {"prompt", "decode", "chunk"} <= set(failed)


# ------------------------------------------------------------------- cos/sin and scale


def mutant_swapped_cos_sin() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original, mutant = _optimized(DecoderConfig(layers=2))
    for node in _gqa(mutant):
        assert _attr(node, "do_rotary")
        node.input[7], node.input[8] = node.input[8], node.input[7]
    return original, mutant


def mutant_wrong_scale() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    cfg = DecoderConfig(layers=2)
    original, mutant = _optimized(cfg)
    for node in _gqa(mutant):
        _set_attr(node, "scale", 1.0 / np.sqrt(cfg.head_dim) * 1.25)
    return original, mutant


@pytest.mark.parametrize("make", [mutant_swapped_cos_sin, mutant_wrong_scale])
def test_cos_sin_and_scale_defects_are_caught(make):
    original, mutant = make()
    assert "prompt" in _assert_caught(original, mutant)


# --------------------------------------------------------------------------- packed QKV


def _pack_qkv(model: onnx.ModelProto, transpose_blocks: bool) -> onnx.ModelProto:
    """GQA with packed QKV: one MatMul(h, [Wq | Wk | Wv]) feeds input 0; inputs 1, 2 empty.
    ``transpose_blocks`` packs each (square) block transposed: the defect."""
    model = _copy(model)
    for index, node in enumerate(_gqa(model)):
        matmuls = [_producer(model, node.input[i]) for i in range(3)]
        assert all(m.op_type == "MatMul" for m in matmuls), "expects q/k/v straight from MatMul"
        assert len({m.input[0] for m in matmuls}) == 1
        blocks = [_init(model, m.input[1]) for m in matmuls]
        if transpose_blocks:
            blocks = [b.T for b in blocks]
        name = f"mut_qkv_{index}"
        model.graph.initializer.append(numpy_helper.from_array(np.concatenate(blocks, 1), name))
        packed = helper.make_node("MatMul", [matmuls[0].input[0], name], [f"{name}_out"])
        model.graph.node.insert(list(model.graph.node).index(node), packed)
        node.input[0], node.input[1], node.input[2] = f"{name}_out", "", ""
    return model


PACKED_CFG = DecoderConfig(style="mobius", heads=4, kv_heads=4, layers=2)


def mutant_transposed_packed_qkv() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original, optimized = _optimized(PACKED_CFG, "qnn")
    return original, _pack_qkv(optimized, transpose_blocks=True)


def test_transposed_packed_qkv_weight_is_caught():
    # MHA (square q/k/v blocks) in the mobius form, where q/k/v come straight from MatMul.
    # QNN's record has fused rotary but no packed QKV (the CPU output is already packed), and
    # its output runs on ORT CPU.
    original, optimized = _optimized(PACKED_CFG, "qnn")
    packed = _pack_qkv(optimized, transpose_blocks=False)
    assert compare_models(original, packed).passed  # the packed construction itself is right
    assert _assert_caught(original, _pack_qkv(optimized, transpose_blocks=True)) == [
        "prompt",
        "decode",
        "chunk",
        "padded",
        "padded_decode",
    ]


# ------------------------------------------------------------------------- epfuse verify


def test_epfuse_verify_reports_fail_on_a_mutant(tmp_path, capsys):
    original, mutant = _optimized(DecoderConfig(interleaved=True, layers=1))
    for node in _gqa(mutant):
        _set_attr(node, "rotary_interleaved", 0)
    onnx.save(original, tmp_path / "a.onnx")
    onnx.save(mutant, tmp_path / "b.onnx")
    assert main(["verify", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx")]) == (
        EXIT_NOT_EQUIVALENT
    )
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("FAIL (prompt")


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """Topologically sort ``model``'s nodes (mutations append nodes at the end)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes

    work = ir.serde.deserialize_model(model)
    common_passes.TopologicalSortPass()(work)
    return ir.to_proto(work)


# ------------------------------------------------- the property suite finds defective rules


class _DefectiveGQA(AttentionToGQA):
    """The real GQA lowering followed by one injected defect on the node it made."""

    def __init__(self, defect: str):
        self.defect = defect

    def apply(self, node, ctx):
        outcome = super().apply(node, ctx)
        if not isinstance(outcome, Rewritten):
            return outcome
        layer = node.metadata_props.get("epfuse.layer")
        gqa = next(
            n
            for n in ctx.graph
            if n.op_type == "GroupQueryAttention" and n.metadata_props.get("epfuse.layer") == layer
        )
        attrs = gqa.attributes
        if self.defect == "window+1" and "local_window_size" in attrs:
            window = attrs["local_window_size"].value + 1
            attrs["local_window_size"] = ir.AttrInt64("local_window_size", window)
        elif self.defect == "interleaved" and attrs["do_rotary"].value:
            attrs["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 0)
        elif self.defect == "padding":  # seqlens_k = total - 1 for every row
            b = Builder(ctx.graph, gqa, f"mutant{layer}")
            one = b.const("one", np.array(1, np.int32))
            last = b.op("Sub", [gqa.inputs[6], one])
            batch = b.op("Shape", [ctx.graph.inputs[0]], {"start": 0, "end": 1})
            gqa.replace_input_with(5, b.op("Expand", [last, batch]))
        return outcome


@pytest.mark.parametrize("defect", ["window+1", "interleaved", "padding"])
def test_property_suite_finds_a_defective_rule(defect, monkeypatch):
    """Run the property test's body over drawn configs with a defective GQA lowering
    installed: within the ci profile's budget (25 examples) hypothesis must find a failing
    example and print it as a reproducible ``DecoderConfig(...)`` (generation only, no
    shrinking, to stay fast)."""
    rules = tuple(_DefectiveGQA(defect) if isinstance(r, AttentionToGQA) else r for r in RULES)
    # check_equivalent calls epfuse.optimize_with_report: hand it the defective rule set.
    real = epfuse.optimize_with_report
    monkeypatch.setattr(
        epfuse, "optimize_with_report", lambda *a, **kw: real(*a, **kw, rules=rules)
    )

    @settings(
        max_examples=25,  # the ci profile's budget per (EP, dtype)
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
        report_multiple_bugs=False,
    )
    @given(data=st.data())
    def fuzz(data):
        cfg = data.draw(decoder_configs(dtypes=("float32",)), label="cfg")
        cases = data.draw(scenario_lists(), label="cases")
        check_equivalent(cfg, "cpu", cases)

    with pytest.raises(AssertionError) as info:
        fuzz()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "DecoderConfig(" in notes and "Scenario(" in notes
    assert "FAIL" in str(info.value)


# ------------------------------------------------------------------------- epfuse fuzz

MUTANTS = {
    "padding dropped (seqlens_k = total - 1)": mutant_padding_dropped,
    "Attention mask dropped": mutant_attention_without_mask,
    "seqlens_k off by one": mutant_seqlens_equal_to_length,
    "lost interleaving (cpu)": mutant_lost_interleaved,
    "lost interleaving (dml RotaryEmbedding)": lambda: mutant_lost_interleaved("dml"),
    "fused rotary on non-contiguous positions": mutant_fused_rotary_on_doubled_positions,
    "window + 1": lambda: mutant_window("torch23", 3, 4),
    "window - 1": lambda: mutant_window("mobius", 3, 2),
    "window dropped (Gemma-2)": lambda: mutant_window("torch23", 8, -1, softcap=5.0),
    "swapped cos/sin": mutant_swapped_cos_sin,
    "wrong scale": mutant_wrong_scale,
    "transposed packed QKV": mutant_transposed_packed_qkv,
}


@pytest.mark.parametrize("defect", list(MUTANTS))
def test_fuzz_catches_every_defect_with_default_arguments(defect):
    """``epfuse fuzz``'s defaults (100 examples, 50 s budget) find each injected defect and
    shrink it to a minimal example whose replay (scenario names + seed) fails again."""
    from epfuse.optimizer.verify.fuzz_cli import DEFAULT_BUDGET, DEFAULT_EXAMPLES
    from epfuse.optimizer.verify.scenarios import parse_scenario
    from epfuse.testing.fuzz import fuzz_models

    original, mutant = MUTANTS[defect]()
    result = fuzz_models(original, mutant, examples=DEFAULT_EXAMPLES, budget=DEFAULT_BUDGET)
    assert not result.passed, f"fuzz missed {defect}"
    failure = result.failure
    assert len(failure.scenarios) == 1, failure.scenarios  # shrunk to one scenario
    replay = failure.replay("a.onnx", "b.onnx")
    assert "--scenario" in replay and f"--seed {failure.seed}" in replay
    cases = [parse_scenario(s.name) for s in failure.scenarios]
    assert not compare_models(original, mutant, scenarios=cases, seed=failure.seed).passed
