"""Experts written out per expert (a loop over the experts, or every expert on every token)
-> the batched experts form ``lower/moe`` (``experts-to-moe``) lowers.

transformers 5.x's ``batched_mm`` experts, what torch.onnx's dynamo exporter writes, gather each
(token, slot)'s expert weights by the top-k indices and run batched MatMuls::

    w, idx = TopK(router)                      # (T, k), after whatever the router does
    h      = Squeeze(MatMul(GatherND(W1, idx), Unsqueeze(repeat(x, k))))  [+ GatherND(b1, idx)]
    a      = activation(h)                     # SwiGLU on the halves of h
    y      = Squeeze(MatMul(GatherND(W2, idx), Unsqueeze(a)))  [+ GatherND(b2, idx)]
    Y      = ReduceSum(Reshape(y * w, (T, k, H)), axis=1)

That is the canonical form: it says which expert each (token, slot) runs and with which
weight, in standard ops, whatever wrote the graph. Two other forms compute the same thing and
are lifted to it here:

* ``ExpertLoopToBatchedExperts``: a loop over the experts, traced (transformers 4.x's sparse
  MoE block, e.g. Hugging Face Optimum's Qwen3-MoE export, which patches the loop to run over
  every expert). Each expert ``e`` is a branch: the (slot, token) pairs routed to it
  (``NonZero`` of ``one_hot(idx)[e]``), those tokens' rows gathered, the expert's MLP on them
  times the routing weight gathered for each pair, scattered back (``index_add_``:
  ``ScatterElements`` into zeros, added to an accumulator that starts at zeros). Anchor: the
  last ``Add`` of that chain.
* ``DenseExpertsToBatchedExperts``: every expert on every token (GPT-OSS's inference path in
  transformers 4.x, which Optimum's export takes): the tokens tiled once per expert, MatMuls
  with the stacked (E, in, out) weights, the outputs times a dense (T, E) routing matrix
  that is zero outside the top k, summed over the expert axis. Anchor: that ``ReduceSum``.

The structure is read only to find the pieces: the tokens (the router's own input), the
router's ``TopK``, the per-(token, slot) or dense routing weights the branches multiply by,
each expert's weights (and which expert a branch is, the constant its mask is gathered at)
and the activation between the projections, which is copied as it is (elementwise ops on
scalar constants, and ``Slice``/``Split`` of the last axis). A traced loop must have exactly
one branch per expert: transformers 4.x loops over ``expert_hit``, the experts its trace input
happened to route to, so an unpatched trace can lack experts (they compute nothing in such an
export), and the rule keeps it. What the pieces compute together is then *proven by
evaluation*: the original region from (tokens, router logits) and the canonical candidate
(fed the original router's own top-k indices and weights) are run on ORT at several token
counts, on random tokens and logits that route every expert, and must agree; the routing
weight is taken per slot as it is, or gathered from the dense matrix at the top-k indices,
whichever the evaluation proves. Anything else is kept, with the reason. ``experts-to-moe``
then proves the router semantics (softmax before or after top-k, renormalization, ties) on
the canonical form, as it does for dynamo's exports.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from epfuse.tolerances import tolerance_for

from .._evaluate import ShapeCut, SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import (
    Builder,
    attr,
    const_array,
    const_ints,
    dim,
    remove_dead,
    replace_value,
)
from ..analysis.signature import probe_array
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode

# Ops that move or copy their first input's data (the tokens, the routing weights) without
# computing on it; which rows they pick is the evaluation's business.
_DATA = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Tile", "Cast")
_GATHERS = ("Gather", "GatherElements", "GatherND")
# What an activation between two projections may be made of (copied onto the batched rows).
_ELEMENTWISE = frozenset(
    (
        "Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "Clip", "Min", "Max", "Neg",
        "Exp", "Erf", "Pow", "Sqrt", "Abs", "Softplus", "HardSigmoid", "Gelu", "Identity",
    )
)  # fmt: skip
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
_PROBES = ((1, 1), (2, 3), (1, 17))  # (batch, seq) of the inputs read by shape
_MAX_ACTIVATION = 24


def _walk_data(value: ir.Value, through: tuple[str, ...]) -> list[ir.Value]:
    """``value`` and the values its data comes from through ``through`` ops (input 0)."""
    path = [value]
    for _ in range(16):
        node = path[-1].producer()
        if node is None or node.op_type not in through or node.domain != "" or not node.inputs:
            break
        path.append(node.inputs[0])
    return path


def _const(value: ir.Value | None) -> np.ndarray | None:
    """A constant, also behind ``Identity`` (TorchScript shares equal initializers that way:
    two layers' equal biases are one initializer and an Identity)."""
    return const_array(_walk_data(value, ("Identity",))[-1]) if value is not None else None


@dataclasses.dataclass
class _Projection:
    """``data @ W (+ b)`` with constant weights."""

    data: ir.Value
    weight: np.ndarray
    """(in, out), or (E, in, out) for stacked experts."""
    bias: np.ndarray | None
    output: ir.Value


def _projection(value: ir.Value) -> _Projection | None:
    node = value.producer()
    bias = None
    if node is not None and node.op_type == "Add":
        for a, b in ((0, 1), (1, 0)):
            b_array = _const(node.inputs[b])
            if b_array is not None and _matmul(node.inputs[a]) is not None:
                bias, node = b_array, node.inputs[a].producer()
                break
        else:
            return None
    got = _matmul(node.outputs[0]) if node is not None else None
    if got is None:
        return None
    data, weight = got
    return _Projection(data, weight, bias, value)


def _matmul(value: ir.Value) -> tuple[ir.Value, np.ndarray] | None:
    node = value.producer()
    if node is None or node.op_type != "MatMul" or node.domain != "":
        return None
    weight = _const(node.inputs[1])
    if weight is None or weight.ndim not in (2, 3) or const_array(node.inputs[0]) is not None:
        return None
    return node.inputs[0], weight


@dataclasses.dataclass
class _Activation:
    """The nodes between the first projection(s) and the second, to copy onto the batched
    rows: ``inputs`` are the projection outputs they read (one fused gate/up projection, or
    two), ``output`` what the second projection reads."""

    inputs: list[ir.Value]
    nodes: list[ir.Node]
    output: ir.Value

    def signature(self) -> tuple:
        """Ops, attributes and constants, to tell that two branches run the same function."""
        parts = []
        for node in self.nodes:
            consts = tuple(
                None if v is None else _const_key(v) for v in node.inputs if _is_const(v)
            )
            attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
            parts.append((node.op_type, attrs, consts))
        return tuple(parts)


def _is_const(value: ir.Value | None) -> bool:
    return value is None or const_array(value) is not None


def _const_key(value: ir.Value) -> tuple:
    array = const_array(value)
    assert array is not None
    return (str(array.dtype), array.shape, array.tobytes())


def _activation(output: ir.Value) -> tuple[_Activation, list[_Projection]] | str:
    """The activation ending at ``output`` and the projections it reads, or a reason."""
    ordered: list[ir.Node] = []  # post-order: each node after the nodes it reads
    seen: set[int] = set()
    projections: dict[int, _Projection] = {}

    def visit(value: ir.Value) -> str | None:
        if id(value) in projections or id(value) in seen:
            return None
        seen.add(id(value))
        proj = _projection(value)
        if proj is not None:
            projections[id(value)] = proj
            return None
        node = value.producer()
        if node is None:
            return "the expert activation reads a graph input"
        if node.domain != "" or node.op_type not in _ELEMENTWISE | {"Slice", "Split"}:
            return f"the expert activation has a {node.op_type} (not elementwise)"
        if any(n is node for n in ordered):
            return None
        if len(ordered) >= _MAX_ACTIVATION:
            return "the expert activation is too large to be one"
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            array = const_array(v)
            if array is None:
                if (why := visit(v)) is not None:
                    return why
            elif node.op_type in _ELEMENTWISE and array.size != 1:
                return "the expert activation reads a constant that is not a scalar"
            elif node.op_type in ("Slice", "Split") and i == 0:
                return "the expert activation slices a constant"
        ordered.append(node)
        return None

    why = visit(output)
    if why is not None:
        return why
    if not projections or len(projections) > 2:
        return "the expert activation does not read one or two projections"
    for node in ordered:
        if node.op_type in ("Slice", "Split") and _last_axis(node) is None:
            return "the expert activation slices an axis other than the last"
    projs = list(projections.values())
    return _Activation([p.output for p in projs], ordered, output), projs


def _last_axis(node: ir.Node) -> bool | None:
    """True when a Slice/Split acts on its input's last axis only."""
    data = node.inputs[0]
    rank = len(data.shape) if data is not None and data.shape is not None else None
    if node.op_type == "Split":
        axes = [attr(node, "axis", 0)]
    else:
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
        if axes is None or len(axes) != 1:
            return None
    axis = axes[0]
    if axis == -1 or (rank is not None and axis == rank - 1):
        return True
    return None


@dataclasses.dataclass
class _Lift:
    anchor: ir.Node
    output: ir.Value
    tokens: ir.Value
    logits: ir.Value
    topk: ir.Node
    k: int
    weights: ir.Value
    """The routing weights the experts multiply by: (T, k) per slot, or (T, E) dense."""
    fc1: np.ndarray
    """(E, 2I, H)."""
    b1: np.ndarray | None
    fc2: np.ndarray
    """(E, H, I)."""
    b2: np.ndarray | None
    activation: _Activation
    reshape_to: ir.Value | None
    """A 3-D value whose shape the output has (the hidden states the tokens flatten)."""
    what: str
    gather: bool = False
    """Proven by ``check``: the weight of (token, slot) is ``weights[token, idx[token, slot]]``."""


def _router(weights: ir.Value) -> tuple[ir.Node, ir.Value, int] | str:
    """(TopK, router logits, k) the routing weights come from, or a reason."""
    seen: set[int] = set()
    frontier, topk = [weights], None
    for _ in range(12):
        nxt = []
        for v in frontier:
            node = v.producer()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "TopK":
                topk = node
                break
            nxt.extend(i for i in node.inputs if i is not None and const_array(i) is None)
        if topk is not None or not nxt:
            break
        frontier = nxt
    if topk is None:
        return "no TopK routes the expert outputs"
    k = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if k is None or len(k) != 1 or attr(topk, "axis", -1) not in (-1, 1):
        return "the top-k is not a constant k over the experts axis"
    if attr(topk, "largest", 1) != 1:
        return "the router keeps the smallest scores"
    logits = _walk_data(topk.inputs[0], ("Cast", "Identity", "Softmax"))[-1]
    if logits.shape is None or len(logits.shape) != 2 or not isinstance(dim(logits, 1), int):
        return "the router logits are not (tokens, experts) with a static expert count"
    return topk, logits, k[0]


def _tokens(data: ir.Value, logits: ir.Value) -> ir.Value | str:
    """The router's input, where the experts' rows come from (``data`` moved by ``_DATA`` ops
    or gathered), or a reason."""
    router = logits.producer()
    if router is None or router.op_type not in ("MatMul", "Gemm") or router.domain != "":
        return "the router logits are not a projection of the tokens"
    source = router.inputs[0]
    for value in _walk_data(data, (*_DATA, "Gather")):
        if value is source:
            if source.shape is None or len(source.shape) != 2:
                return "the router's tokens are not (tokens, hidden)"
            return source
    return "the experts do not read the router's tokens"


def _reshape_target(output: ir.Value, tokens: ir.Value) -> ir.Value | str | None:
    """None for a (T, H) output; for a 3-D output, the 3-D hidden states the tokens flatten
    (``Reshape(h, (-1, H))``), whose shape the output must have: the batch and hidden axes
    are checked here, the whole shape and the row order by the evaluation (batch 1 and 2)."""
    if output.shape is None or len(output.shape) not in (2, 3):
        return "the experts' output is not (tokens, hidden) or (batch, seq, hidden)"
    if len(output.shape) == 2:
        return None
    node = tokens.producer()
    source = node.inputs[0] if node is not None and node.op_type == "Reshape" else None
    if (
        source is None
        or source.shape is None
        or len(source.shape) != 3
        or not all(dim(source, a) == dim(output, a) for a in (0, 2))
    ):
        return "the experts' output does not provably have the shape of the hidden states"
    return source


def _stack_fc1(projs: list[_Projection]) -> tuple[np.ndarray, np.ndarray | None]:
    """(E, 2I, H) and (E, 2I) of the first projection(s) (two: [first; second] rows)."""
    weights, biases = [], []
    for p in projs:
        w = p.weight if p.weight.ndim == 3 else p.weight[None]
        weights.append(w.transpose(0, 2, 1))
        out = w.shape[2]
        if p.bias is None:
            biases.append(None)
        else:
            biases.append(np.broadcast_to(p.bias.reshape(-1, out), (w.shape[0], out)))
    fc1 = np.concatenate(weights, axis=1)
    if all(b is None for b in biases):
        return fc1, None
    filled = [
        np.zeros((w.shape[0], w.shape[1]), fc1.dtype) if b is None else b
        for w, b in zip(weights, biases, strict=True)
    ]
    return fc1, np.concatenate(filled, axis=1).astype(fc1.dtype)


def _second(proj: _Projection) -> tuple[np.ndarray, np.ndarray | None]:
    w = proj.weight if proj.weight.ndim == 3 else proj.weight[None]
    fc2 = w.transpose(0, 2, 1)
    if proj.bias is None:
        return fc2, None
    return fc2, np.broadcast_to(proj.bias.reshape(-1, w.shape[2]), fc2.shape[:2]).copy()


# ---------------------------------------------------------------- the two forms


def _accumulated(add: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """(accumulator, ScatterElements) of ``Add(acc, ScatterElements(zeros, ...))``."""
    if add.op_type != "Add" or len(add.inputs) != 2:
        return None
    for a, b in ((0, 1), (1, 0)):
        scatter = add.inputs[b].producer() if add.inputs[b] is not None else None
        if (
            scatter is not None
            and scatter.op_type == "ScatterElements"
            and attr(scatter, "axis", 0) == 0
            and attr(scatter, "reduction", "none") == "none"
            and _zeros(scatter.inputs[0])
        ):
            return add.inputs[a], scatter
    return None


def _zeros(value: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "ConstantOfShape":
        return False
    fill = node.attributes.get("value")
    return fill is None or not np.any(fill.value.numpy())


def _branch_expert(scatter: ir.Node) -> int | None:
    """The expert a branch is: the constant its routing mask is gathered at, above the
    ``NonZero`` its token indices come from."""
    seen, frontier = set(), [scatter.inputs[1]]
    for _ in range(10):
        nxt = []
        for v in frontier:
            node = v.producer() if v is not None else None
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "NonZero":
                for mask in _walk_data(node.inputs[0], ("Cast", "Squeeze", "Identity")):
                    gather = mask.producer()
                    if gather is not None and gather.op_type == "Gather":
                        index = const_ints(gather.inputs[1])
                        if index is not None and len(index) == 1 and attr(gather, "axis", 0) == 0:
                            return index[0]
                return None
            nxt.extend(i for i in node.inputs if i is not None and const_array(i) is None)
        frontier = nxt
    return None


def _weighted(value: ir.Value) -> tuple[_Projection, ir.Value] | None:
    """(second projection, routing weights source) of ``proj(a) * gathered weights``, through
    data moves."""
    mul = _walk_data(value, _DATA)[-1].producer()
    if mul is None or mul.op_type != "Mul":
        return None
    for a, b in ((0, 1), (1, 0)):
        proj = _projection(_walk_data(mul.inputs[a], _DATA)[-1])
        if proj is not None:
            source = _walk_data(mul.inputs[b], (*_DATA, *_GATHERS, "Transpose"))[-1]
            return proj, source
    return None


def _lift_loop(anchor: ir.Node) -> _Lift | str | None:
    got = _accumulated(anchor)
    if got is None:
        return None
    for use in anchor.outputs[0].uses():
        later = _accumulated(use.node)
        if later is not None and later[0] is anchor.outputs[0]:
            return None  # not the end of the chain: the last Add is the anchor
    scatters = []
    acc = anchor.outputs[0]
    while True:
        node = acc.producer()
        step = _accumulated(node) if node is not None else None
        if step is None:
            break
        acc, scatter = step
        scatters.append(scatter)
        if len(scatters) > 4096:
            return None
    if not _zeros(acc):
        return None
    scatters.reverse()
    branches = []
    for scatter in scatters:
        weighted = _weighted(scatter.inputs[2])
        if weighted is None:
            return "an expert branch is not an MLP output times a routing weight"
        fc2, source = weighted
        if fc2.weight.ndim != 2:
            return "an expert branch's second projection is not one expert's weights"
        act = _activation(fc2.data)
        if isinstance(act, str):
            return act
        expert = _branch_expert(scatter)
        if expert is None:
            return "cannot tell which expert a branch is (no constant routing mask index)"
        branches.append((expert, fc2, source, *act))
    sources = {id(b[2]) for b in branches}
    if len(sources) != 1:
        return "the expert branches read different routing weights"
    weights = branches[0][2]
    router = _router(weights)
    if isinstance(router, str):
        return router
    topk, logits, k = router
    experts = dim(logits, 1)
    ids = sorted(b[0] for b in branches)
    if ids != list(range(experts)):
        missing = sorted(set(range(experts)) - set(ids))
        if missing:
            return (
                f"the traced loop has no branch for experts {missing} of {experts} (transformers "
                "4.x loops over the experts its trace input routed to; in this export they "
                "compute nothing)"
            )
        return "the traced loop runs an expert more than once"
    branches.sort(key=lambda b: b[0])
    template = branches[0][3]
    signature = template.signature()
    tokens = None
    fc1s, b1s, fc2s, b2s = [], [], [], []
    for _, fc2, _, act, projs in branches:
        if act.signature() != signature or len(act.inputs) != len(template.inputs):
            return "the experts' activations differ"
        if any(p.weight.ndim != 2 for p in projs) or len({id(p.data) for p in projs}) != 1:
            return "an expert's first projections do not read one set of rows"
        # projs are in the order the activation reads them, as the template's inputs are
        # (equal signatures); a swap would show in the evaluation.
        found = _tokens(projs[0].data, logits)
        if isinstance(found, str):
            return found
        if tokens is not None and found is not tokens:
            return "the expert branches read different tokens"
        tokens = found
        w1, bias1 = _stack_fc1(projs)
        w2, bias2 = _second(fc2)
        fc1s.append(w1[0])
        b1s.append(None if bias1 is None else bias1[0])
        fc2s.append(w2[0])
        b2s.append(None if bias2 is None else bias2[0])
    assert tokens is not None
    if len({a.shape for a in fc1s}) != 1 or len({a.shape for a in fc2s}) != 1:
        return "the experts' weights differ in shape"
    fc1, fc2 = np.stack(fc1s), np.stack(fc2s)
    b1 = _stack_biases(b1s, fc1.shape[1], fc1.dtype)
    b2 = _stack_biases(b2s, fc2.shape[1], fc2.dtype)
    what = f"a traced loop over {experts} experts"
    return _lift(anchor, tokens, logits, topk, k, weights, fc1, b1, fc2, b2, template, what)


def _stack_biases(biases: list, size: int, dtype) -> np.ndarray | None:
    if all(b is None for b in biases):
        return None
    return np.stack([np.zeros(size, dtype) if b is None else b for b in biases]).astype(dtype)


def _lift_dense(anchor: ir.Node) -> _Lift | str | None:
    if const_ints(anchor.inputs[1] if len(anchor.inputs) > 1 else None) != [0]:
        return None
    if attr(anchor, "keepdims", 1) != 0:
        return None
    weighted = _weighted(anchor.inputs[0])
    if weighted is None:
        return None
    fc2, weights = weighted
    if fc2.weight.ndim != 3:
        return None
    act = _activation(fc2.data)
    if isinstance(act, str):
        return act
    template, projs = act
    if len(projs) != 1 or projs[0].weight.ndim != 3:
        return "the dense experts' first projection is not one stacked (E, in, out) weight"
    router = _router(weights)
    if isinstance(router, str):
        return router
    topk, logits, k = router
    experts = dim(logits, 1)
    if projs[0].weight.shape[0] != experts or fc2.weight.shape[0] != experts:
        return "expert weight tables do not have one entry per router logit"
    tokens = _tokens(projs[0].data, logits)
    if isinstance(tokens, str):
        return tokens
    fc1, b1 = _stack_fc1(projs)
    w2, b2 = _second(fc2)
    what = f"{experts} experts run on every token"
    return _lift(anchor, tokens, logits, topk, k, weights, fc1, b1, w2, b2, template, what)


def _lift(anchor, tokens, logits, topk, k, weights, fc1, b1, fc2, b2, template, what):
    """The lift of both forms, once the anchor's output can be reshaped back from the
    (tokens, hidden) rows the batched form computes (else why not)."""
    reshape_to = _reshape_target(anchor.outputs[0], tokens)
    if isinstance(reshape_to, str):
        return reshape_to
    return _Lift(
        anchor, anchor.outputs[0], tokens, logits, topk, k, weights, fc1, b1, fc2, b2,
        template, reshape_to, what,
    )  # fmt: skip


# ---------------------------------------------------------------- the canonical form


def _emit(
    b: Builder, lift: _Lift, x: ir.Value, idx: ir.Value, weights: ir.Value, gather: bool
) -> ir.Value:
    """The batched experts form of ``lift`` on (tokens, top-k indices, routing weights): the
    (T, H) output."""
    hidden = lift.fc1.shape[2]
    k = lift.k
    i64 = np.int64
    rows = b.op("Unsqueeze", [x, b.const("axis1", np.array([1], i64))])
    rows = b.op("Expand", [rows, b.const("k_slots", np.array([1, k, 1], i64))])
    rows = b.op("Reshape", [rows, b.const("rows", np.array([-1, hidden], i64))])
    last = b.const("last", np.array([-1], i64))
    flat = b.const("flat", np.array([-1], i64))
    index = b.op("Unsqueeze", [b.op("Reshape", [idx, flat]), last])

    def batched(table: np.ndarray, bias: np.ndarray | None, act: ir.Value, name: str):
        w = b.op("GatherND", [b.const(name, table), index], {"batch_dims": 0})
        out = b.op("Squeeze", [b.op("MatMul", [w, b.op("Unsqueeze", [act, last])]), last])
        if bias is not None:
            out = b.op("Add", [out, b.op("GatherND", [b.const(f"{name}_bias", bias), index])])
        return out

    h = batched(lift.fc1, lift.b1, rows, "fc1")
    template = lift.activation
    if len(template.inputs) == 2:
        half = lift.fc1.shape[1] // 2
        halves = b.op(
            "Split", [h, b.const("halves", np.array([half, half], i64))], {"axis": -1},
            num_outputs=2,
        )  # fmt: skip
        mapped = dict(zip((id(v) for v in template.inputs), halves, strict=True))
    else:
        mapped = {id(template.inputs[0]): h}
    for node in template.nodes:
        inputs: list[ir.Value | None] = []
        for i, v in enumerate(node.inputs):
            if v is None:
                inputs.append(None)
            elif id(v) in mapped:
                inputs.append(mapped[id(v)])
            else:
                array = const_array(v)
                assert array is not None
                if node.op_type == "Slice" and i == 3:
                    array = np.array([-1], array.dtype)
                inputs.append(b.const(f"act_{node.op_type}", array))
        attributes = {k: a.value for k, a in node.attributes.items()}
        if node.op_type == "Split":
            attributes["axis"] = -1
        outs = b.op(node.op_type, inputs, attributes, num_outputs=len(node.outputs))
        outs = (outs,) if isinstance(outs, ir.Value) else outs
        mapped.update(zip((id(o) for o in node.outputs), outs, strict=True))
    act = mapped[id(template.output)]
    y = batched(lift.fc2, lift.b2, act, "fc2")
    if gather:
        weights = b.op("GatherElements", [weights, idx], {"axis": 1})
    if weights.dtype is not None and x.dtype is not None and weights.dtype != x.dtype:
        weights = b.op("Cast", [weights], {"to": x.dtype})
    w = b.op("Unsqueeze", [b.op("Reshape", [weights, flat]), last])
    per_slot = b.op(
        "Reshape", [b.op("Mul", [y, w]), b.const("slots", np.array([-1, k, hidden], i64))]
    )
    return b.op("ReduceSum", [per_slot, b.const("axis_slots", np.array([1], i64))], {"keepdims": 0})


def _candidate(lift: _Lift, gather: bool, opsets: dict[str, int]) -> ort.InferenceSession:
    """The canonical form alone, fed (tokens, top-k indices, routing weights)."""
    x = ir.Value(name="x", type=lift.tokens.type, shape=ir.Shape(["T", lift.fc1.shape[2]]))
    idx = ir.Value(name="idx", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["T", lift.k]))
    weights = ir.Value(name="w", type=lift.weights.type, shape=ir.Shape(["T", "W"]))
    graph = ir.Graph([x, idx, weights], [], nodes=[], opset_imports=dict(opsets), name="lift")
    builder = Builder(graph, None, "lift")
    y = _emit(builder, lift, x, idx, weights, gather)
    graph.extend(builder.nodes)
    graph.outputs.append(y)
    y.type = lift.tokens.type
    proto = ir.to_proto(ir.Model(graph, ir_version=10))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _probe_logits(rng, tokens: int, experts: int, dtype) -> np.ndarray:
    logits = 2 * rng.standard_normal((tokens, experts))
    # Every expert first for some token (the largest probe has a row per expert).
    for e in range(min(experts, tokens - 1)):
        logits[1 + e, e] += 8.0
    if tokens > 1:
        logits[0] = 0.5  # all tied
    return logits.astype(dtype)


def _hidden_shapes(tokens: ir.Value) -> list[ir.Value]:
    """``Shape(h)`` outputs of the 3-D hidden states ``h`` that ``tokens = Reshape(h, ...)``
    flattens (whole shapes only), or of the values ``h`` is computed from that have the same
    inferred shape, dim for dim (``shape-of-same-shape`` moves a Shape of a normalization's
    output to its input)."""
    node = tokens.producer()
    if node is None or node.op_type != "Reshape":
        return []
    value = node.inputs[0]
    if value is None or value.shape is None or len(value.shape) != 3:
        return []
    same = [value]
    for _ in range(8):
        producer = value.producer()
        source = producer.inputs[0] if producer is not None and producer.inputs else None
        if (
            source is None
            or source.shape is None
            or len(source.shape) != 3
            or not all(dim(source, a) == dim(value, a) for a in range(3))
        ):
            break
        same.append(source)
        value = source
    return [
        use.node.outputs[0]
        for v in same
        for use in v.uses()
        if use.node.op_type == "Shape" and not use.node.attributes
    ]


def _probe_shape(graph: ir.Graph, name: str, batch: int, seq: int) -> tuple[int, ...] | None:
    """The shape of graph input ``name`` in a probe of (batch, seq) new tokens, no past."""
    value = next((v for v in graph.inputs if v.name == name), None)
    array = probe_array(value, None, batch, seq, 0) if value is not None else None
    return None if array is None else array.shape


def _prove(ctx: RewriteContext, lift: _Lift) -> bool | str:
    """``gather`` of the first candidate that equals the region, or a reason."""
    idx = lift.topk.outputs[1]
    cuts: list[ShapeCut] = []
    # The shape of the hidden states the tokens flatten, (batch, seq, H) with batch * seq
    # the tokens' rows, is a cut: fed per probe (an earlier layer's hidden states need not
    # have a shape inference could name).
    sizes = _hidden_shapes(lift.tokens)
    fed = [lift.tokens, lift.logits, *sizes]
    try:
        by_value, by_shape = value_dependencies(lift.output, fed, shape_cuts=(ctx.graph, cuts))
    except _Unprovable as err:
        return str(err)
    if by_value - set(fed):
        return "the experts region reads more than the tokens and router logits"
    shaped = sorted(by_shape - set(fed), key=lambda v: v.name or "")
    cut = [*fed, *shaped, *(c.value for c in cuts)]
    try:
        original = SubgraphEvaluator(ctx.graph, [lift.output, idx, lift.weights], inputs=cut)
    except Exception as err:
        return f"the experts region could not be evaluated ({type(err).__name__})"
    if set(original.input_names) - {v.name for v in cut}:
        return "the experts region reads more than the tokens and router logits"
    dtype = lift.tokens.dtype.numpy()
    hidden, experts = lift.fc1.shape[2], lift.fc1.shape[0]
    rng = np.random.default_rng(0)
    probes = []
    for batch, seq in (*_PROBES, (2, experts // 2 + 2)):
        tokens = batch * seq
        feeds = {
            lift.tokens.name: rng.standard_normal((tokens, hidden)).astype(dtype),
            lift.logits.name: _probe_logits(rng, tokens, experts, lift.logits.dtype.numpy()),
        }
        for value in shaped:
            array = probe_array(value, None, batch, seq, 0)
            if array is None:
                return f"the experts region reads the shape of {value.name!r}"
            feeds[value.name] = array
        for c in cuts:
            vector = c.vector(lambda name, b=batch, n=seq: _probe_shape(ctx.graph, name, b, n))
            if vector is None:
                return f"cannot size the shape {c.value.name!r} the experts region reads"
            feeds[c.value.name] = vector
        for value in sizes:
            feeds[value.name] = np.array([batch, seq, hidden], np.int64)
        x = feeds[lift.tokens.name]
        feeds = {name: feeds[name] for name in original.input_names}
        try:
            want, indices, weights = original(feeds)
        except Exception as err:
            return f"the experts region could not be run ({type(err).__name__})"
        shape = (tokens, hidden) if lift.reshape_to is None else (batch, seq, hidden)
        probes.append((x, indices, weights, np.asarray(want, np.float64), shape))
    tol = tolerance_for("float16" if lift.tokens.dtype == ir.DataType.FLOAT16 else "float32")
    width = dim(lift.weights, -1) if lift.weights.shape is not None else None
    candidates = (True, False) if width == experts and width != lift.k else (False, True)
    opsets = dict(ctx.graph.opset_imports)
    for gather in candidates:
        try:
            session = _candidate(lift, gather, opsets)
        except Exception as err:
            return f"the batched experts form could not be built ({str(err).splitlines()[0][:120]})"
        for x, indices, weights, want, shape in probes:
            try:
                (got,) = session.run(None, {"x": x, "idx": indices, "w": weights})
            except Exception:
                break
            # The rewrite reshapes the (T, H) rows to the hidden states' shape, row-major.
            if want.shape != shape or not np.allclose(
                got.reshape(shape), want, atol=tol.atol, rtol=tol.rtol
            ):
                break
        else:
            return gather
    return "the batched experts form (weights per slot or gathered) does not compute what the experts compute"


class _LiftExperts(Rule, stage=Stage.CANONICALIZE):
    """Shared check and rewrite of the two lifts."""

    def lift(self, node: ir.Node) -> _Lift | str | None:
        raise NotImplementedError

    def match(self, node: ir.Node, ctx: RewriteContext) -> _Lift | Kept | None:
        found = self.lift(node)
        if found is None:
            return None
        if isinstance(found, str):
            return Kept(ReasonCode.FORM, f"experts kept: {found}")
        if found.tokens.dtype not in _FLOATS or found.logits.dtype not in _FLOATS:
            return Kept(ReasonCode.DTYPE, "experts kept: lifted for float32/float16 only")
        return found

    def check(self, lift: _Lift, ctx: RewriteContext) -> Kept | None:
        proven = _prove(ctx, lift)
        if isinstance(proven, str):
            return Kept(ReasonCode.NOT_PROVEN, f"experts kept: {proven}")
        lift.gather = proven
        return None

    def rewrite(self, lift: _Lift, ctx: RewriteContext) -> Rewritten:
        anchor = lift.anchor
        builder = Builder(ctx.graph, anchor, f"epfuse/{anchor.name or 'experts'}/batched")
        y = _emit(builder, lift, lift.tokens, lift.topk.outputs[1], lift.weights, lift.gather)
        if lift.reshape_to is not None:
            y = builder.op("Reshape", [y, builder.op("Shape", [lift.reshape_to])])
        old = lift.output
        y.shape, y.type = old.shape, old.type
        replace_value(old, y)
        remove_dead(ctx.graph, [anchor])
        weights = "gathered from the dense routing matrix" if lift.gather else "per slot"
        return Rewritten(
            f"{lift.what} -> batched experts (k={lift.k}, routing weights {weights}; proven on ORT)"
        )


class ExpertLoopToBatchedExperts(_LiftExperts, name="expert-loop-to-batched", anchor="Add"):
    """traced per-expert loop (NonZero / gather / MLP / index_add per expert) -> batched experts

    The loop's last accumulation ``Add`` is the anchor."""

    def lift(self, node: ir.Node) -> _Lift | str | None:
        return _lift_loop(node)


class DenseExpertsToBatchedExperts(
    _LiftExperts, name="dense-experts-to-batched", anchor="ReduceSum"
):
    """every expert on every token, times a dense routing matrix, summed -> batched experts"""

    def lift(self, node: ir.Node) -> _Lift | str | None:
        return _lift_dense(node)
