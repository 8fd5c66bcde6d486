"""The shared edit helpers of ``epfuse.patterns._graph``: what a rewrite's replace tail keeps."""

import onnx_ir as ir

from epfuse.patterns._graph import Builder, only_consumer, substitute


def _chain() -> tuple[ir.Graph, ir.Node, ir.Node]:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    relu = ir.node("Relu", [x], name="relu")
    relu.outputs[0].name = "hidden"
    relu.outputs[0].shape = ir.Shape([2, 3])
    neg = ir.node("Neg", [relu.outputs[0]], name="neg")
    neg.outputs[0].name = "y"
    graph = ir.Graph([x], [neg.outputs[0]], nodes=[relu, neg], opset_imports={"": 23})
    return graph, relu, neg


def test_substitute_hands_over_name_shape_and_uses():
    graph, relu, neg = _chain()
    old = relu.outputs[0]
    new = ir.node("Sigmoid", [graph.inputs[0]], name="sigmoid")
    substitute(graph, [relu], new, [(old, new.outputs[0])])
    assert [n.op_type for n in graph] == ["Sigmoid", "Neg"]
    assert new.outputs[0].name == "hidden" and new.outputs[0].shape == ir.Shape([2, 3])
    assert neg.inputs[0] is new.outputs[0]
    assert old.name is None and not old.uses()


def test_substitute_keeps_a_graph_output_and_its_name():
    graph, relu, neg = _chain()
    new = ir.node("Abs", [relu.outputs[0]], name="abs")
    substitute(graph, [neg], new, [(neg.outputs[0], new.outputs[0])])
    assert graph.outputs[0] is new.outputs[0] and graph.outputs[0].name == "y"
    assert [n.op_type for n in graph] == ["Relu", "Abs"]


def test_substitute_places_several_new_nodes_in_order_after_the_anchor():
    """GQA's tail: the fused node and the layout nodes a detached Builder made for its
    output replace the matched nodes; readers of the replaced value now read the last one."""
    graph, relu, neg = _chain()
    fused = ir.node("Sigmoid", [graph.inputs[0]], name="fused")
    after = Builder(graph, None, "layout")  # detached: nothing is inserted yet
    shaped = after.op("Abs", [fused.outputs[0]])
    assert [n.op_type for n in graph] == ["Relu", "Neg"]
    substitute(graph, [relu], [fused, *after.nodes], [(relu.outputs[0], shaped)])
    assert [n.op_type for n in graph] == ["Sigmoid", "Abs", "Neg"]
    assert neg.inputs[0] is shaped and shaped.name == "hidden"


def test_substitute_removes_every_matched_node_and_hands_over_each_output():
    graph, relu, neg = _chain()
    fused = ir.node("Sigmoid", [graph.inputs[0]], num_outputs=2, name="fused")
    substitute(
        graph,
        [relu, neg],  # the anchor (whose output the graph reads) last
        fused,
        [(neg.outputs[0], fused.outputs[0]), (relu.outputs[0], fused.outputs[1])],
    )
    assert [n.name for n in graph] == ["fused"]
    assert graph.outputs[0] is fused.outputs[0] and fused.outputs[0].name == "y"
    assert fused.outputs[1].name == "hidden"


def test_only_consumer():
    _, relu, neg = _chain()
    assert only_consumer(relu.outputs[0]) is neg
    assert only_consumer(neg.outputs[0]) is None  # a graph output: others see it
    ir.node("Exp", [relu.outputs[0]])  # a second reader
    assert only_consumer(relu.outputs[0]) is None
