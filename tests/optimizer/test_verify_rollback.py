"""optimize(verify=True): per-layer rollback of rewrites that fail verification, and
OptimizeOptions.skip_layers."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import helper

import epfuse
import epfuse.optimizer.api as api
from epfuse.errors import VerificationError
from epfuse.optimizer.cli import main
from epfuse.optimizer.manager import PassManager
from epfuse.optimizer.verify import compare_models
from epfuse.patterns import RULES, Rewritten
from epfuse.patterns.lower.gqa import AttentionToGQA
from epfuse.patterns.reasons import ReasonCode


def _gqa(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


class _FlipInterleaved(AttentionToGQA):
    """A defective GQA lowering: on the given layers it loses ``interleaved``."""

    def __init__(self, bad_layers: set[int]):
        self.bad_layers = bad_layers

    def apply(self, node, ctx):
        layer = int(node.metadata_props.get("epfuse.layer", -1))
        outcome = super().apply(node, ctx)
        if isinstance(outcome, Rewritten) and layer in self.bad_layers:
            gqa = next(
                n
                for n in ctx.graph
                if n.op_type == "GroupQueryAttention"
                and n.metadata_props.get("epfuse.layer") == str(layer)
            )
            gqa.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 0)
        return outcome


def defective_rules(bad_layers: set[int]) -> tuple:
    """RULES with a GQA lowering that breaks ``bad_layers``, for ``optimize(rules=...)``."""
    return tuple(
        _FlipInterleaved(bad_layers) if isinstance(r, AttentionToGQA) else r for r in RULES
    )


def test_skip_layers_keeps_those_layers_standard():
    original = build_decoder(DecoderConfig(layers=3))
    optimized, report = epfuse.optimize_with_report(original, "cpu", skip_layers={0, 2})
    assert [layer.fused for layer in report.layers] == [False, True, False]
    assert "excluded by skip_layers" in report.layers[0].reasons[0]
    assert report.options["skip_layers"] == [0, 2]
    assert len(_gqa(optimized)) == 1
    assert sum(n.op_type == "Attention" for n in optimized.graph.node) == 2
    assert compare_models(original, optimized).passed


def test_verify_passes_through_a_correct_model():
    original = build_decoder(DecoderConfig(layers=2, sliding_window=3))
    optimized, report = epfuse.optimize_with_report(original, "cpu", verify=True)
    assert report.fused_layers == 2
    assert report.verification.startswith("passed (scenarios prompt")
    assert epfuse.read_report(optimized).verification == report.verification


def test_verify_rolls_back_only_the_broken_layer():
    cfg = DecoderConfig(layers=3, interleaved=True)
    original = build_decoder(cfg)
    rules = defective_rules({1})
    unverified = epfuse.optimize(original, "cpu", rules=rules)
    assert not compare_models(original, unverified).passed  # the defect is real
    optimized, report = epfuse.optimize_with_report(original, "cpu", verify=True, rules=rules)
    assert [layer.fused for layer in report.layers] == [True, False, True]
    assert report.layers[1].result == "Attention (kept)"
    (reason,) = report.layers[1].reasons
    assert report.layers[1].codes == [ReasonCode.ROLLED_BACK]
    assert reason.startswith("rolled back: failed verification (max err ")
    assert "passed after rolling back layer(s) 1" in report.verification
    assert len(_gqa(optimized)) == 2
    assert compare_models(original, optimized).passed


def test_verify_rolls_back_every_broken_layer():
    original = build_decoder(DecoderConfig(layers=3, interleaved=True))
    rules = defective_rules({0, 2})
    optimized, report = epfuse.optimize_with_report(original, "cpu", verify=True, rules=rules)
    assert [layer.fused for layer in report.layers] == [False, True, False]
    assert compare_models(original, optimized).passed


def test_rollback_search_costs_log_n_runs_and_verifications(monkeypatch):
    """One bad layer among 16: group testing verifies halves, not every layer alone (the
    per-layer search cost 16 + 2 runs and verifications), and each run lowers a copy of one
    canonicalization."""
    from epfuse.optimizer.verify.runner import Comparator

    layers, bad = 16, 11
    original = build_decoder(DecoderConfig(layers=layers, interleaved=True))
    rules = defective_rules({bad})
    counts = {"canonicalizations": 0, "lowerings": 0, "verifications": 0}
    real_canonicalize, real_lower = PassManager.canonicalize, PassManager.lower
    real_compare = Comparator.compare

    def counting_canonicalize(self, *args, **kwargs):
        if any(rule is rules_gqa for rule in self.rules):  # the pipeline, not limits' canonical
            counts["canonicalizations"] += 1
        return real_canonicalize(self, *args, **kwargs)

    def counting_lower(self, *args, **kwargs):
        if any(rule is rules_gqa for rule in self.rules):
            counts["lowerings"] += 1
        return real_lower(self, *args, **kwargs)

    def counting_compare(self, **kwargs):
        counts["verifications"] += 1
        return real_compare(self, **kwargs)

    rules_gqa = next(r for r in rules if isinstance(r, _FlipInterleaved))
    monkeypatch.setattr(PassManager, "canonicalize", counting_canonicalize)
    monkeypatch.setattr(PassManager, "lower", counting_lower)
    monkeypatch.setattr(Comparator, "compare", counting_compare)
    optimized, report = epfuse.optimize_with_report(original, "cpu", verify=True, rules=rules)
    assert [layer.layer for layer in report.layers if not layer.fused] == [bad]
    assert report.layers[bad].codes == [ReasonCode.ROLLED_BACK]
    # Canonicalized once; lowered and verified: the first run, 2 per halving (log2 16 = 4),
    # the rolled-back model.
    assert counts == {"canonicalizations": 1, "lowerings": 10, "verifications": 10}
    assert compare_models(original, optimized).passed


class _Verdict:
    def __init__(self, passed: bool):
        self.passed = passed

    def worst_failure(self):
        return None if self.passed else "failed"


def _culprits(fused, bad=(), combinations=()):
    """api._culprits with a verdict that fails when a bad layer or a whole bad combination
    is lowered; returns the rolled-back layers and the groups verified."""
    tried = []

    def verdict(group):
        tried.append(list(group))
        lowered = set(group)
        fails = lowered & set(bad) or any(set(c) <= lowered for c in combinations)
        return _Verdict(not fails)

    return sorted(api._culprits(fused, _Verdict(False), verdict)), tried


def test_group_testing_finds_every_culprit():
    assert _culprits(list(range(8)), bad={5})[0] == [5]
    found, tried = _culprits(list(range(8)), bad={0, 6})
    assert found == [0, 6]
    assert [0, 1, 2, 3, 4, 5, 6, 7] not in tried  # the full model's verdict is given
    assert _culprits([3], bad={3}) == ([3], [])  # one fused layer: no search needed


def test_group_testing_rolls_back_a_group_that_fails_only_in_combination():
    # No layer fails alone: every lowering is rolled back, as with the per-layer search.
    assert _culprits(list(range(4)), combinations=[{0, 3}])[0] == [0, 1, 2, 3]
    # A combination inside one half costs that half, not the others.
    assert _culprits(list(range(8)), combinations=[{4, 5}])[0] == [4, 5]


def test_verify_raises_when_even_the_canonical_form_fails(monkeypatch):
    original = build_decoder(DecoderConfig(layers=1))

    real_canonicalize = PassManager.canonicalize

    def broken_canonicalization(self, model, ep, dtype, options, **kwargs):
        canonical = real_canonicalize(self, model, ep, dtype, options, **kwargs)
        lm_head = model.graph.initializers["lm_head.weight"]
        array = lm_head.const_value.numpy().copy()
        array[0, 0] += 1.0
        lm_head.const_value = ir.tensor(array, name="lm_head.weight")
        return canonical

    monkeypatch.setattr(PassManager, "canonicalize", broken_canonicalization)
    with pytest.raises(VerificationError, match="even with every lowering rolled back"):
        epfuse.optimize(original, "cpu", verify=True)


def test_verify_needs_an_original_that_runs_on_cpu():
    original = build_decoder(DecoderConfig(layers=1, dtype="bfloat16", style="mobius"))
    with pytest.raises(VerificationError, match="cannot verify"):
        epfuse.optimize(original, "cuda", verify=True)


def test_cli_optimize_verify(tmp_path, capsys, monkeypatch):
    source = tmp_path / "m.onnx"
    onnx.save(build_decoder(DecoderConfig(layers=2, interleaved=True)), source)
    # The CLI has no rule-set option: give its optimize call the defective rules.
    real = api.optimize_with_report
    monkeypatch.setattr(
        api, "optimize_with_report", lambda *a, **kw: real(*a, **kw, rules=defective_rules({0}))
    )
    assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "rolled back: failed verification" in out
    assert "verification: passed after rolling back layer(s) 0" in out
    assert main(["verify", str(source), str(tmp_path / "o.onnx")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")


def test_cli_verify_bad_input_is_one_line(tmp_path, capsys, example_model):
    assert main(["verify", str(tmp_path / "missing.onnx"), str(example_model)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"epfuse: error: {tmp_path / 'missing.onnx'}: no such file"]

    # a model whose inputs are not a decoder's
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), tmp_path / "id.onnx")
    assert main(["verify", str(tmp_path / "id.onnx"), str(tmp_path / "id.onnx")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("epfuse: error: cannot compare these models")
    assert main(["verify", str(example_model), str(example_model), "--prompt-len", "0"]) == 1


def test_verify_with_external_data(tmp_path, example_model):
    from epfuse.optimizer.io import load_model, save_model

    source = tmp_path / "ext.onnx"
    save_model(load_model(example_model), source, external_data=True)
    optimized, report = epfuse.optimize_with_report(source, "cpu", verify=True)
    assert report.verification.startswith("passed")
    save_model(optimized, tmp_path / "out.onnx")
    assert main(["verify", str(source), str(tmp_path / "out.onnx")]) == 0


def test_cli_verify_original_that_does_not_run_on_cpu(tmp_path, capsys):
    """bf16 attention has no ORT CPU kernel: one line, exit 1 (not a FAIL verdict)."""
    model = build_decoder(DecoderConfig(layers=1, dtype="bfloat16", style="mobius"))
    onnx.save(model, tmp_path / "bf16.onnx")
    assert main(["verify", str(tmp_path / "bf16.onnx"), str(tmp_path / "bf16.onnx")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ORT CPU" in err[0], err
