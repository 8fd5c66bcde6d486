"""Refine the symbolic shapes ONNX inference leaves unknown, in one forward pass.

ONNX shape inference names a dimension ``unk__N`` as soon as it cannot follow it: a residual
``Add`` of ``(batch_size, ...)`` and ``(unk__89, ...)``, a ``Slice`` with computed bounds, a
``Reshape`` whose target the TorchScript exporter builds at run time from
``Shape``/``Gather``/``Concat`` of ``Constant`` nodes. From there on every dimension of the
layer is anonymous, and rules that must prove "this is (batch, seq) of that" or "this axis
has 4 heads" cannot. This pass walks the graph once in order and derives each output's dims
from its operands' dims with the op's own shape rule (the Reshape target evaluated with
:func:`epfuse.patterns._graph.shape_vector`, ``-1`` solved by cancelling equal factors), and
writes a derived dimension where inference left an anonymous one: a static size, a
dimension name declared on a graph input or output (ONNX's meaning of a shared name), or a
product of those, named by its factors (``batch_size*sequence_length``: torch's
``hidden.view(-1, hidden_size)`` before a mixture of experts flattens the tokens, and the
experts' ``view(num_experts, batch, -1, hidden)`` after them solves back to
``sequence_length`` only by cancelling that product's factors).

Only proven dims are written, never a guess: an elementwise op takes a dimension only when
all operands agree on it (or are 1), ``Concat`` only off its axis. Work is linear in the
graph (each node once, each Reshape target evaluated at bounded depth).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import onnx_ir as ir

from .._graph import attr, const_ints, input_at, shape_vector

Term = int | str | None  # a static size, a declared dim name (or a product of them), unknown

_ELEMENTWISE = frozenset(
    {
        "Abs", "Add", "And", "Cast", "CastLike", "Ceil", "Cos", "Div", "Equal", "Erf", "Exp",
        "Floor", "Gelu", "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "Less",
        "LessOrEqual", "Log", "Max", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pow",
        "Reciprocal", "Relu", "Sigmoid", "Sign", "Sin", "Sqrt", "Sub", "Tanh", "Where", "Xor",
        "Softmax", "LogSoftmax", "Trilu",
    }
)  # fmt: skip
_FIRST_INPUT = frozenset(
    {
        "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "Clip",
        "ScatterElements", "ScatterND",
    }
)  # fmt: skip
_REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"})


def refine_shapes(graph: ir.Graph, declared: set[str] | None = None) -> int:
    """Write derived dims into the shapes of ``graph``'s values; the number of dims written.

    ``declared``: the dim names of the model's signature (read them before ONNX inference,
    which writes its own ``unk__N`` names into the outputs); by default read now."""
    if declared is None:
        declared = declared_names(graph)
    written = 0
    for node in graph:
        if node.domain not in ("", "ai.onnx") or not any(
            _has_unknown(out, declared) for out in node.outputs
        ):
            continue  # nothing to write: skip the derivation (most nodes of most graphs)
        try:
            derived = _derive(node, declared)
        except (IndexError, ValueError, TypeError, ZeroDivisionError):
            continue
        if derived is None:
            continue
        for out, dims in zip(node.outputs, derived, strict=False):
            if dims is not None:
                written += _merge(out, dims, declared)
    return written


def _has_unknown(value: ir.Value, declared: set[str]) -> bool:
    if value.is_graph_input() or value.is_graph_output():
        return False
    if value.shape is None:
        return True
    return any(
        not isinstance(d, int) and not _known(getattr(d, "value", None), declared)
        for d in value.shape
    )


def _known(name: str | None, declared: set[str]) -> bool:
    """A declared dim name, or a sum of products of static sizes and declared names
    (``a*b``, ``a+b``, ``2*a+b``: the names this pass writes, never one that is declared)."""
    if not name:
        return False
    if name in declared:
        return True
    products = [p.split("*") for p in name.split("+")]
    return (len(products) > 1 or len(products[0]) > 1) and all(
        f.isdigit() or f in declared for factors in products for f in factors
    )


def _sum(terms_: Sequence[Term], declared: set[str]) -> Term:
    """The term of a Concat's axis, ``sum(terms_)``: an int, or a canonical sum name (only
    of known terms; a sum is no factor of a product, so ``a*b+c`` reads one way)."""
    if any(t is None for t in terms_):
        return None
    static = sum(t for t in terms_ if isinstance(t, int))
    names = sorted(t for t in terms_ if isinstance(t, str))
    if not names:
        return static
    if len(names) == 1 and not static:
        return names[0]
    name = "+".join(names + ([str(static)] if static else []))
    return None if name in declared else name


def _factorize(term: Term, declared: set[str]) -> tuple[int, Counter] | None:
    """``term`` as (static coefficient, declared names with multiplicity); None if unknown."""
    if isinstance(term, int):
        return term, Counter()
    if term is None:
        return None
    if term in declared:
        return 1, Counter([term])
    if "+" in term:
        return None  # a sum is no factor (its products would read as the sum's terms)
    coefficient, names = 1, Counter()
    for part in term.split("*"):
        if part.isdigit():
            coefficient *= int(part)
        else:
            names[part] += 1
    return coefficient, names


def _product(coefficient: int, names: Counter, declared: set[str]) -> Term:
    """The term of ``coefficient * prod(names)``: an int, a name, or a canonical product."""
    factors = sorted(names.elements())
    if not factors:
        return coefficient
    if coefficient == 1 and len(factors) == 1:
        return factors[0]
    name = "*".join(([str(coefficient)] if coefficient != 1 else []) + factors)
    return None if name in declared else name  # a declared name means what its inputs say


def _multiply(terms_: Sequence[Term], declared: set[str]) -> Term:
    coefficient, names = 1, Counter()
    for term in terms_:
        factored = _factorize(term, declared)
        if factored is None:
            return None
        coefficient *= factored[0]
        names.update(factored[1])
    return _product(coefficient, names, declared)


def declared_names(graph: ir.Graph) -> set[str]:
    """Dim names on the graph's inputs and outputs, less those ONNX inference invents."""
    names = set()
    for value in (*graph.inputs, *graph.outputs):
        for d in value.shape or ():
            name = None if isinstance(d, int) else getattr(d, "value", None)
            if name and not name.startswith("unk__"):
                names.add(name)
    return names


