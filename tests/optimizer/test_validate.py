"""Validation of models whose weights live in external data: the weights are never read (so
optimizing a large model does not hold them), yet broken graphs are still rejected."""

from __future__ import annotations

import onnx_ir as ir
import pytest

import epfuse
from epfuse.errors import ValidationError
from epfuse.optimizer import validate as validate_module
from epfuse.optimizer.io import load_model, save_model
from epfuse.optimizer.verify import assert_equivalent

THRESHOLD = 4096  # bytes; the example's weights are 8-64 KiB, so most count as large


@pytest.fixture
def external_example(tmp_path, example_model, monkeypatch):
    monkeypatch.setattr(validate_module, "WEIGHT_INPUT_BYTES", THRESHOLD)
    path = tmp_path / "ext.onnx"
    save_model(load_model(example_model), path, external_data=True)
    return path


@pytest.fixture
def reads(monkeypatch):
    """Names of external tensors of at least THRESHOLD bytes whose data was read."""
    seen: list[str] = []
    for method in ("numpy", "tobytes", "tofile"):
        original = getattr(ir.ExternalTensor, method)

        def spy(self, *args, _original=original, **kwargs):
            if self.nbytes >= THRESHOLD:
                seen.append(self.name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ir.ExternalTensor, method, spy)
    return seen


def test_optimize_never_reads_large_external_weights(external_example, reads, example_model):
    model = load_model(external_example)
    large = [
        v.name
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor) and v.const_value.nbytes >= THRESHOLD
    ]
    assert len(large) >= 10  # the embedding, projections, MLP and lm_head weights
    optimized, report = epfuse.optimize_with_report(external_example, "cpu")
    assert report.fused_layers == 2
    # The packed QKV weights are lazy concatenations of external ones: not evaluated either.
    assert any(
        isinstance(v.const_value, ir.LazyTensor) for v in optimized.graph.initializers.values()
    )
    assert reads == []  # neither the rules, shape inference nor validation read them
    # ... and the output is still the same function (saving does read them, once).
    out = external_example.parent / "out" / "opt.onnx"
    save_model(optimized, out)
    assert (out.parent / "opt.onnx.data").exists()
    assert_equivalent(str(example_model), str(out), scenarios=("prompt", "decode"))


def test_validation_still_rejects_a_type_error_on_an_external_weight(external_example, reads):
    model = load_model(external_example)
    node = next(
        n
        for n in model.graph
        if n.op_type == "MatMul"
        and n.inputs[1] is not None
        and isinstance(n.inputs[1].const_value, ir.ExternalTensor)
    )
    node.op_type = "Gather"  # float weight as Gather indices: only type inference sees it
    with pytest.raises(ValidationError, match="does not load in ONNX Runtime"):
        validate_module.validate(model)
    assert reads == []


def test_small_external_tensors_are_inlined_for_validation(external_example, monkeypatch):
    # With the threshold above every tensor, all external data is read and inlined: the
    # check then runs on the complete model, as for an in-memory one.
    monkeypatch.setattr(validate_module, "WEIGHT_INPUT_BYTES", 1 << 40)
    model = load_model(external_example)
    proto = ir.to_proto(model)
    validate_module._external_weights_to_inputs(proto, model)
    assert not validate_module._has_external(proto)
    assert {i.name for i in proto.graph.input} == {v.name for v in model.graph.inputs}
    assert validate_module.validate(model) is None
