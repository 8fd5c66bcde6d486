"""Exported mixture-of-experts (router + top-k + per-expert SwiGLU MLP) -> ``com.microsoft::MoE``.

transformers 5.x's ``batched_mm`` experts (the implementation torch.onnx can export: Mixtral,
Qwen3-MoE, GPT-OSS) gather each (token, slot)'s expert weights by the top-k indices and run
batched MatMuls::

    R        = router(x)                                   # (T, E) logits
    w, idx   = TopK(R or Softmax(R), k)  [-> Softmax / renormalize]
    h        = GatherND(W1, idx) applied to repeat_interleave(x, k)  [+ GatherND(b1, idx)]
    a        = SwiGLU(h)      # silu(gate) * up, or GPT-OSS's clamped (up + 1) * gate*sigmoid(1.702 gate)
    y        = GatherND(W2, idx) applied to a  [+ bias]
    Y        = ReduceSum(Reshape(y * w, (T, k, H)), axis=1)

ORT 1.32's CPU ``MoE`` (see ``capabilities.probe``'s known answer) takes the logits, applies
softmax over all experts, keeps the top k (ties go to the *higher* expert index, where ONNX
``TopK`` keeps the lower one), optionally renormalizes them (``normalize_routing_weights``), and
runs interleaved SwiGLU only (``swiglu_fusion=1``: gate at even rows of fc1, up at odd):
``(clamp(up, -L, L) + beta) * g * sigmoid(alpha * g)`` with ``g = min(gate, L)``.

The structure is read only to find the pieces (the router logits and tokens the region reads,
the expert weights and biases gathered by the top-k indices, which half is the gate, the
clamp, alpha and beta constants). What the region computes is then *proven by evaluation*:
the original subgraph from (tokens, logits) to Y and each candidate MoE node are run on ORT at
several token counts on random tokens and logits, plus logits with exact ties at the top-k
boundary; the candidate must match everywhere. The candidates are the two router semantics
(renormalized or not) times the expert order (as is, or reversed, with the logits gathered in
reverse, which turns the kernel's tie rule into TopK's). So softmax-then-top-k vs
top-k-then-softmax, renormalization and ties are settled by running both graphs, not by the
pattern. Anything that does not match is kept, with the reason.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper

from epfuse.capabilities.emissions import Capability
from epfuse.tolerances import tolerance_for

from .._evaluate import SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import (
    Builder,
    attr,
    const_array,
    const_ints,
    const_scalar,
    dim,
    ensure_opset,
    input_at,
    remove_dead,
    replace_value,
)
from ..analysis.signature import probe_array
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode

_NOISE = ("Squeeze", "Unsqueeze", "Identity")
_TOKEN_COUNTS = (1, 6, 17)
_PROJECTION = ("MatMul", "GatherND", "Gemm")


@dataclasses.dataclass
class _Linear:
    """``act @ W[idx]^T (+ b[idx])`` of a batched expert projection."""

    source: ir.Value
    weight: np.ndarray
    """(E, out, in)."""
    bias: np.ndarray | None
    index: ir.Value
    nodes: list[ir.Node]


@dataclasses.dataclass
class _Experts:
    tokens: ir.Value
    logits: ir.Value
    k: int
    fc1: _Linear
    fc2: _Linear
    gate_rows: np.ndarray
    up_rows: np.ndarray
    alpha: float
    beta: float
    limit: float | None
    sparse_mixer: bool = False
    weights: ir.Value | None = None
    """The per-(token, slot) routing weights the expert outputs are multiplied by."""


def _strip_noise(value: ir.Value) -> ir.Value:
    for _ in range(6):
        node = value.producer()
        if node is None or node.op_type not in _NOISE or node.domain != "":
            break
        value = node.inputs[0]
    return value


def _gathered(value: ir.Value) -> tuple[np.ndarray, ir.Value] | None:
    """(constant table, index) of ``GatherND(table, index)``."""
    node = value.producer()
    if node is None or node.op_type != "GatherND" or attr(node, "batch_dims", 0) != 0:
        return None
    table = const_array(node.inputs[0])
    if table is None:
        return None
    return table, node.inputs[1]


def _unsqueezed(value: ir.Value, axes: tuple[list[int], ...]) -> ir.Value | None:
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze" or const_ints(input_at(node, 1)) not in axes:
        return None
    return node.inputs[0]


def _linear(value: ir.Value) -> _Linear | None:
    """Parse ``[Add(.., GatherND(b, idx))] <- Squeeze <- MatMul`` of a batched projection."""
    value = _strip_noise(value)
    bias = None
    add = value.producer()
    if add is not None and add.op_type == "Add":
        for a, b in ((0, 1), (1, 0)):
            got = _gathered(add.inputs[b])
            if got is not None and got[0].ndim == 2:
                bias, bias_index = got
                value = _strip_noise(add.inputs[a])
                break
        else:
            return None
    matmul = value.producer()
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain != "":
        return None
    left, right = matmul.inputs
    got = _gathered(left)
    if got is not None and got[0].ndim == 3:  # W[idx] (out, in) @ x (in, 1)
        source = _unsqueezed(right, ([-1], [2]))
        weight, index = got
    else:
        got = _gathered(right)  # x (1, in) @ W[idx] (in, out)
        if got is None or got[0].ndim != 3:
            return None
        source = _unsqueezed(left, ([1], [-2]))
        weight, index = got[0].transpose(0, 2, 1), got[1]
    if source is None:
        return None
    if bias is not None and bias_index is not index:
        return None
    if bias is not None and bias.shape != weight.shape[:2]:
        return None
    return _Linear(source, weight, bias, index, [matmul])


def _ancestors(value: ir.Value, limit: int = 24, stop: tuple[str, ...] = ()) -> list[ir.Node]:
    """Producers above ``value`` (breadth first, at most ``limit``); the inputs of ``stop``
    ops are not followed (an expert activation ends at its projection MatMul)."""
    seen: dict[int, ir.Node] = {}
    frontier = [value]
    while frontier and len(seen) < limit:
        nxt = []
        for v in frontier:
            node = v.producer()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if node.op_type in stop:
                continue
            nxt.extend(i for i in node.inputs if i is not None and i.const_value is None)
        frontier = nxt
    return list(seen.values())


def _activation(act: ir.Value, fc1_out: int):
    """(h, gate rows, up rows, alpha, beta, limit) of a SwiGLU on ``h``'s halves, or a reason.

    Only reads where the gate and up halves come from and the constants; the evaluation
    proves the formula."""
    region = _ancestors(act, 16, _PROJECTION)
    splits = [n for n in region if n.op_type in ("Split", "Slice")]
    sigmoids = [n for n in region if n.op_type == "Sigmoid"]
    if not splits or len(sigmoids) != 1:
        return "the expert activation is not a gated (SwiGLU) form"
    sources = {id(n.inputs[0]): n.inputs[0] for n in splits}
    if len(sources) != 1:
        return "the gate and up halves do not come from one projection"
    (h,) = sources.values()
    half = fc1_out // 2
    gate_path = {id(n) for n in _ancestors(sigmoids[0].outputs[0], 8, _PROJECTION)}
    if len(splits) == 1 and splits[0].op_type == "Split":
        split = splits[0]
        sizes = const_ints(input_at(split, 1)) if len(split.inputs) > 1 else None
        if attr(split, "axis", 0) not in (-1, 1) or len(split.outputs) != 2:
            return "the gate/up split is not two halves of the last axis"
        if sizes not in (None, [half, half]):
            return "the gate/up split is not two halves of the last axis"
        users = {id(u.node) for u in split.outputs[0].uses()}
        first_is_gate = bool(users & (gate_path | {id(sigmoids[0])}))
        rows = np.arange(half)
        gate, up = (rows, rows + half) if first_is_gate else (rows + half, rows)
    elif len(splits) == 2 and all(n.op_type == "Slice" for n in splits):
        spans = []
        for node in splits:
            starts, steps = const_ints(input_at(node, 1)), const_ints(input_at(node, 4))
            axes = const_ints(input_at(node, 3))
            if starts is None or axes not in ([-1], [1]) or steps not in ([1], [2], None):
                return "the gate/up slices are not on the last axis"
            step = (steps or [1])[0]
            rows = starts[0] + step * np.arange(half)
            spans.append((node, rows))
        gate_spans = [rows for node, rows in spans if id(node) in gate_path]
        up_spans = [rows for node, rows in spans if id(node) not in gate_path]
        if len(gate_spans) != 1 or len(up_spans) != 1:
            return "cannot tell the gate half from the up half"
        gate, up = gate_spans[0], up_spans[0]
    else:
        return "the gate/up halves are not a Split or two Slices"
    if sorted(np.concatenate([gate, up]).tolist()) != list(range(fc1_out)):
        return "the gate/up halves do not partition the projection"
    alpha, beta, limit = 1.0, 0.0, None
    inner = sigmoids[0].inputs[0].producer()
    if inner is not None and inner.op_type == "Mul":
        scalars = [const_scalar(v) for v in inner.inputs]
        alpha = next((s for s in scalars if s is not None), 1.0)
    for node in region:
        if node.op_type == "Clip" and (high := const_scalar(input_at(node, 2))) is not None:
            limit = high if limit is None else max(limit, high)
        if node.op_type == "Add" and id(node) not in gate_path:
            scalars = [const_scalar(v) for v in node.inputs]
            beta = next((s for s in scalars if s is not None), beta)
    return h, gate, up, float(alpha), float(beta), limit


def _repeated_tokens(value: ir.Value, k: int) -> ir.Value | None:
    """x when ``value = Reshape(Expand(Unsqueeze(x, 1), (T, k, H)), (-1, H))``."""
    reshape = value.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return value if k == 1 else None
    expand = reshape.inputs[0].producer()
    if expand is None or expand.op_type != "Expand":
        return None
    source = _unsqueezed(expand.inputs[0], ([1], [-2]))
    target = const_ints(expand.inputs[1])
    if source is None or (target is not None and target[1] != k):
        return None
    return source


def _match(node: ir.Node) -> _Experts | str | None:
    if attr(node, "keepdims", 1) != 0 or const_ints(input_at(node, 1)) not in ([1], [-2]):
        return None
    reshape = node.inputs[0].producer()
    if reshape is None or reshape.op_type != "Reshape":
        return None
    mul = reshape.inputs[0].producer()
    if mul is None or mul.op_type != "Mul":
        return None
    for a, b in ((0, 1), (1, 0)):
        fc2 = _linear(mul.inputs[a])
        if fc2 is not None:
            weights = mul.inputs[b]
            break
    else:
        return None
    router = _ancestors(weights, 40)
    topk = next((n for n in router if n.op_type == "TopK"), None)
    sparse = False
    if topk is not None:
        k = const_ints(input_at(topk, 1))
        if k is None or len(k) != 1 or attr(topk, "axis", -1) not in (-1, 1):
            return "the top-k is not a constant k over the experts axis"
        if attr(topk, "largest", 1) != 1:
            return "the router keeps the smallest scores"
        logits = topk.inputs[0]
    else:
        # PhiMoE's sparsemixer: two masked-softmax ArgMax rounds instead of a TopK; ORT's
        # use_sparse_mixer (top 2) is the candidate, the evaluation decides.
        # Searched only up to projections (the router's own linear): an unbounded walk from
        # a later layer's router reaches the earlier layers' ArgMaxes through the residual.
        argmaxes = [n for n in _ancestors(weights, 40, _PROJECTION) if n.op_type == "ArgMax"]
        if not argmaxes:
            return "no TopK (or sparse-mixer ArgMax) routes the expert outputs"
        # The router logits: the ArgMax input no other ArgMax comes before.
        firsts = [
            a.inputs[0]
            for a in argmaxes
            if not any(n.op_type == "ArgMax" for n in _ancestors(a.inputs[0], 40, _PROJECTION))
        ]
        if len(firsts) != 1:
            return "the sparse-mixer router logits are not one value"
        logits = firsts[0]
        k, sparse = [2], True
    softmax = logits.producer()
    if (
        softmax is not None
        and softmax.op_type == "Softmax"
        and attr(softmax, "axis", -1) in (-1, 1)
    ):
        logits = softmax.inputs[0]
    if logits.shape is None or len(logits.shape) != 2 or not isinstance(dim(logits, 1), int):
        return "the router logits are not (tokens, experts) with a static expert count"
    fc1_out_guess = None
    for candidate in _ancestors(fc2.source, 16, _PROJECTION):
        if candidate.op_type in ("Split", "Slice"):
            fc1_out_guess = candidate.inputs[0]
            break
    if fc1_out_guess is None:
        return "the expert activation is not a gated (SwiGLU) form"
    fc1 = _linear(fc1_out_guess)
    if fc1 is None:
        return "the first expert projection is not a batched MatMul of gathered weights"
    act = _activation(fc2.source, fc1.weight.shape[1])
    if isinstance(act, str):
        return act
    h, gate, up, alpha, beta, limit = act
    if _strip_noise(h) is not _strip_noise(fc1_out_guess):
        return "the gate/up halves do not come from the first projection"
    tokens = _repeated_tokens(fc1.source, k[0])
    if tokens is None:
        return "the expert input is not the tokens repeated k times"
    experts = dim(logits, 1)
    for linear in (fc1, fc2):
        if linear.weight.shape[0] != experts:
            return "expert weight tables do not have one entry per router logit"
    if fc2.weight.shape[2] != len(gate) or fc2.weight.shape[1] != fc1.weight.shape[2]:
        return "the expert projections do not chain (hidden -> intermediate -> hidden)"
    return _Experts(tokens, logits, k[0], fc1, fc2, gate, up, alpha, beta, limit, sparse, weights)


def _moe_arrays(e: _Experts, reverse: bool, dtype):
    order = np.arange(e.fc1.weight.shape[0])[::-1] if reverse else slice(None)
    rows = np.stack([e.gate_rows, e.up_rows], axis=1).reshape(-1)  # interleaved gate, up
    fc1 = e.fc1.weight[order][:, rows].astype(dtype)
    b1 = None if e.fc1.bias is None else e.fc1.bias[order][:, rows].astype(dtype)
    fc2 = e.fc2.weight[order].astype(dtype)
    b2 = None if e.fc2.bias is None else e.fc2.bias[order].astype(dtype)
    return fc1, b1, fc2, b2


def _moe_attributes(e: _Experts, normalize: int) -> dict[str, object]:
    attributes: dict[str, object] = {
        "k": e.k,
        "activation_type": "swiglu",
        "swiglu_fusion": 1,
        "activation_alpha": e.alpha,
        "activation_beta": e.beta,
        "normalize_routing_weights": normalize,
    }
    if e.limit is not None:
        attributes["swiglu_limit"] = float(e.limit)
    if e.sparse_mixer:
        attributes["use_sparse_mixer"] = 1
    return attributes


def _candidate_session(e: _Experts, normalize: int, reverse: bool, elem: int, dtype):
    fc1, b1, fc2, b2 = _moe_arrays(e, reverse, dtype)
    experts = fc1.shape[0]
    inits = [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(fc2, "fc2")]
    names = ["x", "r", "fc1", "", "fc2", ""]
    if b1 is not None:
        inits.append(numpy_helper.from_array(b1, "b1"))
        names[3] = "b1"
    if b2 is not None:
        inits.append(numpy_helper.from_array(b2, "b2"))
        names[5] = "b2"
    nodes = []
    if reverse:
        inits.append(numpy_helper.from_array(np.arange(experts)[::-1].copy(), "rev"))
        nodes.append(helper.make_node("Gather", ["r0", "rev"], ["r"], axis=1))
    else:
        nodes.append(helper.make_node("Identity", ["r0"], ["r"]))
    nodes.append(
        helper.make_node(
            "MoE", names, ["y"], domain="com.microsoft", **_moe_attributes(e, normalize)
        )
    )
    graph = helper.make_graph(
        nodes,
        "moe",
        [
            helper.make_tensor_value_info("x", elem, ["T", fc1.shape[2]]),
            helper.make_tensor_value_info("r0", elem, ["T", experts]),
        ],
        [helper.make_tensor_value_info("y", elem, None)],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _region_feeds(e, shaped, rng, tokens: int, hidden: int, experts: int, dtype):
    """One probe of the experts region: random tokens, router logits with ties (``_probe_logits``),
    a probe array for each input whose shape the region reads; or why one cannot be sized."""
    feeds = {
        e.tokens.name: rng.standard_normal((tokens, hidden)).astype(dtype),
        e.logits.name: _probe_logits(rng, tokens, experts, e.k, dtype),
    }
    for value in shaped:
        array = probe_array(value, None, 1, tokens, 0)
        if array is None:
            return f"the experts region reads the shape of {value.name!r}"
        feeds[value.name] = array
    return feeds


def _probe_logits(rng, tokens: int, experts: int, k: int, dtype) -> np.ndarray:
    logits = 2 * rng.standard_normal((tokens, experts))
    # Exact ties: all equal; and a tie straddling the k-th place.
    logits[0] = 0.5
    if tokens > 2 and experts > k:
        logits[1, :] = -3.0
        logits[1, : k + 1] = 1.25
        logits[2, :] = np.linspace(1, -1, experts)
        logits[2, k - 1 : k + 1] = 0.0
    return logits.astype(dtype)


def _prove(ctx: RewriteContext, y: ir.Value, e: _Experts):
    """(normalize, reverse) of the first candidate MoE that equals the region, or a reason."""
    try:
        _, by_shape = value_dependencies(y)
    except _Unprovable as err:
        return str(err)
    shaped = sorted(by_shape, key=lambda v: v.name or "")
    try:
        original = SubgraphEvaluator(ctx.graph, [y], inputs=[e.tokens, e.logits, *shaped])
    except Exception as err:
        return f"the experts region could not be evaluated ({type(err).__name__})"
    if set(original.input_names) - {e.tokens.name, e.logits.name, *(v.name for v in shaped)}:
        return "the experts region reads more than the tokens and router logits"
    elem = int(e.tokens.dtype)
    dtype = e.tokens.dtype.numpy()
    hidden, experts = e.fc1.weight.shape[2], e.fc1.weight.shape[0]
    rng = np.random.default_rng(0)
    probes = []
    for tokens in _TOKEN_COUNTS:
        feeds = _region_feeds(e, shaped, rng, tokens, hidden, experts, dtype)
        if isinstance(feeds, str):
            return feeds
        try:
            (want,) = original(feeds)
        except Exception as err:
            return f"the experts region could not be run ({type(err).__name__})"
        probes.append((feeds, np.asarray(want, np.float64)))
    tol = tolerance_for("float16" if e.tokens.dtype == ir.DataType.FLOAT16 else "float32")
    candidates = ((1, True), (0, True), (1, False), (0, False))
    if e.sparse_mixer:
        candidates = ((0, False), (0, True))
    for normalize, reverse in candidates:
        try:
            session = _candidate_session(e, normalize, reverse, elem, dtype)
        except Exception as err:
            return f"ORT's MoE rejects the experts ({str(err).splitlines()[0][:120]})"
        for feeds, want in probes:
            got = session.run(None, {"x": feeds[e.tokens.name], "r0": feeds[e.logits.name]})[0]
            if not np.allclose(got, want, atol=tol.atol, rtol=tol.rtol):
                break
        else:
            return normalize, reverse
    if e.sparse_mixer:
        return (
            "ORT's use_sparse_mixer MoE (either expert order) does not compute what the "
            "exported sparse-mixer router and experts compute"
        )
    return (
        "no MoE candidate (renormalized or not, either expert order) computes what the "
        "exported router and experts compute"
    )


@dataclasses.dataclass
class _MoEMatch:
    node: ir.Node
    experts: _Experts
    normalize: bool = False
    """Proven by ``check``: the router renormalizes its top-k weights."""
    reverse: bool = False
    """Proven by ``check``: the MoE reads the logits in reverse expert order (ties)."""


class ExpertsToMoE(
    Rule, name="experts-to-moe", stage=Stage.LOWER, anchor="ReduceSum", emits=(Capability.MOE,)
):
    """router + top-k + batched SwiGLU experts -> com.microsoft::MoE"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        matched = _match(node)
        if matched is None:
            return None
        if isinstance(matched, str):
            return Kept(ReasonCode.FORM, f"experts kept: {matched}")
        if ctx.skips(node):
            return None
        if matched.tokens.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return Kept(ReasonCode.DTYPE, "experts kept: MoE runs float32/float16 only")
        if _loop_is_cheaper(matched, ctx) and _loop_refusal(matched, ctx) is None:
            return None  # the record measured the loop faster here: legalize-experts-to-loop
        return _MoEMatch(node, matched)

    def check(self, m: _MoEMatch, ctx: RewriteContext) -> Kept | None:
        proven = _prove(ctx, m.node.outputs[0], m.experts)
        if isinstance(proven, str):
            return Kept(ReasonCode.NOT_PROVEN, f"experts kept: {proven}")
        m.normalize, m.reverse = proven
        return None

    def rewrite(self, m: _MoEMatch, ctx: RewriteContext) -> Rewritten:
        node, e, normalize, reverse = m.node, m.experts, m.normalize, m.reverse
        builder = Builder(ctx.graph, node, f"epfuse/{node.name or 'experts'}")
        fc1, b1, fc2, b2 = _moe_arrays(e, reverse, e.tokens.dtype.numpy())
        logits = e.logits
        if reverse:
            order = builder.const("expert_order", np.arange(fc1.shape[0])[::-1].copy())
            logits = builder.op("Gather", [logits, order], {"axis": 1})
        inputs = [
            e.tokens,
            logits,
            builder.const("fc1", fc1),
            builder.const("fc1_bias", b1) if b1 is not None else None,
            builder.const("fc2", fc2),
            builder.const("fc2_bias", b2) if b2 is not None else None,
        ]
        while inputs[-1] is None:
            inputs.pop()
        ensure_opset(ctx.model, "com.microsoft", 1)
        y = builder.op(
            "MoE", inputs, _moe_attributes(e, normalize), domain="com.microsoft", name="MoE"
        )
        old = node.outputs[0]
        y.shape, y.type = old.shape, old.type
        replace_value(old, y)
        remove_dead(ctx.graph, [node])
        how = "renormalized top-k" if normalize else "softmax top-k"
        if e.sparse_mixer:
            how = "sparse mixer (top 2)"
        extra = f", clamp {e.limit:g}" if e.limit is not None else ""
        return Rewritten(
            f"{fc1.shape[0]} experts, k={e.k}, {how}, SwiGLU alpha {e.alpha:g} beta {e.beta:g}"
            f"{extra} (proven on ORT, ties included)"
        )


