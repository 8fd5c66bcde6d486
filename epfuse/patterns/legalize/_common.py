"""What the EP's record lacks for one onnx_ir node (via ``conformance.missing_flags``)."""

from __future__ import annotations

import onnx_ir as ir

from epfuse.capabilities.conformance import missing_flags

from ..base import RewriteContext


def missing(node: ir.Node, ctx: RewriteContext) -> list[str]:
    """Record flags ``node`` needs and the EP lacks for the run's dtype ([] if it conforms)."""
    return missing_flags(node, ctx.ep, ctx.dtype)


def why(node: ir.Node, ctx: RewriteContext, flags: list[str]) -> str:
    return f"{ctx.ep.name} does not take {node.op_type} for {ctx.dtype} (needs {', '.join(flags)})"
