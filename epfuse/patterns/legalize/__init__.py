"""Legalize: after lowering, make every node something the EP's record takes.

Canonicalization lifts to the standard form whatever the EP, and lowering picks the EP's best
ops where it can; what is left may still be an op the record does not take (an ``Attention``
with softcap on DML, an ``RMSNormalization`` on QNN, a ``GroupQueryAttention`` in a model
re-targeted to ``default``). The rules here map each such node to an op the record does take
or expand it back to primitives, exactly:

* ONNX ``Attention`` / ``RotaryEmbedding`` / ``RMSNormalization`` -> their ONNX function bodies
  (``expand``: the standard's own definition in primitive ops).
* ``com.microsoft::SkipSimplifiedLayerNormalization`` -> ``Add`` + ``RMSNormalization``
  (``skip_norm``; exact by definition).

``com.microsoft::GroupQueryAttention`` has no such rule: no exact standard form exists (it
writes the new K/V at ``seqlens_k``, not after the past, so ``Attention`` + ``Concat`` would
compute another present cache for a right-padded batch), so a re-targeted GQA model is refused
(``cannot re-target this model``) rather than rewritten approximately.

Whether a node needs legalizing is decided in one place, ``capabilities.conformance.
missing_flags``; the stage repeats to a fixed point, so chains (GQA -> Attention -> primitives)
resolve. A node no rule can make legal stops the run with a one-line error: epfuse never
writes a model its EP record does not take.
"""