# ---------------------------------------------------------------- EPs without MoE


def _emit_loop(b: Builder, e: _Experts, x: ir.Value, index: ir.Value, weights: ir.Value):
    """The experts as a loop in standard ops, on (tokens, the flat top-k index, the flat
    routing weights): per expert, the (token, slot) pairs routed to it (``NonZero``), its MLP
    on those tokens' rows, times their weights, added into the output rows (``ScatterND``
    with ``reduction="add"``)."""
    dtype = e.fc1.weight.dtype
    i64 = np.int64
    slots = b.op("Reshape", [index, b.const("flat", np.array([-1], i64))])
    flat_w = b.op("Reshape", [weights, b.const("column", np.array([-1, 1], i64))])
    acc = b.op("ConstantOfShape", [b.op("Shape", [x])], {"value": ir.tensor(np.zeros(1, dtype))})
    k = b.const("k", np.array(e.k, i64))
    zero, last = b.const("axis0", np.array([0], i64)), b.const("last", np.array([-1], i64))
    for expert in range(e.fc1.weight.shape[0]):
        routed = b.op("Equal", [slots, b.const(f"e{expert}", np.array(expert, i64))])
        pairs = b.op("Squeeze", [b.op("NonZero", [routed]), zero])  # flat (token, slot)
        tokens = b.op("Div", [pairs, k])
        rows = b.op("Gather", [x, tokens], {"axis": 0})

        def linear(act, weight, bias, name):
            out = b.op("MatMul", [act, b.const(name, np.ascontiguousarray(weight.T))])
            if bias is not None:
                out = b.op("Add", [out, b.const(f"{name}_bias", bias)])
            return out

        w1, b1 = e.fc1.weight[expert], e.fc1.bias
        gate = linear(
            rows, w1[e.gate_rows], None if b1 is None else b1[expert][e.gate_rows], f"gate{expert}"
        )
        up = linear(
            rows, w1[e.up_rows], None if b1 is None else b1[expert][e.up_rows], f"up{expert}"
        )
        if e.limit is not None:
            limit = np.array(e.limit, dtype)
            gate = b.op("Min", [gate, b.const("limit", limit)])
            up = b.op("Clip", [up, b.const("neg_limit", -limit), b.const("limit", limit)])
        if e.beta:
            up = b.op("Add", [up, b.const("beta", np.array(e.beta, dtype))])
        scaled = gate
        if e.alpha != 1.0:
            scaled = b.op("Mul", [gate, b.const("alpha", np.array(e.alpha, dtype))])
        act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [scaled])]), up])
        b2 = None if e.fc2.bias is None else e.fc2.bias[expert]
        y = linear(act, e.fc2.weight[expert], b2, f"down{expert}")
        y = b.op("Mul", [y, b.op("Gather", [flat_w, pairs], {"axis": 0})])
        at = b.op("Unsqueeze", [tokens, last])
        acc = b.op("ScatterND", [acc, at, y], {"reduction": "add"})
    return acc


