"""A recorder for hand-written ONNX test graphs: the ``const``/``op`` pair every rule test
used to define for itself. ``op`` returns its output name, so expressions nest the way the
exporter's graph does: ``g.op("Mul", [g.op("MatMul", ["q", kt], "qk"), g.const("s", 0.25)], "qk_s")``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper


class ProtoGraph:
    def __init__(self, const_dtype=np.int64):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.const_dtype = const_dtype
        """The dtype of ``const`` values given without one (the graph's index type, usually)."""

    def const(self, name: str, value, dtype=None) -> str:
        array = np.asarray(value, dtype=dtype or self.const_dtype)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], out: str, n_out: int = 1, **attrs):
        """Add a node; returns its output name, or the names ``{out}_{i}`` for ``n_out`` > 1."""
        outs = [out] if n_out == 1 else [f"{out}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return out if n_out == 1 else outs


def run_unoptimized(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's first output on ORT CPU with graph optimizations off, so a rule's test
    compares the graph as written (ORT's own fusions would otherwise rewrite both sides)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)[0]