def terms(value: ir.Value | None, declared: set[str]) -> list[Term] | None:
    """The dims of ``value`` as terms (anonymous names are unknown), or None if unranked."""
    if value is None or value.shape is None:
        return None
    out: list[Term] = []
    for d in value.shape:
        if isinstance(d, int):
            out.append(d)
        else:
            name = getattr(d, "value", None)
            out.append(name if _known(name, declared) else None)
    return out


def _merge(value: ir.Value, dims: Sequence[Term], declared: set[str]) -> int:
    known = terms(value, declared)
    if value.is_graph_input() or value.is_graph_output():
        return 0  # the signature stays as declared
    if known is None:
        known = [None] * len(dims)  # unranked: the derivation knows the rank
        value.shape = ir.Shape(known)
    if len(known) != len(dims):
        return 0
    merged, written = list(value.shape), 0
    for i, (have, got) in enumerate(zip(known, dims, strict=True)):
        if have is None and got is not None:
            merged[i] = got
            written += 1
    if written:
        value.shape = ir.Shape(merged)
    return written


def _broadcast(shapes: Sequence[list[Term]]) -> list[Term]:
    rank = max(len(s) for s in shapes)
    out: list[Term] = []
    for axis in range(rank):
        column = [s[axis - (rank - len(s))] for s in shapes if axis - (rank - len(s)) >= 0]
        statics = {t for t in column if isinstance(t, int) and t != 1}
        if statics:
            out.append(statics.pop() if len(statics) == 1 else None)
            continue
        rest = [t for t in column if t != 1]
        if not rest:
            out.append(1)
        elif None in rest or len(set(rest)) != 1:
            out.append(None)
        else:
            out.append(rest[0])
    return out


def _vector_terms(value: ir.Value | None, declared: set[str]) -> list[Term] | None:
    """A run-time shape vector as terms (entries that are no known term: None)."""
    vector = shape_vector(value)
    if vector is None:
        return None
    return [_entry_term(entry, declared) for entry in vector]


def _entry_term(entry: object, declared: set[str]) -> Term:
    """One entry of :func:`shape_vector` as a term: a size, a known name, or the sum or
    product of such entries; None for anything else."""
    if isinstance(entry, int):
        return entry
    if not isinstance(entry, tuple) or not entry:
        return None
    if entry[0] == "sym":
        return entry[1] if _known(entry[1], declared) else None
    if entry[0] in ("Add", "Mul") and len(entry) == 3:
        operands = [_entry_term(x, declared) for x in entry[1:]]
        return _sum(operands, declared) if entry[0] == "Add" else _multiply(operands, declared)
    return None


def _range_length(node: ir.Node, declared: set[str]) -> Term:
    """``Range(start, limit, 1)``'s length, ``limit - start``, where the limit is a sum with
    the start as one of its terms (``arange(past, past + seq)``) or the start is 0."""
    start, limit, delta = (shape_vector(v) for v in node.inputs[:3])
    if delta != [1] or start is None or limit is None or len(start) != 1 or len(limit) != 1:
        return None
    (a,), (b,) = start, limit
    if isinstance(a, int) and isinstance(b, int):
        return max(0, b - a)
    if a == 0:
        return _entry_term(b, declared)
    if isinstance(b, tuple) and b[:1] == ("Add",) and len(b) == 3 and a in b[1:]:
        return _entry_term(b[2] if b[1] == a else b[1], declared)
    return None


