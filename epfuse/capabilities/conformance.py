"""Does a model contain only what a capability record allows? A structural check.

:func:`required_flags` maps one node to the capabilities it needs (members of the emission
table ``emissions.Capability``: ``GQA``, ``GQA_SOFTCAP``, ``MS_ROTARY_EMBEDDING``, ...);
:func:`missing_flags` says which of them
a record lacks (the optimizer's legalization stage and its final check both ask it), and
:func:`violations` checks every node of a model against ``record.ops(dtype)``. An optimized
model has none. With ``original``, nodes whose op and flags already occur in that model come
back separately as ``kept`` (for inspecting inputs, e.g. an input model against a record).

:func:`features` reads, per model, the attention features that must survive a rewrite in
*some* form: softcap values, sliding windows (GQA ``local_window_size`` or a standard
``Attention`` that still has its mask), interleaved and partial rotations. Tests compare the
features of the original and the optimized model.

Everything here reads onnx_ir nodes, so the optimizer (legalization, its final check) asks
about its own graph without converting it; :func:`check` and :func:`features` also take an
``onnx.ModelProto`` (a test's or a file's model), deserialized once at that boundary.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import onnx
import onnx_ir as ir

from .emissions import Capability
from .records import EPCapabilities

_GENERIC_VENDOR_OK: frozenset[str] = frozenset()
"""com.microsoft ops no record flag governs (none yet: every vendor op needs a flag)."""


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _present(node: ir.Node, index: int) -> bool:
    return index < len(node.inputs) and node.inputs[index] is not None


def _as_ir(model: onnx.ModelProto | ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model


_BY_OP: dict[tuple[str, str], Capability] = {
    ("", "RotaryEmbedding"): Capability.ROTARY_EMBEDDING,
    ("com.microsoft", "RotaryEmbedding"): Capability.MS_ROTARY_EMBEDDING,
    ("com.microsoft", "MRotaryEmbedding"): Capability.MROTARY_EMBEDDING,
    ("", "RMSNormalization"): Capability.RMS_NORMALIZATION,
    ("", "SimplifiedLayerNormalization"): Capability.SIMPLIFIED_LAYER_NORM,
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): Capability.SKIP_SIMPLIFIED_LAYER_NORM,
    ("com.microsoft", "SkipLayerNormalization"): Capability.SKIP_LAYER_NORM,
    ("com.microsoft", "MatMulNBits"): Capability.MATMUL_NBITS,
    ("com.microsoft", "GatherBlockQuantized"): Capability.GATHER_BLOCK_QUANTIZED,
    ("com.microsoft", "MoE"): Capability.MOE,
}
"""Ops that need exactly one capability whatever their attributes (GQA and Attention read
theirs in :func:`required_flags`)."""


def required_flags(node: ir.Node) -> tuple[Capability | str, ...] | None:
    """The capabilities ``node`` needs; None for an ordinary ONNX op no capability governs.

    A vendor op no capability governs needs ``"vendor op <domain>::<op>"``, which no record
    allows.
    """
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    op = (domain, node.op_type)
    if op == ("com.microsoft", "GroupQueryAttention"):
        flags = [Capability.GQA]
        if _attr(node, "do_rotary", 0):
            flags.append(Capability.GQA_FUSED_ROTARY)
            if _present(node, 9):  # without position_ids GQA rotates at its own positions
                flags.append(Capability.GQA_ROTARY_POSITION_IDS)
            if _attr(node, "rotary_interleaved", 0):
                flags.append(Capability.GQA_INTERLEAVED_ROTARY)
        if _attr(node, "softcap", 0.0):
            flags.append(Capability.GQA_SOFTCAP)
        if _attr(node, "local_window_size", -1) not in (-1, None):
            flags.append(Capability.GQA_LOCAL_WINDOW)
        if not _present(node, 1) and not _present(node, 2):
            flags.append(Capability.GQA_PACKED_QKV)
        if _present(node, 10):
            flags.append(Capability.GQA_ATTENTION_BIAS)
        if _present(node, 11):
            flags.append(Capability.GQA_HEAD_SINK)
        if _present(node, 14) or _present(node, 15):
            flags.append(Capability.GQA_QK_NORM)
        if _attr(node, "k_quant_type", "NONE") != "NONE":
            flags.append(Capability.GQA_KV_CACHE_INT8)
        return tuple(flags)
    if op == ("", "Attention"):
        if _attr(node, "softcap", 0.0):
            return (Capability.ATTENTION, Capability.ATTENTION_SOFTCAP)
        return (Capability.ATTENTION,)
    if op in _BY_OP:
        return (_BY_OP[op],)
    if domain and node.op_type not in _GENERIC_VENDOR_OK:
        return (f"vendor op {domain}::{node.op_type}",)  # no record flag allows it
    return None


def flag_allowed(record: EPCapabilities, dtype: str, flag: Capability | str) -> bool:
    """Does ``record`` allow ``flag`` for ``dtype``? A string that names no capability (an
    ungoverned vendor op) never is."""
    if not isinstance(flag, Capability):
        return False
    return flag.supported_by(record.ops(dtype))


def missing_flags(node: ir.Node, record: EPCapabilities, dtype: str) -> list[str]:
    """The record flags ``node`` needs that ``record.ops(dtype)`` lacks ([] when it conforms).

    The one place that decides whether the EP takes a node: ``check`` reports with it and the
    legalization rules (``epfuse.patterns.legalize``) rewrite every node it objects to.
    """
    signature = _signature(node)
    if signature is None:
        return []
    missing = [str(f) for f in signature[2] if not flag_allowed(record, dtype, f)]
    if not record.vendor_ops and signature[0]:
        missing.append("vendor_ops")
    gqa = record.ops(dtype).gqa
    if (
        gqa is not None
        and node.op_type == "GroupQueryAttention"
        and gqa.requires_rotary_caches
        and not _present(node, 7)
    ):
        missing.append("gqa.requires_rotary_caches (cos/sin absent)")
    return missing


@dataclasses.dataclass(frozen=True)
class Violation:
    """A node the EP's record does not take, as fields (code reads these; ``str()`` is the
    line the report and the refusal show)."""

    node: str
    """The node's name (its op type when unnamed)."""
    domain: str
    """``ai.onnx`` for ONNX, else the vendor domain (``com.microsoft``)."""
    op: str
    needs: tuple[str, ...]
    """The record flags the node needs and the record lacks."""

    @property
    def vendor(self) -> bool:
        """A vendor (non-ONNX) op: no standard form is implied by the record."""
        return self.domain not in ("", "ai.onnx")

    def __str__(self) -> str:
        return f"{self.node} ({self.domain}::{self.op}) needs {list(self.needs)}"


