"""Declared matches: op trees that bind values, matched around one anchor node.

Rules used to find their shape by walking ``producer()`` chains by hand, with every
commutative operand order written out twice. A pattern here says the shape once::

    x = Var("x")
    rotated = op.Concat(op.Neg(op.Slice(x, ..., bind="second")), op.Slice(x, ...), axis=In(-1, 3))
    found = match(op.Add(op.Mul(x, Var("cos")), op.Mul(rotated, Var("sin")), commute=True), node)

A :class:`Var` binds the value it meets; meeting it again demands the same value (``x`` above
is one tensor in the Mul and both Slices). ``commute=True`` tries both operand orders of a
two-input op, :class:`Or` tries alternatives, ``ABSENT`` is a missing optional input, :class:`Const` / :func:`Ints` / :func:`Scalar`
test constants, attribute keywords test attributes (a literal, :class:`In`, or a callable),
``check=`` tests a matched node, and ``where=`` the whole match. The search backtracks fully:
a failure anywhere (a later operand, a node check, ``where``) retries the earlier choices,
so a declared pattern accepts exactly the graphs the written-out loops accepted.

Matching is linear in graph size: it starts at the anchor and only ever steps from a value
to its producer, so it visits at most the anchor's producer cone to the pattern's depth; its
cost per anchor depends on the pattern alone (commutative choices and alternatives multiply
per pattern, not per graph). onnxscript's rewriter offers the same idea; measured on this
project's rotate-half RoPE it was several times slower per anchor (``docs/architecture.md``,
"Declared matches"), because it expands each commutative op into whole-pattern copies and
builds a general match record per try.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from ._graph import const_array

Predicate = Callable[[Any], bool]


class Pattern:
    """What a value must be: a :class:`Var`, an op (``op.X(...)``), a constant test or an
    :class:`Or`."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Var(Pattern):
    """Any value (``None`` only with ``optional``), bound to ``name``; the same name met
    twice must be the same value. ``check`` tests the value when it is first bound."""

    name: str | None = None
    check: Callable[[ir.Value], bool] | None = None
    optional: bool = False


ANY = Var()
"""Any value, bound to nothing."""


class _Absent(Pattern):
    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
"""A missing optional input (``Or(Ints([1]), ABSENT)``: unit steps, given or defaulted)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Const(Pattern):
    """A constant (initializer or Constant-folded) value whose array satisfies ``test``."""

    test: Callable[[np.ndarray], bool]
    name: str | None = None


def Ints(*options: list[int], name: str | None = None) -> Const:
    """A constant integer vector equal to one of ``options`` (e.g. ``Ints([-1], [3])``)."""
    wanted = [list(o) for o in options]

    def test(array: np.ndarray) -> bool:
        return array.dtype.kind in "iu" and [int(v) for v in array.reshape(-1)] in wanted

    return Const(test, name)


def Scalar(test: Callable[[float], bool] | None = None, name: str | None = None) -> Const:
    """A one-element constant (of any rank), optionally satisfying ``test``."""
    return Const(lambda a: a.size == 1 and (test is None or test(float(a.reshape(-1)[0]))), name)


@dataclasses.dataclass(frozen=True, eq=False)
class Or(Pattern):
    """The first of ``alternatives`` that matches (the others are tried on backtracking)."""

    alternatives: tuple[Pattern, ...]

    def __init__(self, *alternatives: Pattern) -> None:
        object.__setattr__(self, "alternatives", alternatives)


@dataclasses.dataclass(frozen=True)
class In:
    """An attribute predicate: the attribute's value is one of ``values``."""

    values: tuple[Any, ...]

    def __init__(self, *values: Any) -> None:
        object.__setattr__(self, "values", values)

    def __call__(self, value: Any) -> bool:
        return value in self.values


