"""Moving attention tensors between the (B, N, S, H) and (B, S, N*H) layouts.

Exporters produce BNSH by ``Transpose(Reshape(x, [B, S, N, H]), perm=[0, 2, 1, 3])`` and
return to BSD by the mirror image. GroupQueryAttention wants BSD; when the mirror image is
present it is reused, otherwise the transposes are inserted (and remain correct).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._graph import Builder, Dim, attr, dim, input_at, producer, shape_vector

_BNSH = [0, 2, 1, 3]


def last_dim(value: ir.Value) -> int | None:
    """Static size of the last axis, from the shape or a MatMul/Add by a constant weight."""
    d = dim(value, -1) if value.shape is not None else None
    if isinstance(d, int):
        return d
    node = value.producer()
    if node is None:
        return None
    if node.op_type == "MatMul" and node.inputs[1] is not None:
        w = node.inputs[1].shape
        if w is not None and len(w) >= 2 and isinstance(w[-1], int):
            return w[-1]
    if node.op_type in ("Add", "Mul", "Cast", "Identity"):
        for operand in node.inputs:
            if operand is not None and operand.shape is not None and len(operand.shape) >= 2:
                found = last_dim(operand)
                if found is not None:
                    return found
        for operand in node.inputs:
            if operand is not None and operand.const_value is None:
                found = last_dim(operand)
                if found is not None:
                    return found
    return None


def bnsh_source(value: ir.Value, heads: int, head_size: int) -> ir.Value | None:
    """x when ``value = Transpose(Reshape(x, [B, S, heads, head_size]), [0, 2, 1, 3])``."""
    transpose = producer(value, "Transpose")
    if transpose is None or list(attr(transpose, "perm", [])) != _BNSH:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    x = reshape.inputs[0]
    if x.shape is not None and len(x.shape) != 3:
        return None
    target = shape_vector(reshape.inputs[1])
    width = last_dim(x)
    if target is None or len(target) != 4 or width != heads * head_size:
        return None
    if target[3] != head_size or target[2] not in (heads, -1):
        return None
    allowzero = attr(reshape, "allowzero", 0)
    for axis in (0, 1):
        if not _keeps_axis(target[axis], dim(x, axis), allowzero):
            return None
    return x


def _keeps_axis(requested, actual, allowzero: int) -> bool:
    """Does a Reshape entry keep input axis ``actual`` (batch or sequence) unchanged?

    0 copies the axis (without allowzero); a static size must equal the input's; a run-time
    term is accepted unless it is a different *declared* dimension (e.g. "seq" for "batch").
    """
    if isinstance(requested, int):
        return (requested == 0 and not allowzero) or requested == actual
    if isinstance(actual, int):
        return False
    return not (requested[0] == "sym" and actual[0] == "sym" and requested != actual)


def to_bsd(builder: Builder, value: ir.Value, heads: int, head_size: int) -> ir.Value:
    """(B, S, N*H) of a (B, N, S, H) value with N = heads, H = head_size (the caller's fact).

    Reuses the exporter's BSD source when there is one; when value is a [0, 2, 1, 3]
    Transpose of some y (e.g. of a per-head q/k norm on (B, S, N, H)), transposing back is
    y itself (that perm is its own inverse), so only a Reshape of y is added; otherwise a
    Transpose and a Reshape are.
    """
    source = bnsh_source(value, heads, head_size)
    if source is not None:
        return source
    shape = builder.const("bsd_shape", np.array([0, 0, heads * head_size], dtype=np.int64))
    transpose = producer(value, "Transpose")
    if transpose is not None and list(attr(transpose, "perm", [])) == _BNSH:
        return builder.op("Reshape", [transpose.inputs[0], shape])
    norm = _last_axis_norm(value)
    if norm is not None:
        # A norm over the last axis commutes with the transpose (which keeps that axis):
        # norm the (B, S, N, H) input of the transpose instead, then view it as BSD.
        moved = builder.op(
            norm.op_type,
            [norm.inputs[0].producer().inputs[0], *norm.inputs[1:]],
            {name: a.value for name, a in norm.attributes.items()},
        )
        return builder.op("Reshape", [moved, shape])
    t = builder.op("Transpose", [value], {"perm": _BNSH})
    return builder.op("Reshape", [t, shape])


_LAST_AXIS_NORMS = ("RMSNormalization", "LayerNormalization")


def _last_axis_norm(value: ir.Value) -> ir.Node | None:
    """The norm node when ``value = Norm(Transpose(y, [0, 2, 1, 3]), scale[, bias])`` over
    the last axis only (rank 4, ``axis`` -1 or 3, scale/bias at most rank 1, one output)."""
    node = value.producer()
    if node is None or node.op_type not in _LAST_AXIS_NORMS or node.domain not in ("", "ai.onnx"):
        return None
    if attr(node, "axis", -1) not in (-1, 3) or len(node.outputs) != 1:
        return None
    transpose = producer(node.inputs[0], "Transpose")
    if transpose is None or list(attr(transpose, "perm", [])) != _BNSH:
        return None
    for operand in node.inputs[1:]:
        if operand is not None and (operand.shape is None or len(operand.shape) > 1):
            return None
    return node


def identity_reshape(y: ir.Value) -> ir.Value | None:
    """The output of y's only consumer when it is a Reshape proven to keep y's shape.

    Some models re-view the attention output as (B, -1, S, H) before transposing it back
    (a no-op). Proven when the target is y's own dims term by term: each axis is the same
    static size or the same symbolic dimension (or 0 without allowzero), with at most one
    -1, which then can only be the remaining axis.
    """
    uses = list(y.uses())
    if len(uses) != 1 or y.is_graph_output() or y.shape is None:
        return None
    reshape = uses[0].node
    if reshape.op_type != "Reshape" or uses[0].idx != 0:
        return None
    target = shape_vector(input_at(reshape, 1))
    if target is None or len(target) != len(y.shape) or target.count(-1) > 1:
        return None
    allowzero = attr(reshape, "allowzero", 0)
    for axis, got in enumerate(target):
        known = dim(y, axis)
        if got == -1 or (got == 0 and not allowzero) or got == known:
            continue
        return None
    return reshape.outputs[0]


def bsd_consumer(
    y: ir.Value, width: int, batch_seq: tuple[Dim, Dim] | None = None
) -> ir.Value | None:
    """The (B, S, N*H) value when y (B, N, S, H) is only read through Transpose + Reshape
    (after, optionally, a Reshape proven to be the identity).

    ``batch_seq``: terms for y's batch and sequence known from elsewhere (an ``Attention``'s
    output has its query's): TorchScript exports leave the attention output's dims anonymous
    (``unk__N``), while the Reshape target names the declared ``batch`` and ``seq``."""
    if (same := identity_reshape(y)) is not None:
        y = same
    uses = list(y.uses())
    if len(uses) != 1 or y.is_graph_output():
        return None
    transpose = uses[0].node
    if transpose.op_type != "Transpose" or list(attr(transpose, "perm", [])) != _BNSH:
        return None
    t_uses = list(transpose.outputs[0].uses())
    if len(t_uses) != 1 or transpose.outputs[0].is_graph_output():
        return None
    reshape = t_uses[0].node
    if reshape.op_type != "Reshape" or t_uses[0].idx != 0:
        return None
    target = shape_vector(reshape.inputs[1])
    if target is None or len(target) != 3 or target[2] not in (width, -1):
        return None
    allowzero = attr(reshape, "allowzero", 0)
    bsnh = transpose.outputs[0]
    for axis in (0, 1):  # batch and sequence must stay where they are (not swapped)
        if _keeps_axis(target[axis], dim(bsnh, axis), allowzero):
            continue
        if batch_seq is None or not _keeps_axis(target[axis], batch_seq[axis], allowzero):
            return None
    return reshape.outputs[0]


def from_bsd(builder: Builder, value: ir.Value, heads: int, head_size: int) -> ir.Value:
    shape = builder.const("bnsh_shape", np.array([0, 0, heads, head_size], dtype=np.int64))
    r = builder.op("Reshape", [value, shape])
    return builder.op("Transpose", [r], {"perm": _BNSH})
