"""Decomposed RMSNorm -> ONNX RMSNormalization: small graphs run on ORT before and after;
norms whose rewrite would round differently (or is not an RMSNorm) are left alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from proto_graph import ProtoGraph, run_unoptimized

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.rms_norm import DecomposedRMSNormToRMSNormalization
from epfuse.patterns.reasons import ReasonCode
from epfuse.tolerances import tolerance_for

D = 32
EPS = 1e-6


@dataclasses.dataclass
class Variant:
    dtype: int = TensorProto.FLOAT
    casts: bool = False  # half precision: Cast to float32 and back around the normalization
    inverse: str = "reciprocal"  # "reciprocal" (Mul by Reciprocal) | "div" | "one_over" (Div(1, .)) | "two_over"
    square: str = "pow"  # "pow" | "mul" | "pow3"
    axes: tuple[int, ...] = (-1,)
    weight: str = "vector"  # "vector" | "one_plus" (Gemma's 1 + w) | "full" (per token)
    opset: int = 18  # below 18 ReduceMean takes its axes as an attribute


def _graph(v: Variant) -> onnx.ModelProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(v.dtype)
    rng = np.random.default_rng(1)
    g = ProtoGraph(const_dtype=np.float32)
    const, op, nodes, inits = g.const, g.op, g.nodes, g.inits

    x = op("Cast", ["x"], "xf", to=TensorProto.FLOAT) if v.casts else "x"
    if v.square == "mul":
        sq = op("Mul", [x, x], "sq")
    else:
        sq = op("Pow", [x, const("p", 3.0 if v.square == "pow3" else 2.0)], "sq")
    if v.opset >= 18:
        mean = op("ReduceMean", [sq, const("axes", list(v.axes), np.int64)], "mean", keepdims=1)
    else:
        mean = op("ReduceMean", [sq], "mean", keepdims=1, axes=list(v.axes))
    std = op("Sqrt", [op("Add", [mean, const("eps", EPS)], "var")], "std")
    if v.inverse == "div":
        normed = op("Div", [x, std], "normed")
    elif v.inverse in ("one_over", "two_over"):
        numerator = const("num", 1.0 if v.inverse == "one_over" else 2.0)
        normed = op("Mul", [x, op("Div", [numerator, std], "rstd")], "normed")
    else:
        normed = op("Mul", [x, op("Reciprocal", [std], "rstd")], "normed")
    if v.casts:
        normed = op("Cast", [normed], "normed_t", to=v.dtype)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np_dtype)
    if v.weight == "full":
        w = np.broadcast_to(w, (2, 3, D)).copy()
    weight = const("w", w, np_dtype)
    if v.weight == "one_plus":
        weight = op("Add", [const("one", 1.0, np_dtype), weight], "w1")
    op("Mul", [weight, normed], "y")
    graph = helper.make_graph(
        nodes,
        "rms",
        [helper.make_tensor_value_info("x", v.dtype, [2, 3, D])],
        [helper.make_tensor_value_info("y", v.dtype, [2, 3, D])],
        inits,
    )
    opsets = [helper.make_opsetid("", v.opset)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _apply(model: onnx.ModelProto):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, get_ep("cpu"), "float32", OptimizeOptions())
    reduce = next(n for n in ir_model.graph if n.op_type == "ReduceMean")
    return ir_model, DecomposedRMSNormToRMSNormalization().apply(reduce, ctx)


FUSED = {
    "fp32": Variant(),
    "fp32-div": Variant(inverse="div"),
    "fp32-mul-square": Variant(square="mul"),
    "fp32-gemma-one-plus": Variant(weight="one_plus"),
    "fp32-axis-2": Variant(axes=(2,)),
    "fp16-casts": Variant(dtype=TensorProto.FLOAT16, casts=True),
    "fp32-one-over": Variant(inverse="one_over"),
    "fp32-opset14-axes-attribute": Variant(opset=14),
    "fp32-opset17-axes-attribute": Variant(opset=17, axes=(2,)),
    # Optimum (TorchScript) at opset 14: x.to(float32) on float32, rsqrt as Div(1, Sqrt),
    # .to(input_dtype) back, axes attribute.
    "torchscript-opset14": Variant(opset=14, inverse="one_over", casts=True),
    "fp16-opset14-casts": Variant(dtype=TensorProto.FLOAT16, casts=True, opset=14),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_rewrites_and_computes_the_same(name):
    v = FUSED[name]
    original = _graph(v)
    fused, outcome = _apply(original)
    assert isinstance(outcome, Rewritten), outcome
    proto = ir.to_proto(fused)
    onnx.checker.check_model(proto, full_check=True)
    node = next(n for n in proto.graph.node if n.op_type == "RMSNormalization")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["stash_type"] == 1
    assert attrs["epsilon"] == pytest.approx(EPS)
    assert node.input[0] == "x"  # the Casts moved inside (stash_type=1)
    assert not {"Pow", "ReduceMean", "Sqrt", "Cast"} & {n.op_type for n in proto.graph.node}
    assert fused.opset_imports[""] == 23
    np_dtype = helper.tensor_dtype_to_np_dtype(v.dtype)
    x = (3 * np.random.default_rng(0).standard_normal((2, 3, D))).astype(np_dtype)
    dtype = "float16" if v.dtype == TensorProto.FLOAT16 else "float32"
    tol = tolerance_for(dtype)
    got, want = (
        run_unoptimized(proto, {"x": x}).astype(np.float32),
        run_unoptimized(original, {"x": x}).astype(np.float32),
    )
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    if dtype == "float16":  # same steps, same rounding: at most one fp16 ulp apart
        assert np.abs(got - want).max() <= np.spacing(np.abs(want).max().astype(np.float16))


def test_fp16_norm_computed_in_fp16_is_kept():
    fused, outcome = _apply(_graph(Variant(dtype=TensorProto.FLOAT16)))
    assert isinstance(outcome, Kept) and outcome.code is ReasonCode.DTYPE
    assert not any(n.op_type == "RMSNormalization" for n in fused.graph)


def test_per_token_weight_is_kept():
    fused, outcome = _apply(_graph(Variant(weight="full")))
    assert isinstance(outcome, Kept) and "last axis only" in outcome.message
    assert fused.opset_imports[""] == 18


@pytest.mark.parametrize(
    "variant",
    [
        Variant(square="pow3"),
        Variant(axes=(1,)),
        Variant(axes=(1,), opset=14),
        Variant(inverse="two_over"),
    ],
)
def test_not_an_rms_norm(variant):
    fused, outcome = _apply(_graph(variant))
    assert outcome is None
    assert not any(n.op_type == "RMSNormalization" for n in fused.graph)