def _solve_minus_one(source: list[Term], target: list[Term], declared: set[str]) -> Term:
    """The size of the ``-1`` of a Reshape: product(source) / product(other target dims),
    cancelling equal symbolic factors; None unless every factor of the divisor cancels."""
    num = _factorize(_multiply(source, declared), declared)
    den = _factorize(_multiply([t for t in target if t != -1], declared), declared)
    if num is None or den is None or den[1] - num[1]:
        return None
    (p, names), q = num, den[0]
    return _product(p // q, names - den[1], declared) if q and p % q == 0 else None


def _axes(node: ir.Node, index: int, rank: int) -> list[int] | None:
    axes = attr(node, "axes")
    if axes is None:
        axes = const_ints(input_at(node, index))
    if axes is None:
        return None
    return [a + rank if a < 0 else a for a in axes]


def _derive(node: ir.Node, declared: set[str]) -> list[list[Term] | None] | None:
    op = node.op_type
    ins = [terms(v, declared) if v is not None else None for v in node.inputs]
    if op in _ELEMENTWISE:
        operands = [s for v, s in zip(node.inputs, ins, strict=True) if v is not None]
        if not operands or any(s is None for s in operands):
            return None
        return [_broadcast(operands)]
    if op in _FIRST_INPUT:
        return [ins[0]] if ins and ins[0] is not None else None
    if op == "Range":
        length = _range_length(node, declared)
        return None if length is None else [[length]]
    if op == "ConstantOfShape":
        target = _vector_terms(node.inputs[0], declared)
        return None if target is None else [target]
    data = ins[0] if ins else None
    if data is None:
        return None
    if op == "Gemm":
        a, b = data, ins[1]
        if b is None or len(a) != 2 or len(b) != 2:
            return None
        rows = a[1] if attr(node, "transA", 0) else a[0]
        return [[rows, b[0] if attr(node, "transB", 0) else b[1]]]
    if op == "TopK":
        k = const_ints(input_at(node, 1))
        if k is None or len(k) != 1:
            return None
        axis = attr(node, "axis", -1) % len(data)
        out = [k[0] if i == axis else t for i, t in enumerate(data)]
        return [out, out]
    if op == "Tile":
        repeats = _vector_terms(node.inputs[1], declared)
        if repeats is None or len(repeats) != len(data):
            return None
        return [[_multiply([t, r], declared) for t, r in zip(data, repeats, strict=True)]]
    if op == "MatMul":
        a, b = data, ins[1]
        if b is None or len(a) < 2 or len(b) < 2:
            return None
        batch = _broadcast([a[:-2], b[:-2]]) if len(a) > 2 or len(b) > 2 else []
        return [[*batch, a[-2], b[-1]]]
    if op == "Transpose":
        perm = attr(node, "perm") or list(reversed(range(len(data))))
        return [[data[p] for p in perm]]
    if op == "Reshape":
        target = _vector_terms(node.inputs[1], declared)
        if target is None:
            return None
        allowzero = attr(node, "allowzero", 0)
        out = [
            data[i] if t == 0 and not allowzero and i < len(data) else t
            for i, t in enumerate(target)
        ]
        if out.count(-1) == 1:
            out[out.index(-1)] = _solve_minus_one(data, out, declared)
        return [[None if t == -1 else t for t in out]]
    if op == "Expand":
        target = _vector_terms(node.inputs[1], declared)
        if target is None:
            return None
        return [_broadcast([data, target])]
    if op == "Concat":
        axis = attr(node, "axis")
        if any(s is None or len(s) != len(data) for s in ins):
            return None
        axis = axis + len(data) if axis < 0 else axis
        out = []
        for i in range(len(data)):
            column = [s[i] for s in ins]
            if i == axis:
                out.append(_sum(column, declared))
            else:  # all inputs agree off the axis: any known one is the size
                out.append(next((t for t in column if t is not None), None))
        return [out]
    if op in ("Slice", "Split"):
        rank = len(data)
        if op == "Slice":
            axes = const_ints(input_at(node, 3)) if input_at(node, 3) is not None else None
            if axes is None:
                if input_at(node, 3) is not None:
                    return None
                starts = const_ints(input_at(node, 1))
                axes = list(range(len(starts))) if starts is not None else None
            if axes is None:
                return None
            axes = [a + rank if a < 0 else a for a in axes]
        else:
            axes = [attr(node, "axis", 0) % rank]
        kept = [None if i in axes else t for i, t in enumerate(data)]
        return [kept for _ in node.outputs]
    if op == "Unsqueeze":
        raw = attr(node, "axes")
        raw = const_ints(input_at(node, 1)) if raw is None else list(raw)
        if raw is None:
            return None
        rank = len(data) + len(raw)
        axes = [a + rank if a < 0 else a for a in raw]
        out, it = [], iter(data)
        for i in range(len(data) + len(axes)):
            out.append(1 if i in axes else next(it))
        return [out]
    if op == "Squeeze":
        axes = _axes(node, 1, len(data))
        if axes is None:
            return None
        return [[t for i, t in enumerate(data) if i not in axes]]
    if op == "Gather":
        indices = ins[1]
        if indices is None:
            return None
        axis = attr(node, "axis", 0)
        axis = axis + len(data) if axis < 0 else axis
        return [[*data[:axis], *indices, *data[axis + 1 :]]]
    if op in _REDUCE:
        axes = _axes(node, 1, len(data))
        if axes is None:
            return None
        if attr(node, "keepdims", 1):
            return [[1 if i in axes else t for i, t in enumerate(data)]]
        return [[t for i, t in enumerate(data) if i not in axes]]
    return None
