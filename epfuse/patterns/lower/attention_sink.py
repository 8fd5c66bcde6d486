"""The canonical attention-sink form -> GroupQueryAttention's ``head_sink`` input.

``canonicalize/attention_sinks`` leaves GPT-OSS's sinks as standard ONNX::

    Y_att, present_k, present_v, S = Attention(..., qk_matmul_output_mode=2)
    Y = Y_att * Sigmoid(ReduceLogSumExp(S, axes=[-1], keepdims=1) - sink)

GroupQueryAttention's ``head_sink`` (N) adds ``exp(sink[h])`` to each softmax denominator of
head h (ORT 1.32 CPU, checked by ``capabilities.probe``'s known answer), which is the same
number. :func:`match_sink` recognizes the correction around one Attention and returns the
per-head sink vector and the value GQA's output replaces; ``lower/gqa`` uses it where the
record has ``gqa.head_sink`` and otherwise keeps the standard form (exact), with the reason.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._graph import attr, const_array, const_ints, input_at, only_consumer


@dataclasses.dataclass
class SinkPlan:
    sinks: np.ndarray
    """(num_heads,) sink logits in the model dtype."""
    output: ir.Value
    """The sink-scaled output (the Mul) that GQA's output replaces."""
    nodes: list[ir.Node]
    """The correction's nodes, dead once GQA replaces ``output``."""


def qk_used(node: ir.Node) -> bool:
    if len(node.outputs) < 4:
        return False
    qk = node.outputs[3]
    return bool(qk.uses() or qk.is_graph_output())


def match_sink(node: ir.Node, num_heads: int) -> SinkPlan | str:
    """The sink correction on ``node``'s qk output, or why the qk output is not one."""
    why = "the qk_matmul output is used (and is not an attention-sink correction)"
    if attr(node, "qk_matmul_output_mode", 0) != 2:
        return why
    if attr(node, "softcap", 0.0):
        return "attention sinks with a softcap: GQA's head_sink order is not verified for it"
    lse = only_consumer(node.outputs[3])
    if lse is None or lse.op_type != "ReduceLogSumExp" or lse.domain != "":
        return why
    axes = const_ints(input_at(lse, 1)) if len(lse.inputs) > 1 else attr(lse, "axes")
    if axes is None or list(axes) not in ([-1], [3]) or attr(lse, "keepdims", 1) != 1:
        return why
    sub = only_consumer(lse.outputs[0])
    if sub is None or sub.op_type != "Sub" or sub.inputs[0] is not lse.outputs[0]:
        return why
    sinks = const_array(sub.inputs[1])
    if sinks is None or sinks.size != num_heads:
        return "the sink logits are not one constant per head"
    if sinks.ndim == 4 and sinks.shape != (1, num_heads, 1, 1):
        return "the sink logits do not broadcast over the heads axis"
    if sinks.ndim not in (1, 4) or (sinks.ndim == 1 and num_heads != 1):
        return "the sink logits do not broadcast over the heads axis"
    sigmoid = only_consumer(sub.outputs[0])
    if sigmoid is None or sigmoid.op_type != "Sigmoid":
        return why
    mul = only_consumer(sigmoid.outputs[0])
    if mul is None or mul.op_type != "Mul" or node.outputs[0] not in mul.inputs:
        return why
    if only_consumer(node.outputs[0]) is not mul:
        return "the attention output is also read without the sink correction"
    return SinkPlan(sinks.reshape(-1), mul.outputs[0], [mul, sigmoid, sub, lse])
