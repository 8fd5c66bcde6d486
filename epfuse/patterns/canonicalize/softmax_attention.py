"""Lift an explicit softmax attention to ONNX ``Attention``:

``MatMul(Softmax(Add(softcap(scale(MatMul(q, Transpose(k, [0, 1, 3, 2])))), mask)), v)``
becomes ``Attention(q, k, v, mask, scale=s, softcap=c)``.

torch.onnx emits ``Attention`` for ``scaled_dot_product_attention``, but models that compute
attention by hand (eager attention, e.g. because they softcap the logits) come out as this
chain, even at opset 23. The chain is lifted only in exactly the order ONNX Attention
computes (Q·Kᵀ, scale, softcap, additive mask, softmax over the last axis, ·V):

* ``scale``: at most one ``Mul`` / ``Div`` by a scalar constant (none means ``scale=1``; any
  scaling applied to Q or K before the MatMul stays in the graph and is still correct);
* ``softcap``: ``Mul(Tanh(Div(x, c)), c)`` (or ``Mul(x, 1/c)`` inside) with the same ``c``;
* ``mask``: one ``Add`` of a rank <= 4 tensor of the scores' dtype (or none).

Every intermediate value must feed only the next op of the chain, so nothing else reads a
value that disappears. Q, K and V must be rank 4 (B, N, S, H); grouped K/V heads are handled
afterwards by the repeat_kv and KV-cache rules. What the mask means is not decided here: the
lowering proves it by evaluation.
"""

from __future__ import annotations

import onnx_ir as ir

from .._graph import attr, const_scalar, input_at, producer, replace_value
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage

_KT_PERM = [0, 1, 3, 2]


def _single_use(value: ir.Value, node: ir.Node) -> bool:
    uses = list(value.uses())
    return not value.is_graph_output() and len(uses) == 1 and uses[0].node is node


def _scalar_operand(node: ir.Node) -> tuple[ir.Value, float] | None:
    """(the other operand, the constant) of a binary op with one scalar constant operand."""
    a, b = node.inputs[0], input_at(node, 1)
    if b is None:
        return None
    cb = const_scalar(b)
    if cb is not None and a.const_value is None:
        return a, cb
    if node.op_type == "Mul":
        ca = const_scalar(a)
        if ca is not None and b.const_value is None:
            return b, ca
    return None


