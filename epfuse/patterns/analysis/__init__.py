"""Typed analyses the rules share (shapes, head counts), each computed once per run.

A rule asks an analysis, never another rule's private helpers; what an analysis proves is
memoized in the run context (``RewriteContext.cache``) where it is costly.
"""
