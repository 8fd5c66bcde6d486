"""The analysis manager: one computation per key, keys that hold the objects themselves (no
``id()`` reuse), and entries dropped once what they name leaves the graph."""

from __future__ import annotations

import dataclasses
import gc

import onnx_ir as ir
from model_builder import DecoderConfig, build_decoder

from epfuse.capabilities import get_ep
from epfuse.patterns import OptimizeOptions, RewriteContext
from epfuse.patterns._graph import substitute
from epfuse.patterns.analysis.manager import Analysis, Unproven
from epfuse.patterns.analysis.mask_proof import MaskProof, attention_mask_proof


@dataclasses.dataclass(frozen=True)
class _Producer(Analysis):
    """Test analysis: the op type of a value's producer, and the producer itself."""

    op: str
    node: ir.Node
    calls = []  # noqa: RUF012  (class-level log of computations)

    @classmethod
    def compute(cls, ctx, value):
        cls.calls.append(value)
        node = value.producer()
        return Unproven("a graph input") if node is None else cls(node.op_type, node)


@dataclasses.dataclass(frozen=True)
class _Reader(Analysis):
    """Test analysis: the first node that reads a value (its key stays live when it goes)."""

    node: ir.Node

    @classmethod
    def compute(cls, ctx, value):
        return cls(value.consumers()[0])