@dataclasses.dataclass(frozen=True, eq=False)
class OpPattern(Pattern):
    """A value that is output ``output`` of a ``domain::op_type`` node whose inputs match
    ``inputs`` (more node inputs only with ``extra_inputs``; missing trailing inputs match
    only optional Vars) and whose attributes pass ``attributes``. ``bind`` names the node."""

    op_type: str
    inputs: tuple[Pattern, ...]
    attributes: tuple[tuple[str, Any], ...] = ()
    domain: str = ""
    commute: bool = False
    bind: str | None = None
    output: int = 0
    extra_inputs: bool = False
    check: Callable[[ir.Node], bool] | None = None

    def __post_init__(self) -> None:
        # Precomputed for speed: the domains accepted, and per input the op types its
        # producer may have (None: any), so that most failing anchors are refused after a
        # few producer() reads, before any search state is built.
        domains = ("", "ai.onnx") if self.domain == "" else (self.domain,)
        object.__setattr__(self, "_domains", domains)
        object.__setattr__(self, "_heads", tuple(_head_ops(i) for i in self.inputs))


def _head_ops(p: Pattern) -> frozenset[str] | None:
    """The op types a value matching ``p`` may be produced by (None: not only ops)."""
    if isinstance(p, OpPattern):
        return frozenset([p.op_type])
    if isinstance(p, Or):
        heads = [_head_ops(a) for a in p.alternatives]
        return None if any(h is None for h in heads) else frozenset().union(*heads)
    return None


def _plausible(heads: tuple[frozenset[str] | None, ...], values: list[ir.Value | None]) -> bool:
    for want, value in zip(heads, values, strict=True):
        if want is not None:
            node = value.producer() if value is not None else None
            if node is None or node.op_type not in want:
                return False
    return True


class _Ops:
    """``op.Add(a, b, commute=True, bind="add", axis=In(-1, 3))`` builds an OpPattern; the
    keywords ``domain``, ``commute``, ``bind``, ``output``, ``extra_inputs`` and ``check`` are
    the pattern's own, every other keyword tests the attribute of that name."""

    def __getattr__(self, op_type: str) -> Callable[..., OpPattern]:
        def build(
            *inputs: Pattern,
            domain: str = "",
            commute: bool = False,
            bind: str | None = None,
            output: int = 0,
            extra_inputs: bool = False,
            check: Callable[[ir.Node], bool] | None = None,
            **attributes: Any,
        ) -> OpPattern:
            if commute and len(inputs) != 2:
                raise ValueError(f"commute needs two inputs, {op_type} has {len(inputs)}")
            return OpPattern(
                op_type,
                tuple(inputs),
                tuple(attributes.items()),
                "" if domain == "ai.onnx" else domain,
                commute,
                bind,
                output,
                extra_inputs,
                check,
            )

        return build


op = _Ops()


class Match:
    """What a match bound: values by Var name (``m["x"]``, ``m.get``), nodes by ``bind`` name
    (``m.node("concat")``), and every matched node in visiting order (``m.nodes``, the anchor
    first) -- the chain a rewrite leaves dead."""

    __slots__ = ("_names", "_trail", "_values", "nodes")

    def __init__(self) -> None:
        self._values: dict[str, ir.Value | None] = {}
        self._names: dict[str, ir.Node] = {}
        self.nodes: list[ir.Node] = []
        self._trail: list[tuple[int, str | None]] = []
        """What the search bound, in order, so that a failed choice is undone (``_undo``)."""

    def __getitem__(self, name: str) -> ir.Value:
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values or name in self._names

    def get(self, name: str) -> ir.Value | None:
        return self._values.get(name)

    def node(self, name: str) -> ir.Node:
        return self._names[name]

    def optional_node(self, name: str) -> ir.Node | None:
        return self._names.get(name)


def match(
    pattern: OpPattern, node: ir.Node, where: Callable[[Match], bool] | None = None
) -> Match | None:
    """The first way ``node`` (the anchor) is ``pattern``'s root for which ``where`` holds,
    or None."""
    m = Match()
    inputs = _open(pattern, node, m)
    if inputs is None:
        return None
    return m if _branch(pattern, inputs, None, m, where) else None


def match_value(
    pattern: Pattern, value: ir.Value | None, where: Callable[[Match], bool] | None = None
) -> Match | None:
    """The first way ``value`` is ``pattern`` for which ``where`` holds, or None."""
    m = Match()
    return m if _solve((pattern, value, None), m, where) else None


# The search: ``todo`` is what is left to match, a linked list ``(pattern, value, rest)``
# shared between choices, so a choice point (commuted operands, Or) just tries each choice
# on the same rest and undoes what it bound. Everything between choice points is a loop.
_Todo = tuple[Pattern, "ir.Value | None", "_Todo"] | None


