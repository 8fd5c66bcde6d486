"""Packed QKV for GroupQueryAttention where the record has ``gqa.packed_qkv``.

``GQA(MatMul(x, Wq) [+ bq], MatMul(x, Wk) [+ bk], MatMul(x, Wv) [+ bv], ...)`` becomes
``GQA(MatMul(x, [Wq | Wk | Wv]) [+ [bq | bk | bv]], <absent>, <absent>, ...)``: the query
input holds (B, S, (N + 2 Nkv) H) and key/value are absent, which is GQA's packed form (Q, then
K, then V along the last axis). The result is the same three products, computed by one MatMul.

Preconditions: the three projections read the same ``x``; weights are constant 2-D
initializers ``(D, N*H)``, ``(D, Nkv*H)``, ``(D, Nkv*H)`` of one dtype (biases constant 1-D of
the same widths, on all three or none); the projection outputs feed nothing but this GQA (no
RoPE or norm between them: with ``do_rotary=0`` the rotation sits there and nothing is packed).

Memory: the packed weight is a lazy tensor that concatenates the three when it is serialized,
one layer at a time, and the three originals leave the graph at once; external-data weights
are not loaded by the rewrite.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .._graph import attr, input_at, producer
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


def _dead(node: ir.Node, depth: int = 8) -> bool:
    """Nothing live reads ``node`` (rewrites leave dead nodes until the final cleanup, e.g.
    the RotaryEmbedding a fused GQA replaced)."""
    if depth == 0:
        return False
    for out in node.outputs:
        if out.is_graph_output():
            return False
        if not all(_dead(use.node, depth - 1) for use in out.uses()):
            return False
    return True


def _collect_dead_users(node: ir.Node, into: dict[int, ir.Node]) -> None:
    for out in node.outputs:
        for use in out.uses():
            if id(use.node) not in into and _dead(use.node):
                into[id(use.node)] = use.node
                _collect_dead_users(use.node, into)


def _only_feeds(value: ir.Value, consumer: ir.Node) -> bool:
    if value.is_graph_output():
        return False
    return all(u.node is consumer or _dead(u.node) for u in value.uses())


def _projection(value: ir.Value | None, gqa: ir.Node):
    """(x, weight, bias | None, nodes) when ``value = MatMul(x, W) [+ b]`` feeds only ``gqa``."""
    if value is None or not _only_feeds(value, gqa):
        return None
    nodes = []
    bias = None
    add = producer(value, "Add")
    if add is not None:
        a, b = add.inputs
        if b is not None and b.const_value is not None and a is not None:
            bias, value = b, a
        elif a is not None and a.const_value is not None and b is not None:
            bias, value = a, b
        else:
            return None
        if not _only_feeds(value, add):
            return None
        nodes.append(add)
    matmul = producer(value, "MatMul")
    if matmul is None:
        return None
    nodes.append(matmul)
    x, weight = matmul.inputs
    if weight is None or weight.const_value is None or not weight.is_initializer():
        return None
    return x, weight, bias, nodes


def _name(graph: ir.Graph, q_param: ir.Value, fallback: str) -> str:
    """``...q_proj.weight`` -> ``...qkv_proj.weight`` (unique), else ``fallback``."""
    name = q_param.name or ""
    base = name.replace("q_proj", "qkv_proj") if "q_proj" in name else fallback
    candidate, n = base, 0
    while candidate in graph.initializers:
        n += 1
        candidate = f"{base}_{n}"
    return candidate


def _concat(parts: list[ir.TensorProtocol], axis: int, name: str) -> ir.LazyTensor:
    first = parts[0]
    shape = list(first.shape)
    shape[axis] = sum(p.shape[axis] for p in parts)

    def load() -> ir.TensorProtocol:
        packed = np.concatenate([p.numpy() for p in parts], axis=axis)
        for part in parts:
            # External parts are memory-mapped: unmap them once copied (they map again if
            # read again), so reading a packed weight costs its bytes once, not twice.
            if isinstance(part, ir.ExternalTensor):
                with contextlib.suppress(BufferError):  # a view still alive elsewhere
                    part.release()
        return ir.tensor(packed, name=name)

    return ir.LazyTensor(load, dtype=first.dtype, shape=ir.Shape(shape), name=name)


def _register(graph: ir.Graph, tensor: ir.TensorProtocol) -> ir.Value:
    """``tensor`` (a lazy packed weight or bias) as a new initializer of ``graph``; its name is
    already unique (``_name``)."""
    value = ir.Value(name=tensor.name, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


class PackQKV(
    Rule,
    name="pack-qkv",
    stage=Stage.LOWER,
    anchor=("com.microsoft", "GroupQueryAttention"),
    emits=(Capability.GQA_PACKED_QKV,),
):
    """three Q/K/V projections of one input -> one MatMul feeding packed GQA"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        q, k, v = (input_at(node, i) for i in range(3))
        if k is None or v is None:
            return None  # already packed
        if len({id(q), id(k), id(v)}) != 3:
            return None
        found = [_projection(t, node) for t in (q, k, v)]
        if any(f is None for f in found):
            return None
        xs = {id(f[0]) for f in found}
        if len(xs) != 1:
            return Kept(ReasonCode.FORM, "Q, K and V are projected from different inputs")
        heads, kv_heads = attr(node, "num_heads"), attr(node, "kv_num_heads")
        weights = [f[1].const_value for f in found]
        if any(w.shape is None or len(w.shape) != 2 for w in weights):
            return Kept(ReasonCode.SHAPE, "a projection weight is not 2-D")
        widths = [int(w.shape[1]) for w in weights]
        if widths[0] % heads or widths[1] != widths[2]:
            return Kept(ReasonCode.HEADS, "projection widths do not match the GQA heads")
        head_size = widths[0] // heads
        if widths[1] != kv_heads * head_size:
            return Kept(ReasonCode.HEADS, "projection widths do not match the GQA heads")
        if len({int(w.shape[0]) for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            return Kept(ReasonCode.SHAPE, "projection weights differ in input width or dtype")
        biases = [f[2] for f in found]
        if any(b is not None for b in biases):
            if any(b is None for b in biases):
                return Kept(ReasonCode.FORM, "only some of Q, K, V have a bias")
            tensors = [b.const_value for b in biases]
            if any(
                t.shape is None or list(t.shape) != [w]
                for t, w in zip(tensors, widths, strict=True)
            ):
                return Kept(
                    ReasonCode.SHAPE, "a projection bias is not 1-D of its projection's width"
                )
            if len({t.dtype for t in tensors}) != 1:
                return Kept(ReasonCode.DTYPE, "projection biases differ in dtype")
        return node, found, weights, biases, widths

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, found, weights, biases, widths = match
        graph = ctx.graph
        x = found[0][0]
        prefix = f"{node.name or 'gqa'}/packed_qkv"
        w_value = _register(
            graph, _concat(weights, 1, _name(graph, found[0][1], f"{prefix}.weight"))
        )
        matmul = ir.node("MatMul", [x, w_value], name=f"{prefix}/MatMul")
        graph.insert_before(node, matmul)
        packed = matmul.outputs[0]
        packed.name = f"{prefix}/matmul_out"
        if biases[0] is not None:
            b_value = _register(
                graph,
                _concat(
                    [b.const_value for b in biases], 0, _name(graph, biases[0], f"{prefix}.bias")
                ),
            )
            add = ir.node("Add", [packed, b_value], name=f"{prefix}/Add")
            graph.insert_before(node, add)
            packed = add.outputs[0]
            packed.name = f"{prefix}/out"
        node.replace_input_with(0, packed)
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        old_values = [f[1] for f in found] + [b for b in biases if b is not None]
        doomed: dict[int, ir.Node] = {}
        for f in found:
            for n in f[3]:
                _collect_dead_users(n, doomed)
                doomed[id(n)] = n
        graph.remove(list(doomed.values()), safe=True)
        for value in old_values:
            if not value.uses() and value.name in graph.initializers:
                graph.initializers.pop(value.name)
        total = sum(widths)
        return Rewritten(f"Q/K/V projections packed into one MatMul of width {total}")
