"""Typed analyses the rules share (shapes, head counts, mask proofs, mRoPE sections).

A rule asks an analysis, never another rule's private helpers: ``ctx.analysis(Kind, *key)``
returns the typed result, computed once per key and cached in the run's
:class:`~epfuse.patterns.analysis.manager.AnalysisManager` while what it names is still in
the graph (``manager`` says why that is enough).
"""