class _Chain:
    """The nodes of the chain, walked backwards from the Softmax."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []
        self.mask: ir.Value | None = None
        self.softcap = 0.0
        self.scale = 1.0


def _strip_softcap(value: ir.Value, chain: _Chain) -> ir.Value | str:
    outer = producer(value, "Mul")
    if outer is None:
        return value
    scaled = _scalar_operand(outer)
    if scaled is None:
        return value
    tanh = producer(scaled[0], "Tanh")
    if tanh is None:
        return value  # a plain scale Mul, not a softcap
    cap = scaled[1]
    inner = tanh.inputs[0].producer()
    if inner is None or inner.op_type not in ("Div", "Mul"):
        return "softcap tanh input is not a division by the cap"
    divided = _scalar_operand(inner)
    if divided is None:
        return "softcap tanh input is not a division by a constant"
    factor = divided[1] if inner.op_type == "Div" else 1.0 / divided[1]
    if cap <= 0 or abs(factor - cap) > 1e-6 * cap:
        return f"softcap divides by {factor:g} but multiplies by {cap:g}"
    if not (_single_use(inner.outputs[0], tanh) and _single_use(tanh.outputs[0], outer)):
        return "softcap intermediates are used elsewhere"
    chain.nodes += [outer, tanh, inner]
    chain.softcap = cap
    return divided[0]


def _strip_scale(value: ir.Value, chain: _Chain) -> ir.Value:
    node = value.producer()
    if node is None or node.op_type not in ("Mul", "Div"):
        return value
    scaled = _scalar_operand(node)
    if scaled is None or (node.op_type == "Div" and scaled[1] == 0):
        return value
    chain.nodes.append(node)
    chain.scale = scaled[1] if node.op_type == "Mul" else 1.0 / scaled[1]
    return scaled[0]


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


class SoftmaxAttentionToAttention(Rule):
    name = "softmax-attention-to-attention"
    stage = Stage.CANONICALIZE
    anchor = ("", "Softmax")
    description = "MatMul/scale/softcap/mask/Softmax/MatMul chain -> ONNX Attention"

    def apply(self, node: ir.Node, ctx: RewriteContext):
        opsets = ctx.model.opset_imports
        if opsets.get("", opsets.get("ai.onnx", 0)) < 23:
            # Attention is an opset-23 op: below, ``sdpa`` lifts the chain and raises the
            # opset only where that is proven safe; this rule must not emit it unraised.
            return None
        probs = node.outputs[0]
        uses = list(probs.uses())
        if len(uses) != 1 or probs.is_graph_output():
            return None
        out_mm = uses[0].node
        if out_mm.op_type != "MatMul" or out_mm.domain != "" or uses[0].idx != 0:
            return None
        chain = _Chain()
        value = node.inputs[0]
        add = producer(value, "Add")
        scores: ir.Value | None = value
        if add is not None:
            scores = None
            for a, b in ((0, 1), (1, 0)):
                if _leads_to_qk(add.inputs[a]):
                    scores, chain.mask = add.inputs[a], add.inputs[b]
                    break
            if scores is None:
                return None
            if not _single_use(add.outputs[0], node):
                return None
            chain.nodes.append(add)
        stripped = _strip_softcap(scores, chain)
        if isinstance(stripped, str):
            return Kept(stripped)
        pre_scale = _strip_scale(stripped, chain)
        qk = producer(pre_scale, "MatMul")
        if qk is None:
            return None
        transpose = producer(qk.inputs[1], "Transpose")
        if transpose is None or list(attr(transpose, "perm", [])) != _KT_PERM:
            return None
        q, k, v = qk.inputs[0], transpose.inputs[0], out_mm.inputs[1]
        # Only now is this the attention shape; every further failure is a reason.
        for name, val in (("Q", q), ("K", k), ("V", v)):
            if _rank(val) != 4:
                return Kept(f"{name} of the softmax attention is not known to be rank 4")
        axis = attr(node, "axis", -1)
        if axis not in (-1, 3):
            return Kept(f"softmax over axis {axis}, not the key axis")
        links = [qk, *reversed(chain.nodes)]
        for prev, nxt in zip(links, [*links[1:], node], strict=True):
            if not _single_use(prev.outputs[0], nxt):
                return Kept("an intermediate of the softmax attention is used elsewhere")
        dtype = q.dtype
        if dtype is None or k.dtype != dtype or v.dtype != dtype:
            return Kept("Q, K and V do not share a known dtype")
        mask = chain.mask
        if mask is not None:
            if mask.dtype != dtype:
                return Kept("the additive mask has another dtype than the scores")
            if _rank(mask) is None or _rank(mask) > 4:
                return Kept("the additive mask is not known to be rank <= 4")
        attributes: dict[str, float] = {"scale": float(chain.scale)}
        if chain.softcap:
            attributes["softcap"] = float(chain.softcap)
        attention = ir.node(
            "Attention",
            [q, k, v, mask] if mask is not None else [q, k, v],
            attributes,
            num_outputs=1,
            name=f"{out_mm.name or 'softmax_attention'}/Attention",
        )
        ctx.graph.insert_before(out_mm, attention)
        y = attention.outputs[0]
        old = out_mm.outputs[0]
        y.shape, y.type = old.shape, old.type
        y.name = f"{attention.name}/Y"
        replace_value(old, y)
        dead = [out_mm, node, *chain.nodes, qk]
        if _single_use(transpose.outputs[0], qk):
            dead.append(transpose)
        ctx.graph.remove(dead, safe=True)
        parts = [f"scale {chain.scale:g}"]
        if chain.softcap:
            parts.append(f"softcap {chain.softcap:g}")
        return Rewritten("softmax attention lifted to Attention (" + ", ".join(parts) + ")")


def _leads_to_qk(value: ir.Value, depth: int = 0) -> bool:
    """Whether ``value`` comes from MatMul(_, Transpose(_, [0, 1, 3, 2])) through at most
    four elementwise scale/softcap ops (to tell the scores from the mask in the Add)."""
    node = value.producer()
    if node is None or depth > 4:
        return False
    if node.op_type == "MatMul":
        t = producer(node.inputs[1], "Transpose")
        return t is not None and list(attr(t, "perm", [])) == _KT_PERM
    if node.op_type in ("Mul", "Div", "Tanh"):
        return any(
            i is not None and i.const_value is None and _leads_to_qk(i, depth + 1)
            for i in node.inputs
        )
    return False
