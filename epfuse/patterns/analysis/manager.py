"""The run's analysis manager: typed results, computed once per key, dropped when stale.

Modelled on LLVM's new pass manager: a rule asks ``ctx.analysis(MaskProof, mask, ...)`` and
gets the analysis's typed result (a frozen dataclass, or :class:`Unproven` with the reason),
computed by the analysis's ``compute`` the first time and cached in the run's
:class:`AnalysisManager` (``RewriteContext.analyses``) after that. Rules never keep memos of
their own, and never read each other's.

Keys hold the ``ir.Value`` / ``ir.Node`` objects themselves (hashed by identity, which is what
onnx-ir's ``__hash__``/``__eq__`` are), never ``id()``: an entry keeps its objects alive, so a
value freed by a rewrite cannot lend its ``id`` to a new value that would then read the old
value's result.

Invalidation, and why this scheme is enough. Every rewrite the driver applies preserves what
each value left in the graph computes (the project's bar: a rewrite counts only when proven
equivalent), and every analysis here proves a fact about what its key values compute (this
mask is causal + padding, these cos/sin are rows of those caches, this axis has 8 heads, these
columns follow these mRoPE streams). Such a fact stays true whatever is rewritten upstream,
as long as the objects it names are still in the graph. So an entry goes stale only when:

1. an ``ir`` object of its key or of its result has left the graph (a node removed, a value
   whose producer was removed, an initializer unregistered): checked at *every* lookup, in
   O(objects the entry names) -- a handful -- so no rewrite has to report what it removed
   (rules that build constants in ``check``, or edit with ``replace_input_with`` instead of
   ``substitute``, are covered alike). A stale entry is dropped and recomputed;
2. a stage changes what values compute on purpose: only the precision conversion (dtypes),
   which calls :meth:`AnalysisManager.invalidate` when it converts;
3. the fact is about a node's operands, not its outputs (:class:`HeadCounts` of an
   ``Attention``): such an analysis takes the operands in its key, so a node re-wired to other
   inputs is a new key.

A cached :class:`Unproven` is kept under the same rules: a stale refusal can only keep the
original graph, never make a rewrite unsafe. A generation counter per stage would not be
enough: one GQA rewrite would then drop the mask proof every later layer shares (128
re-evaluations on a 128-layer model) although nothing it read changed.

Values a rewrite builds once and shares (``seqlens_k``, constant cos/sin caches) are kept
with :meth:`AnalysisManager.built` under the same keys and the same liveness check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import onnx_ir as ir

if TYPE_CHECKING:
    from ..base import RewriteContext

T = TypeVar("T")
A = TypeVar("A", bound="Analysis")


@dataclasses.dataclass(frozen=True)
class Unproven:
    """An analysis's answer when the fact does not hold or cannot be proven."""

    reason: str


class Analysis:
    """Base of a typed analysis: a frozen dataclass (its result type) with a ``compute``
    classmethod run by the manager on a cache miss.

    ``compute(ctx, *key)`` returns an instance of the class, an :class:`Unproven`, or (for an
    analysis that first asks whether the key is its kind of value at all) None. Its key
    arguments are ``ir.Value``/``ir.Node`` objects and hashable scalars (bytes for arrays).
    """

    name: ClassVar[str] = ""

    @classmethod
    def compute(cls: type[A], ctx: RewriteContext, *key: Any) -> A | Unproven | None:
        raise NotImplementedError


class AnalysisManager:
    """The cached results of one run's analyses (see the module docstring for when an entry
    is dropped). One per :class:`~epfuse.patterns.base.RewriteContext`."""

    def __init__(self, graph: ir.Graph):
        self._graph = graph
        self._entries: dict[tuple, tuple[Any, tuple[ir.Value | ir.Node, ...]]] = {}
        self.computed = 0
        """Cache misses so far (tests and benchmarks read it)."""

    def get(self, kind: type[A], ctx: RewriteContext, *key: Any) -> A | Unproven | None:
        """The result of ``kind`` for ``key``: cached, else ``kind.compute(ctx, *key)``."""
        return self._lookup((kind, *key), lambda: kind.compute(ctx, *key))

    def peek(self, kind: type[A], *key: Any) -> A | Unproven | None:
        """The cached result of ``kind`` for ``key`` if one is cached and live, else None
        (reports ask what a run already found, without computing it)."""
        full = (kind, *key)
        found = self._entries.get(full)
        if found is None:
            return None
        if not self._live(found[1]):
            del self._entries[full]
            return None
        return found[0]

    def built(self, kind: str, key: tuple, build: Callable[[], T]) -> T:
        """Values ``build()`` adds to the graph, built once per ``(kind, *key)`` and shared
        while they (and the key's objects) are still in the graph."""
        return self._lookup((kind, *key), build)

    def invalidate(self) -> None:
        """Drop every entry: the graph's values now compute something else (precision)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _lookup(self, full: tuple, make: Callable[[], T]) -> T:
        found = self._entries.get(full)
        if found is not None and self._live(found[1]):
            return found[0]
        result = make()
        self.computed += 1
        self._entries[full] = (result, (*_objects(full), *_objects(_fields(result))))
        return result

    def _live(self, objects: tuple[ir.Value | ir.Node, ...]) -> bool:
        graph = self._graph
        return all(obj.graph is graph for obj in objects)


def _fields(result: Any) -> Iterable[Any]:
    """What a result names: a dataclass's fields, a tuple's items, or the result itself."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return [getattr(result, f.name) for f in dataclasses.fields(result)]
    if isinstance(result, (tuple, list)):
        return result
    return (result,)


def _objects(items: Iterable[Any]) -> tuple[ir.Value | ir.Node, ...]:
    """The ``ir`` values and nodes among ``items`` (one level into tuples)."""
    found: list[ir.Value | ir.Node] = []
    for item in items:
        if isinstance(item, (ir.Value, ir.Node)):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(x for x in item if isinstance(x, (ir.Value, ir.Node)))
    return tuple(found)