def _loop_session(e: _Experts, opsets: dict[str, int]) -> ort.InferenceSession:
    x = ir.Value(name="x", type=e.tokens.type, shape=ir.Shape(["T", e.fc1.weight.shape[2]]))
    index = ir.Value(name="index", type=ir.TensorType(ir.DataType.INT64), shape=None)
    assert e.weights is not None
    weights = ir.Value(name="w", type=e.tokens.type, shape=None)  # the Mul reads both
    graph = ir.Graph([x, index, weights], [], nodes=[], opset_imports=dict(opsets), name="loop")
    builder = Builder(graph, None, "loop")
    y = _emit_loop(builder, e, x, index, weights)
    graph.extend(builder.nodes)
    y.type = e.tokens.type
    graph.outputs.append(y)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    proto = ir.to_proto(ir.Model(graph, ir_version=10))
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _prove_loop(ctx: RewriteContext, y: ir.Value, e: _Experts) -> str | None:
    """None when the loop, fed the region's own top-k index and weights, equals the region."""
    assert e.weights is not None
    try:
        _, by_shape = value_dependencies(y)
    except _Unprovable as err:
        return str(err)
    shaped = sorted(by_shape, key=lambda v: v.name or "")
    outputs = [y, e.fc1.index, e.weights]
    try:
        original = SubgraphEvaluator(ctx.graph, outputs, inputs=[e.tokens, e.logits, *shaped])
        session = _loop_session(e, dict(ctx.graph.opset_imports))
    except Exception as err:
        return f"the experts could not be evaluated ({str(err).splitlines()[0][:120]})"
    if set(original.input_names) - {e.tokens.name, e.logits.name, *(v.name for v in shaped)}:
        return "the experts region reads more than the tokens and router logits"
    dtype = e.tokens.dtype.numpy()
    hidden, experts = e.fc1.weight.shape[2], e.fc1.weight.shape[0]
    tol = tolerance_for("float16" if e.tokens.dtype == ir.DataType.FLOAT16 else "float32")
    rng = np.random.default_rng(0)
    for tokens in (*_TOKEN_COUNTS, experts + 4):
        feeds = _region_feeds(e, shaped, rng, tokens, hidden, experts, dtype)
        if isinstance(feeds, str):
            return feeds
        try:
            want, index, weights = original({n: feeds[n] for n in original.input_names})
            (got,) = session.run(None, {"x": feeds[e.tokens.name], "index": index, "w": weights})
        except Exception as err:
            return f"the experts could not be run ({type(err).__name__})"
        if got.shape != want.shape or not np.allclose(got, want, atol=tol.atol, rtol=tol.rtol):
            return "the loop over the experts does not compute what the batched experts compute"
    return None