def _solve(todo: _Todo, m: Match, where: Callable[[Match], bool] | None) -> bool:
    """Match everything in ``todo`` (then ``where``); on success ``m`` holds the bindings,
    on failure the caller undoes them to its mark."""
    while todo is not None:
        p, value, todo = todo
        if type(p) is OpPattern:
            if value is None:
                return False
            node = value.producer()
            if node is None or len(node.outputs) <= p.output or node.outputs[p.output] is not value:
                return False
            inputs = _open(p, node, m)
            if inputs is None:
                return False
            if not inputs:  # the node was matched before under its bind name
                continue
            if p.commute:
                return _branch(p, inputs, todo, m, where)
            if not _plausible(p._heads, inputs):
                return False
            todo = _push(p.inputs, inputs, todo)
        elif type(p) is Var:
            if value is None and not p.optional:
                return False
            if p.name is None:
                if p.check is not None and (value is None or not p.check(value)):
                    return False
            elif p.name in m._values:
                if m._values[p.name] is not value:
                    return False
            else:
                if p.check is not None and (value is None or not p.check(value)):
                    return False
                m._values[p.name] = value
                m._trail.append((0, p.name))
        elif type(p) is Or:
            mark = len(m._trail)
            made = value.producer() if value is not None else None
            for alternative in p.alternatives:
                if type(alternative) is OpPattern and (
                    made is None or made.op_type != alternative.op_type
                ):
                    continue  # (refused without a recursion: the common case)
                if _solve((alternative, value, todo), m, where):
                    return True
                _undo(m, mark)
            return False
        elif type(p) is Const:
            array = const_array(value)
            if array is None or not p.test(array):
                return False
            if p.name is not None:
                if p.name in m._values:
                    if m._values[p.name] is not value:
                        return False
                else:
                    m._values[p.name] = value
                    m._trail.append((0, p.name))
        elif type(p) is _Absent:
            if value is not None:
                return False
        else:
            raise TypeError(f"not a pattern: {p!r}")
    return where is None or where(m)


def _open(p: OpPattern, node: ir.Node, m: Match) -> list[ir.Value | None] | None:
    """Check ``node`` itself against ``p`` and bind it; its inputs to match next (none when
    the same node was bound under this name before), or None."""
    if node.op_type != p.op_type or node.domain not in p._domains:
        return None
    if len(node.inputs) > len(p.inputs) and not p.extra_inputs:
        return None
    for name, test in p.attributes:
        attribute = node.attributes.get(name)
        got = None if attribute is None else attribute.value
        if not (test(got) if callable(test) else got == test):
            return None
    if p.check is not None and not p.check(node):
        return None
    if p.bind is not None:
        if p.bind in m._names:
            return [] if m._names[p.bind] is node else None
        m._names[p.bind] = node
        m._trail.append((1, p.bind))
    m.nodes.append(node)
    m._trail.append((2, None))
    inputs = list(node.inputs[: len(p.inputs)])
    inputs += [None] * (len(p.inputs) - len(inputs))
    return inputs


def _branch(
    p: OpPattern,
    inputs: list[ir.Value | None],
    todo: _Todo,
    m: Match,
    where: Callable[[Match], bool] | None,
) -> bool:
    """Match ``p``'s inputs (both orders when it commutes), then ``todo``."""
    if not inputs:  # the node was matched before under its bind name
        return _solve(todo, m, where)
    mark = len(m._trail)
    for order in (inputs, inputs[::-1]) if p.commute else (inputs,):
        if _plausible(p._heads, order):
            if _solve(_push(p.inputs, order, todo), m, where):
                return True
            _undo(m, mark)
    return False


def _push(patterns: tuple[Pattern, ...], values: list[ir.Value | None], todo: _Todo) -> _Todo:
    """``todo`` with the pairs in front, the first to be matched first (depth first)."""
    for i in range(len(patterns) - 1, -1, -1):
        todo = (patterns[i], values[i], todo)
    return todo


def _undo(m: Match, mark: int) -> None:
    trail = m._trail
    while len(trail) > mark:
        kind, name = trail.pop()
        if kind == 0:
            del m._values[name]
        elif kind == 1:
            del m._names[name]
        else:
            m.nodes.pop()
