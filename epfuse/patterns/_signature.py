"""The roles of a decoder's graph inputs, worked out from the graph (not from names).

* ``past``: rank-4 floating inputs (batch, kv_heads, past, head_dim).
* ``token``: rank-2 integer inputs other than the attention mask (input_ids, position_ids).
* ``mrope``: rank-3 integer inputs whose first dim is 3: (3, batch, seq) mRoPE position
  streams (temporal, height, width) of Qwen2-VL-style decoders.
* ``embeds``: rank-3 floating inputs (batch, seq, hidden).
* ``mask``: the rank-2 input a mask is computed from (batch, past + seq).

With roles, the analyses can make inputs of any (batch, seq, past) to probe a subgraph.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def probe_array(value: ir.Value, role_mask: ir.Value, batch: int, seq: int, past: int):
    """A dummy array shaped like ``value`` for the given sizes, or None if its role is unclear."""
    shape = value.shape
    dtype = value.dtype
    if shape is None or dtype is None:
        return None
    np_dtype = dtype.numpy() if dtype != ir.DataType.BFLOAT16 else np.float32
    dims = list(shape)

    def fixed(i: int) -> int | None:
        return dims[i] if isinstance(dims[i], int) else None

    if value is role_mask:
        return None  # filled by the caller
    if len(dims) == 4 and dtype in _FLOATS:
        d1, d3 = fixed(1), fixed(3)
        if d1 is None or d3 is None:
            return None
        return np.zeros((batch, d1, past, d3), dtype=np_dtype)
    if len(dims) == 2 and dtype in (ir.DataType.INT64, ir.DataType.INT32):
        return np.zeros((batch, seq), dtype=np_dtype)
    if len(dims) == 3 and dtype in (ir.DataType.INT64, ir.DataType.INT32) and fixed(0) == 3:
        return np.zeros((3, batch, seq), dtype=np_dtype)
    if len(dims) == 3 and dtype in _FLOATS:
        d2 = fixed(2)
        if d2 is None:
            return None
        return np.zeros((batch, seq, d2), dtype=np_dtype)
    return None