_NOT_THIS_FORM = "the experts have no routing-weight product or are not float32/float16"


def decode_weights_per_expert(e: _Experts) -> int:
    """The weights each expert the loop visits carries for one token: top k x weights per
    expert / experts (the loop runs ~15 ops for every expert, routed or not)."""
    experts = e.fc1.weight.shape[0]
    per_expert = (e.fc1.weight.size + e.fc2.weight.size) // experts
    return e.k * per_expert // experts


def _loop_is_cheaper(e: _Experts, ctx: RewriteContext) -> bool:
    threshold = ctx.ops.experts_loop_min_decode_weights
    return threshold is not None and decode_weights_per_expert(e) >= threshold


def _loop_refusal(e: _Experts, ctx: RewriteContext) -> str | None:
    """None when ``legalize-experts-to-loop`` can emit the loop for these experts, else why not
    (read by ``experts-to-moe`` too: where the record prefers the loop, MoE still takes what
    the loop cannot)."""
    if e.weights is None or e.tokens.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return _NOT_THIS_FORM
    if ctx.graph.opset_imports.get("", 0) < 16:
        return "ScatterND add needs opset 16"
    return None


class ExpertsToLoop(
    Rule, name="legalize-experts-to-loop", stage=Stage.LEGALIZE, anchor="ReduceSum"
):
    """batched experts the EP cannot run as MoE, or runs slower -> a loop over the experts

    The batched form gathers one full weight matrix per (token, slot): (T * k, 2I, H) floats
    at a prompt of T tokens, more than an EP can hold at real sizes. Where the EP has no MoE,
    each expert runs instead on the rows routed to it (``NonZero``, ``Gather``, its MLP,
    ``ScatterND`` add), with the graph's own top-k index and routing weights, so whatever the
    router computes stays as it is; proven equal to the batched region on ORT. Where the EP
    has MoE but its record measured the loop faster at some shapes
    (``experts_loop_min_decode_weights``: ORT CPU float32), ``experts-to-moe`` leaves the
    experts of those shapes to this rule, which also takes the experts MoE could not be proven
    for there (they keep the graph's own router). A LEGALIZE rule (what the record does not
    take as MoE, as primitives), beside ``experts-to-moe`` because it reads the same form."""

    def requires(self, ops, ep):
        if ops.moe and ops.experts_loop_min_decode_weights is None:
            return f"{ep.name} runs com.microsoft::MoE"
        return None

    def match(self, node: ir.Node, ctx: RewriteContext):
        matched = _match(node)
        if matched is None or isinstance(matched, str) or ctx.skips(node):
            return None  # experts-to-moe reports the forms it cannot read
        why = _loop_refusal(matched, ctx)
        if why is None:
            return _MoEMatch(node, matched)
        if ctx.ops.moe or why is _NOT_THIS_FORM:
            return None  # experts-to-moe takes them
        return Kept(ReasonCode.OPSET, f"experts kept batched: {why}")

    def check(self, m: _MoEMatch, ctx: RewriteContext) -> Kept | None:
        why = _prove_loop(ctx, m.node.outputs[0], m.experts)
        return None if why is None else Kept(ReasonCode.NOT_PROVEN, f"experts kept batched: {why}")

    def rewrite(self, m: _MoEMatch, ctx: RewriteContext) -> Rewritten:
        node, e = m.node, m.experts
        assert e.weights is not None
        builder = Builder(ctx.graph, node, f"epfuse/{node.name or 'experts'}/loop")
        y = _emit_loop(builder, e, e.tokens, e.fc1.index, e.weights)
        old = node.outputs[0]
        y.shape, y.type = old.shape, old.type
        replace_value(old, y)
        remove_dead(ctx.graph, [node])
        if not ctx.ops.moe:
            why = "no MoE on this EP"
        elif _loop_is_cheaper(e, ctx):
            why = (
                f"measured faster than MoE on {ctx.ep.name} {ctx.dtype} at "
                f"{decode_weights_per_expert(e)} decode weights per expert"
            )
        else:
            why = "experts-to-moe did not take them"
        return Rewritten(
            f"{e.fc1.weight.shape[0]} experts as a loop over the experts ({why}; proven on ORT)",
            fused=False,
        )