def _chain() -> tuple[ir.Model, ir.Value, ir.Node, ir.Node]:
    """x -> Relu -> Neg -> y."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    relu = ir.node("Relu", [x], name="relu")
    neg = ir.node("Neg", [relu.outputs[0]], name="neg")
    neg.outputs[0].name = "y"
    graph = ir.Graph([x], [neg.outputs[0]], nodes=[relu, neg], opset_imports={"": 23})
    return ir.Model(graph, ir_version=10), x, relu, neg


def _ctx(model: ir.Model, max_seq_len: int = 4096) -> RewriteContext:
    return RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(max_seq_len))


def test_a_result_is_computed_once_per_key_and_typed():
    model, x, relu, neg = _chain()
    ctx = _ctx(model)
    _Producer.calls.clear()
    first = ctx.analysis(_Producer, neg.outputs[0])
    assert first == _Producer("Neg", neg)
    assert ctx.analysis(_Producer, neg.outputs[0]) is first
    assert ctx.analysis(_Producer, relu.outputs[0]).op == "Relu"
    assert ctx.analysis(_Producer, x) == Unproven("a graph input")
    assert _Producer.calls == [neg.outputs[0], relu.outputs[0], x]
    assert ctx.analyses.computed == 3


def test_a_key_that_left_the_graph_is_recomputed_and_its_successor_is_a_new_key():
    model, _, relu, _ = _chain()
    ctx = _ctx(model)
    y_relu = relu.outputs[0]
    assert ctx.analysis(_Producer, y_relu).node is relu
    # A rewrite replaces the Relu by an equivalent Clip: the old node leaves the graph.
    clip = ir.node("Clip", [relu.inputs[0]], name="clip")
    substitute(model.graph, [relu], clip, [(y_relu, clip.outputs[0])])
    assert relu.graph is None
    # The old key value left the graph with its producer: asking it again recomputes.
    _Producer.calls.clear()
    stale = ctx.analysis(_Producer, y_relu)
    assert _Producer.calls == [y_relu] and stale.node is relu
    # The new value is a new key, never the old value's entry.
    assert ctx.analysis(_Producer, clip.outputs[0]) == _Producer("Clip", clip)


def test_a_result_naming_a_removed_node_is_dropped_though_its_key_is_live():
    model, x, relu, _ = _chain()
    ctx = _ctx(model)
    assert ctx.analysis(_Reader, x).node is relu
    clip = ir.node("Clip", [x], name="clip")
    substitute(model.graph, [relu], clip, [(relu.outputs[0], clip.outputs[0])])
    assert ctx.analysis(_Reader, x).node is clip and ctx.analyses.computed == 2


def test_a_live_result_survives_rewrites_elsewhere():
    """Rewrites preserve what every value left in the graph computes, so a fact about a live
    value is not recomputed because something upstream was rewritten."""
    model, _, relu, neg = _chain()
    ctx = _ctx(model)
    y = neg.outputs[0]
    first = ctx.analysis(_Producer, y)
    clip = ir.node("Clip", [relu.inputs[0]], name="clip")
    substitute(model.graph, [relu], clip, [(relu.outputs[0], clip.outputs[0])])
    assert neg.inputs[0] is clip.outputs[0]  # the Neg now reads the Clip
    assert ctx.analysis(_Producer, y) is first and ctx.analyses.computed == 1


def test_keys_hold_their_objects_so_an_id_is_never_reused():
    """A key is the value itself: the manager keeps it alive, so no later value can take its
    ``id``, and a value with an equal name is a different key."""
    model, _, relu, _ = _chain()
    ctx = _ctx(model)
    ids = set()
    for i in range(50):
        node = ir.node("Relu", [relu.outputs[0]], name=f"tmp{i}")
        model.graph.append(node)
        value = node.outputs[0]
        assert ctx.analysis(_Producer, value).node is node
        ids.add(id(value))
        model.graph.remove(node, safe=True)
        del node, value
        gc.collect()
    assert len(ids) == 50  # every key was kept alive by its entry: 50 distinct ids
    twin = ir.node("Relu", [relu.outputs[0]], name="twin")
    model.graph.append(twin)
    twin.outputs[0].name = relu.outputs[0].name
    assert ctx.analysis(_Producer, twin.outputs[0]).node is twin


def test_precision_conversion_invalidates_every_entry():
    model, _, _, neg = _chain()
    ctx = _ctx(model)
    ctx.analysis(_Producer, neg.outputs[0])
    assert len(ctx.analyses) == 1
    ctx.analyses.invalidate()
    assert len(ctx.analyses) == 0
    ctx.analysis(_Producer, neg.outputs[0])
    assert ctx.analyses.computed == 2


def test_peek_never_computes():
    model, _, _, neg = _chain()
    ctx = _ctx(model)
    assert ctx.analyses.peek(_Producer, neg.outputs[0]) is None
    got = ctx.analysis(_Producer, neg.outputs[0])
    assert ctx.analyses.peek(_Producer, neg.outputs[0]) is got
    assert ctx.analyses.computed == 1


def test_built_values_are_rebuilt_once_removed():
    model, x, relu, _ = _chain()
    ctx = _ctx(model)
    made = []

    def build():
        node = ir.node("Identity", [x], name=f"shared{len(made)}")
        model.graph.insert_before(relu, node)
        made.append(node)
        return node.outputs[0]

    first = ctx.analyses.built("shared", (x,), build)
    assert ctx.analyses.built("shared", (x,), build) is first and len(made) == 1
    model.graph.remove(made[0], safe=True)
    second = ctx.analyses.built("shared", (x,), build)
    assert second is not first and len(made) == 2


def test_every_layer_shares_one_mask_proof_until_the_mask_is_rewritten():
    """The mask proof every layer reads is evaluated once; rewriting the mask's producer
    into a new value makes it a new key (proven again), the old entry being unreachable."""
    model = ir.from_proto(build_decoder(DecoderConfig(layers=3)))
    ctx = _ctx(model, 256)
    layers = [n for n in model.graph if n.op_type == "Attention"]
    assert len(layers) == 3
    proofs = [attention_mask_proof(ctx, node) for node in layers]
    assert all(isinstance(p, MaskProof) for p in proofs)
    assert proofs[1] is proofs[0] and proofs[2] is proofs[0]
    assert ctx.analyses.computed == 1
    # Put an equivalent Identity in front of the mask every layer reads.
    mask = layers[0].inputs[3]
    identity = ir.node("Identity", [mask], name="mask_copy")
    model.graph.insert_before(layers[0], identity)
    for node in layers:
        node.replace_input_with(3, identity.outputs[0])
    again = attention_mask_proof(ctx, layers[1])
    assert isinstance(again, MaskProof) and again is not proofs[0]
    assert attention_mask_proof(ctx, layers[2]) is again
    assert ctx.analyses.computed == 2
    assert (again.kind, again.window) == (proofs[0].kind, proofs[0].window)
