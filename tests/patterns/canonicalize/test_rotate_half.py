"""Rotate-half RoPE -> ONNX RotaryEmbedding, then constant caches: small graphs run on ORT
before and after; forms that are not provably rotate-half are left alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import pytest
from onnx import TensorProto, helper
from proto_graph import ProtoGraph, run_unoptimized

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.rope_caches import RopeCosSinToCaches
from epfuse.patterns.canonicalize.rotate_half import RotateHalfToRotaryEmbedding

B, N, S, H = 2, 3, 5, 16
BIG = 2**63 - 1


@dataclasses.dataclass
class Variant:
    rotary: int = H  # < H: partial rotary, rest passed through
    scaling: float | None = None  # attention_scaling Mul on cos/sin
    dtype: int = TensorProto.FLOAT
    # "same": Concat(f, f) | "twin": Concat(f, f') with f' a duplicate of f's subgraph |
    # "after-trig": Concat(Cos(f), Cos(f')) | "different": Concat(f, 2f) |
    # "lookalike": Concat(f, f') with f' the same ops on an inv_freq differing in one entry
    halves: str = "same"
    order: str = "neg-first"  # "neg-first" (HF) | "swapped" (Concat(x1, -x2): not rotate-half)
    split: int | None = None  # first-half width (default rotary // 2)
    scale_then_cast: bool = False  # HF: (cos(emb) * scaling).to(dtype), vs Cast then Mul
    freqs_form: str = "mul"  # "mul" (torch folds the K=1 matmul) | "matmul" (HF's expanded)
    interleaved: bool = False  # GPT-J/Cohere rotate_every_two on repeat_interleave'd cos/sin
    interleaved_cos: bool | None = None  # cos/sin built interleaved (default: as the rotation)
    # TorchScript (Optimum) idioms: "shape": split point x.shape[-1] // 2 computed in the graph
    split_form: str = "const"
    # "opaque": inv_freq expanded to a batch shape inference cannot name (Where over -1), so
    # the cos/sin batch is not provably x's: proven cache rows of the positions instead
    batch_form: str = "positions"
    # interleaved cos/sin: "expand" (dynamo) | "concat" (pairs stacked by Concat: only the
    # evaluation proves it) | "wrong" (the pair's second entry is 2f: must be kept) |
    # "after-heads" (the first half of Concat(f, f) repeated pairwise after the head axis)
    pair_form: str = "expand"
    # cos/sin as rows of constant tables (transformers < 4.38's cos_cached[:n][position_ids]):
    # "gather" | "sliced" (Slice of the rows first) | "uneven" (second half differs: kept)
    table: str | None = None


def _graph(v: Variant) -> onnx.ModelProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(v.dtype)
    g = ProtoGraph(const_dtype=np.int64)
    const, op, nodes, inits = g.const, g.op, g.nodes, g.inits

    const("a1", [1])
    half = v.rotary // 2
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, v.rotary, 2) / v.rotary))
    if v.freqs_form in ("matmul", "matmul-tile"):
        # inv_freq[None, :, None].expand(B, -1, 1) @ position_ids[:, None, :].float(), then .T
        inv3 = op(
            "Unsqueeze", [const("inv_freq", inv_freq, np.float32), const("a02", [0, 2])], "i3"
        )
        batch = op("Shape", ["position_ids"], "batch", start=0, end=1)
        target = op("Concat", [batch, const("tail", [half, 1])], "target", axis=0)
        if v.batch_form == "opaque":  # TorchScript's expand(-1) handling
            one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
            ones = op("ConstantOfShape", [const("three", [3])], "ones", value=one)
            minus = op("Mul", [ones, const("m1f", [-1])], "minus")
            target = op("Where", [op("Equal", [target, minus], "is_m1"), "ones", target], "tw")
        if v.freqs_form == "matmul-tile":  # Optimum's Cohere patch: .repeat(batch, 1, 1)
            reps = op("Concat", [batch, const("ones2", [1, 1])], "reps", axis=0)
            expanded = op("Tile", [inv3, reps], "inv_expanded")
        else:
            expanded = op("Expand", [inv3, target], "inv_expanded")
        pos = op("Cast", [op("Unsqueeze", ["position_ids", "a1"], "p3")], "pf", to=1)
        freqs = op("Transpose", [op("MatMul", [expanded, pos], "mm")], "freqs", perm=[0, 2, 1])
    else:
        pos = op("Cast", [op("Unsqueeze", ["position_ids", const("a2", [2])], "p3")], "pf", to=1)
        freqs = op("Mul", [pos, const("inv_freq", inv_freq, np.float32)], "freqs")
    second = freqs
    if v.halves == "different":
        second = op("Mul", [freqs, const("two", 2.0, np.float32)], "freqs2")
    elif v.halves in ("twin", "after-trig", "lookalike"):
        assert v.freqs_form == "mul"
        other = inv_freq.copy()
        if v.halves == "lookalike":
            other[-1] *= 1.5
        pos2 = op("Cast", [op("Unsqueeze", ["position_ids", "a2"], "p3b")], "pfb", to=1)
        second = op("Mul", [pos2, const("inv_freq_b", other, np.float32)], "freqs_b")
    if v.table is not None:
        angles = np.arange(256)[:, None] * inv_freq[None, :]
        tables = []
        for trig in (np.cos, np.sin):
            half_table = trig(angles)
            if v.interleaved:
                full = np.repeat(half_table, 2, axis=-1)
            else:
                full = np.concatenate([half_table, half_table], axis=-1)
            if v.table == "uneven":
                full[:, -1] += 0.25
            tables.append(full)
        gathered = []
        for name, table in zip(("cos_cached", "sin_cached"), tables, strict=True):
            rows = const(name, table, np.float32)
            if v.table == "sliced":
                rows = op(
                    "Slice",
                    [rows, const(f"{name}_0", [0]), const(f"{name}_n", [BIG]), "a0r"],
                    f"{name}_rows",
                )
            gathered.append(op("Gather", [rows, "position_ids"], f"{name}_at", axis=0))
        const("a0r", [0])
        cos, sin = gathered
    elif v.halves == "after-trig":
        cos = op("Concat", [op("Cos", [freqs], "c1"), op("Cos", [second], "c2")], "cos", axis=-1)
        sin = op("Concat", [op("Sin", [freqs], "s1"), op("Sin", [second], "s2")], "sin", axis=-1)
    elif v.interleaved if v.interleaved_cos is None else v.interleaved_cos:
        f4 = op("Unsqueeze", [freqs, const("a3", [3])], "f4")
        if v.pair_form == "expand":
            pairs = op("Expand", [f4, const("rep2", [1, 1, 1, 2])], "pairs")
        else:
            other = f4
            if v.pair_form == "wrong":
                other = op("Mul", [f4, const("two_f", 2.0, np.float32)], "f4x2")
            pairs = op("Concat", [f4, other], "pairs", axis=-1)
        bs = op("Shape", [freqs], "bs", start=0, end=-1)
        emb = op("Reshape", [pairs, op("Concat", [bs, const("m1", [-1])], "es", axis=0)], "emb")
        cos, sin = op("Cos", [emb], "cos"), op("Sin", [emb], "sin")
    else:
        emb = op("Concat", [freqs, second], "emb", axis=-1)
        cos, sin = op("Cos", [emb], "cos"), op("Sin", [emb], "sin")
    steps = ["cast", "scale"] if not v.scale_then_cast else ["scale", "cast"]
    for step in steps:
        if step == "cast" and v.dtype != TensorProto.FLOAT:
            cos, sin = (
                op("Cast", [cos], "cos_t", to=v.dtype),
                op("Cast", [sin], "sin_t", to=v.dtype),
            )
        if step == "scale" and v.scaling is not None:
            scale_dtype = np.float32 if v.scale_then_cast else np_dtype
            scale = const("scaling", v.scaling, scale_dtype)
            cos, sin = op("Mul", [cos, scale], "cos_s"), op("Mul", [sin, scale], "sin_s")
    cos4 = op("Unsqueeze", [cos, "a1"], "cos4")
    sin4 = op("Unsqueeze", [sin, "a1"], "sin4")
    if v.pair_form == "after-heads":
        # GLM / Ernie 4.5: cos[..., : D/2].repeat_interleave(2) after the head unsqueeze, on
        # cos/sin built as Concat(f, f)
        ends = const("half_end", [v.rotary // 2])
        rep = const("rep5", [1, 1, 1, 1, 2])
        target = op(
            "Concat",
            [op("Shape", [cos4], "b1s", start=0, end=3), const("dr", [v.rotary])],
            "t4",
            axis=0,
        )
        for name in ("cos4", "sin4"):
            first = op(
                "Slice",
                [name, const(f"{name}_0", [0]), ends, const(f"{name}_ax", [3])],
                f"{name}_h",
            )
            five = op("Unsqueeze", [first, const(f"{name}_a4", [4])], f"{name}_5")
            pairs = op("Expand", [five, rep], f"{name}_pairs")
            op("Reshape", [pairs, target], f"{name}_rep")
        cos4, sin4 = "cos4_rep", "sin4_rep"

    def last_slice(x, start, end, out):
        return op("Slice", [x, const(f"{out}_s", [start]), const(f"{out}_e", [end]), "ax3"], out)

    const("ax3", [3])
    x = "x"
    if v.rotary < H:
        x = last_slice("x", 0, v.rotary, "x_rot")
    if v.interleaved:
        two = const("two_step", [2])
        even = op("Slice", [x, const("zero", [0]), const("big", [BIG]), "ax3", two], "even")
        odd = op("Slice", [x, const("one", [1]), "big", "ax3", two], "odd")
        neg = op("Unsqueeze", [op("Neg", [odd], "neg"), const("last", [-1])], "neg5")
        pos = op("Unsqueeze", [even, "last"], "even5")
        parts = [neg, pos] if v.order == "neg-first" else [pos, neg]
        stack = op("Concat", parts, "stack", axis=-1)
        bns = op("Shape", [x], "bns", start=0, end=3)
        flat = op("Concat", [bns, const("width", [v.rotary])], "flat", axis=0)
        turned = op("Reshape", [stack, flat], "turned")
    elif v.split_form == "shape":
        # x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :] as TorchScript writes them
        width = op("Gather", [op("Shape", [x], "x_shape"), const("i3", 3)], "x_width", axis=0)
        mid = op("Unsqueeze", [op("Div", [width, const("i2", 2)], "x_mid"), "a0"], "x_mid1")
        const("a0", [0])
        x1 = op("Slice", [x, const("s0", [0]), mid, "ax3", const("st1", [1])], "x1")
        x2 = op("Slice", [x, mid, const("sbig", [BIG]), "ax3", "st1"], "x2")
        neg = op("Neg", [x2], "neg")
        turned = op("Concat", [neg, x1], "turned", axis=-1)
    else:
        split = v.split or half
        x1, x2 = last_slice(x, 0, split, "x1"), last_slice(x, split, BIG, "x2")
        neg = op("Neg", [x2], "neg")
        parts = [neg, x1] if v.order == "neg-first" else [x1, neg]
        turned = op("Concat", parts, "turned", axis=-1)
    y = op("Add", [op("Mul", [x, cos4], "xc"), op("Mul", [turned, sin4], "xs")], "y_rot")
    if v.rotary < H:
        y = op("Concat", [y, last_slice("x", v.rotary, BIG, "x_pass")], "y_cat", axis=-1)
    op("Identity", [y], "y")
    inputs = [
        helper.make_tensor_value_info("x", v.dtype, ["batch", N, "seq", H]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rope",
        inputs,
        [helper.make_tensor_value_info("y", v.dtype, ["batch", N, "seq", H])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _ctx(model: onnx.ModelProto):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    dtype = "float16" if model.graph.input[0].type.tensor_type.elem_type == 10 else "float32"
    return ir_model, RewriteContext(ir_model, get_ep("cpu"), dtype, OptimizeOptions(256))


def _rope_add(ir_model: ir.Model) -> ir.Node:
    return next(n for n in ir_model.graph if n.op_type == "Add" and n.outputs[0].name == "y_rot")


def _feeds(dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, N, S, H)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    positions = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 200, 255]], dtype=np.int64)
    return {"x": x, "position_ids": positions}


FUSED = {
    "full": Variant(),
    "attention-scaling": Variant(scaling=0.75),
    "partial": Variant(rotary=8),
    "fp16-cast": Variant(dtype=TensorProto.FLOAT16),
    "fp16-scaled-then-cast": Variant(dtype=TensorProto.FLOAT16, scaling=0.8, scale_then_cast=True),
    "matmul-freqs": Variant(freqs_form="matmul"),
    "duplicated-subgraph": Variant(halves="twin"),
    "halves-after-trig-fp16": Variant(halves="after-trig", dtype=TensorProto.FLOAT16, scaling=0.5),
    "matmul-freqs-partial-scaled": Variant(freqs_form="matmul", rotary=8, scaling=1.25),
    "interleaved": Variant(interleaved=True),
    "interleaved-partial-fp16": Variant(interleaved=True, rotary=8, dtype=TensorProto.FLOAT16),
    "interleaved-after-heads": Variant(
        interleaved=True, interleaved_cos=False, pair_form="after-heads"
    ),
    "interleaved-after-heads-partial": Variant(
        interleaved=True, interleaved_cos=False, pair_form="after-heads", rotary=8
    ),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_rotate_half_becomes_rotary_embedding_then_caches(name):
    v = FUSED[name]
    original = _graph(v)
    ir_model, ctx = _ctx(original)
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Rewritten), outcome
    rope = next(n for n in ir_model.graph if n.op_type == "RotaryEmbedding")
    assert rope.attributes["interleaved"].value == int(v.interleaved)
    width = rope.attributes.get("rotary_embedding_dim")
    assert (width.value if width else H) == v.rotary
    assert rope.inputs[0].name == "x"  # partial: the whole head, the rest passed through
    assert ir_model.opset_imports[""] == 23
    stage1 = ir.to_proto(ir_model)
    onnx.checker.check_model(stage1, full_check=True)
    assert not {"Neg", "Slice"} & {n.op_type for n in stage1.graph.node}

    # The half-width cos/sin are the form rope_caches proves and turns into caches.
    outcome = RopeCosSinToCaches().apply(rope, ctx)
    assert isinstance(outcome, Rewritten), outcome
    cos_cache = rope.inputs[1].const_value.numpy()
    assert cos_cache.shape == (256, v.rotary // 2)
    stage2 = ir.to_proto(ir_model)
    onnx.checker.check_model(stage2, full_check=True)

    feeds = _feeds(v.dtype)
    want = run_unoptimized(original, feeds).astype(np.float32)
    tol = 2e-3 if v.dtype == TensorProto.FLOAT16 else 1e-5
    for model in (stage1, stage2):
        np.testing.assert_allclose(
            run_unoptimized(model, feeds).astype(np.float32), want, atol=tol, rtol=tol
        )


@pytest.mark.parametrize("halves", ["different", "lookalike"])
def test_unequal_halves_are_kept(halves):
    """cos = Cos(Concat(f, g)) with g != f is not [c, c]: its first half would be wrong."""
    ir_model, ctx = _ctx(_graph(Variant(halves=halves)))
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Kept) and "halves" in outcome.message
    assert not any(n.op_type == "RotaryEmbedding" for n in ir_model.graph)
    assert ir_model.opset_imports[""] == 18


def test_interleaved_rotation_with_concatenated_halves_is_kept():
    """An interleaved rotation needs [c0, c0, c1, c1, ...]; Concat(f, f) is [c, c]."""
    ir_model, ctx = _ctx(_graph(Variant(interleaved=True, interleaved_cos=False)))
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Kept) and "halves" in outcome.message
    assert not any(n.op_type == "RotaryEmbedding" for n in ir_model.graph)


def test_pairs_repeated_after_heads_from_unequal_halves_are_kept():
    """The after-heads form reads c[..., :D/2] of c = Cos(Concat(f, 2f)): c is not proven two
    equal halves, so nothing changes."""
    v = Variant(
        interleaved=True, interleaved_cos=False, pair_form="after-heads", halves="different"
    )
    ir_model, ctx = _ctx(_graph(v))
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Kept) and "halves" in outcome.message
    assert not any(n.op_type == "RotaryEmbedding" for n in ir_model.graph)


@pytest.mark.parametrize(
    "variant",
    [Variant(order="swapped"), Variant(split=6), Variant(interleaved=True, order="swapped")],
)
def test_other_rotations_are_not_matched(variant):
    ir_model, ctx = _ctx(_graph(variant))
    assert RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx) is None
    assert not any(n.op_type == "RotaryEmbedding" for n in ir_model.graph)


# Exporter idioms outside the structural [c, c] proof: transformers 4.x under the TorchScript
# exporter (Optimum). Each must end as RotaryEmbedding with constant caches read at the
# position_ids (the form GQA's fused rotary takes) and compute what the original computes.
CACHED = {
    "shape-computed-split": Variant(split_form="shape"),
    "opaque-batch": Variant(freqs_form="matmul", batch_form="opaque"),
    "opaque-batch-scaled-partial": Variant(
        freqs_form="matmul", batch_form="opaque", scaling=0.5, rotary=8
    ),
    "tiled-inv-freq-interleaved": Variant(freqs_form="matmul-tile", interleaved=True),
    "pairs-by-concat-interleaved": Variant(
        freqs_form="matmul", interleaved=True, pair_form="concat"
    ),
    "table-gathered": Variant(table="gather"),
    "table-sliced-then-gathered": Variant(table="sliced"),
    "table-interleaved": Variant(table="gather", interleaved=True),
    "pairs-by-concat-interleaved-scaled": Variant(
        freqs_form="matmul", interleaved=True, pair_form="concat", scaling=0.75
    ),
}


@pytest.mark.parametrize("name", list(CACHED))
def test_exporter_forms_become_cached_rotary_embedding(name):
    v = CACHED[name]
    original = _graph(v)
    ir_model, ctx = _ctx(original)
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Rewritten), outcome
    RopeCosSinToCaches().apply(
        next(n for n in ir_model.graph if n.op_type == "RotaryEmbedding"), ctx
    )
    rope = next(n for n in ir_model.graph if n.op_type == "RotaryEmbedding")
    assert rope.attributes["interleaved"].value == int(v.interleaved)
    assert rope.inputs[1].const_value.numpy().shape == (256, v.rotary // 2)
    assert rope.inputs[3].name == "position_ids"
    ir.passes.common.RemoveUnusedNodesPass()(ir_model)
    optimized = ir.to_proto(ir_model)
    onnx.checker.check_model(optimized, full_check=True)
    assert not {"Neg", "Cos", "Sin"} & {n.op_type for n in optimized.graph.node}
    feeds = _feeds(v.dtype)
    np.testing.assert_allclose(
        run_unoptimized(optimized, feeds), run_unoptimized(original, feeds), atol=1e-5, rtol=1e-5
    )


def test_pairs_that_are_not_repeated_are_kept():
    """Interleaved cos/sin whose pairs are (f, 2f) evaluate to something else: kept."""
    v = Variant(freqs_form="matmul", interleaved=True, pair_form="wrong")
    ir_model, ctx = _ctx(_graph(v))
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Kept) and "do not match" in outcome.message, outcome
    assert not any(n.op_type == "RotaryEmbedding" for n in ir_model.graph)
    assert ir_model.opset_imports[""] == 18


def test_tables_that_are_not_two_halves_are_kept():
    ir_model, ctx = _ctx(_graph(Variant(table="uneven")))
    outcome = RotateHalfToRotaryEmbedding().apply(_rope_add(ir_model), ctx)
    assert isinstance(outcome, Kept) and "tables are not two equal halves" in outcome.message
    assert not any(n.op_type == "RotaryEmbedding" for n in ir_model.graph)