@dataclasses.dataclass
class Conformance:
    violations: list[Violation] = dataclasses.field(default_factory=list)
    """Emitted nodes the record does not allow: always a bug."""
    kept: list[Violation] = dataclasses.field(default_factory=list)
    """Nodes from the input the record does not run (the author's choice, reported)."""
    needed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """How often each flag was needed."""


def _signature(node: ir.Node) -> tuple[str, str, tuple[Capability | str, ...]] | None:
    flags = required_flags(node)
    if flags is None:
        return None
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return domain, node.op_type, flags


def check(
    model: ir.Model | onnx.ModelProto,
    record: EPCapabilities,
    dtype: str,
    original: ir.Model | onnx.ModelProto | None = None,
) -> Conformance:
    """Every node of ``model`` against ``record.ops(dtype)``; see the module docstring."""
    from_input = {_signature(n) for n in _as_ir(original).graph} if original is not None else set()
    result = Conformance()
    for node in _as_ir(model).graph:
        signature = _signature(node)
        if signature is None:
            continue
        result.needed.update(signature[2])
        missing = missing_flags(node, record, dtype)
        if not missing:
            continue
        found = Violation(
            node.name or node.op_type, signature[0] or "ai.onnx", node.op_type, tuple(missing)
        )
        (result.kept if signature in from_input else result.violations).append(found)
    return result


# ------------------------------------------------------------------------------ features


@dataclasses.dataclass(frozen=True)
class Features:
    softcaps: tuple[float, ...]
    """Softcap of every attention node carrying one (sorted)."""
    windows: tuple[int, ...]
    """GQA local_window_size values (sorted)."""
    masked_attention: int
    """Standard Attention nodes that still read a mask input."""
    attention_layers: int
    rotations: tuple[tuple[int, int], ...]
    """(interleaved, rotary_dim) per rotated tensor (Q and K count separately); rotary_dim is
    0 for a full-head rotation."""
    head_norms: int
    """Per-head (q/k) RMS norms: norm nodes whose scale is head_dim wide, plus two per GQA
    with q_norm_weight/k_norm_weight."""


def _initializer_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or not value.is_initializer() or value.const_value is None:
        return None
    return tuple(value.const_value.shape)


def features(model: ir.Model | onnx.ModelProto, head_dim: int) -> Features:
    softcaps, windows, rotations = [], [], []
    masked = layers = head_norms = 0
    for node in _as_ir(model).graph:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        op = (domain, node.op_type)
        if op in (("", "Attention"), ("com.microsoft", "GroupQueryAttention")):
            layers += 1
            if _attr(node, "softcap", 0.0):
                softcaps.append(round(float(_attr(node, "softcap", 0.0)), 6))
        if op == ("", "Attention") and _present(node, 3):
            masked += 1
        if op == ("com.microsoft", "GroupQueryAttention"):
            if _attr(node, "local_window_size", -1) not in (-1, None):
                windows.append(int(_attr(node, "local_window_size", -1)))
            if _attr(node, "do_rotary", 0):
                cos = _initializer_shape(node.inputs[7]) if _present(node, 7) else None
                width = 2 * int(cos[1]) if cos is not None else 0
                dim = 0 if width == head_dim else width
                inter = int(_attr(node, "rotary_interleaved", 0))
                rotations += [(inter, dim), (inter, dim)]
        if op == ("com.microsoft", "GroupQueryAttention") and _present(node, 14):
            head_norms += 2
        if node.op_type in _NORMS and len(node.inputs) > 1:
            scale = node.inputs[2 if node.op_type.startswith("Skip") else 1]
            if _initializer_shape(scale) == (head_dim,):
                head_norms += 1
        if node.op_type == "RotaryEmbedding" and domain in ("", "com.microsoft"):
            dim = int(_attr(node, "rotary_embedding_dim", 0))
            rotations.append((int(_attr(node, "interleaved", 0)), 0 if dim == head_dim else dim))
    return Features(
        softcaps=tuple(sorted(softcaps)),
        windows=tuple(sorted(windows)),
        masked_attention=masked,
        attention_layers=layers,
        rotations=tuple(sorted(rotations)),
        head_norms=head_norms,
    )


_NORMS = frozenset(
    {
        "RMSNormalization",
        "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "LayerNormalization",
    }
)
