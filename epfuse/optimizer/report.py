"""The structured report of one optimization: per attention layer what happened and why,
which rules ran, and the input contract the optimized model assumes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from epfuse.capabilities.conformance import Violation
from epfuse.patterns.base import AttentionFacts

METADATA_KEY = "epfuse.report"


@dataclasses.dataclass
class LayerReport:
    layer: int
    node: str
    result: str = "Attention (kept)"
    fused: bool = False
    reasons: list[str] = dataclasses.field(default_factory=list)
    """Why the layer was kept, or why a feature stayed outside the fused op."""
    codes: list[str] = dataclasses.field(default_factory=list)
    """The distinct :class:`~epfuse.patterns.reasons.ReasonCode` values behind ``reasons``
    (stable: read these, not the wording)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    runs_on_ep: bool = True
    """False when the layer was kept in a form the EP's record does not run (it falls back)."""
    facts: AttentionFacts | None = None
    """For a fused layer: the fused node's parameters (heads, head size, rotary, window,
    softcap, sinks) as fields; read these, not ``notes``."""
    from_input: bool = False
    """The input already had this layer as GroupQueryAttention (a re-targeted optimized
    model): nothing was left to fuse, and strict mode counts it as fused."""

    def keep(self, code: str, message: str) -> None:
        """Record why (part of) the layer was kept: the message as shown, the code once."""
        self.reasons.append(message)
        if code not in self.codes:
            self.codes.append(str(code))


def _layer_from_dict(data: dict[str, Any]) -> LayerReport:
    data = dict(data)
    if data.get("facts") is not None:
        data["facts"] = AttentionFacts(**data["facts"])
    return LayerReport(**data)


@dataclasses.dataclass
class RuleReport:
    name: str
    stage: str
    selected: bool
    not_selected_because: str | None = None
    rewritten: int = 0
    kept: int = 0
    kept_reasons: list[str] = dataclasses.field(default_factory=list)
    """Distinct reasons given when the rule kept a node (e.g. a decomposed attention that was
    not lifted, which no layer entry records since no Attention op exists for it)."""
    kept_codes: list[str] = dataclasses.field(default_factory=list)
    """The distinct reason codes behind ``kept_reasons``."""


@dataclasses.dataclass
class Report:
    ep: str
    dtype: str
    options: dict[str, Any]
    layers: list[LayerReport] = dataclasses.field(default_factory=list)
    rules: list[RuleReport] = dataclasses.field(default_factory=list)
    assumptions: list[str] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    violations: list[Violation] = dataclasses.field(default_factory=list)
    """Nodes the EP's record does not take after legalization (a model with any is refused);
    ``str()`` of each is its one-line description."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    """What the run could not do as designed but that did not make the model wrong (a stage
    without a fixed point, shape inference that failed), and what the caller should know
    (``max_seq_len`` above the model's own maximum position); the CLI also prints each on
    stderr as ``epfuse: warning: ...``."""
    verification: str | None = None
    """With ``optimize(verify=True)``: the verdict against the original, and what was rolled
    back (None when not verified)."""
    precision: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The chosen precision and why (``requested``, ``chosen``, ``source_dtype``,
    ``compute_dtype``, ``reason``; ``conversion`` / ``quantization`` summaries; with
    ``verify=True`` the ``drift`` against the float32 original)."""

    @property
    def fused_layers(self) -> int:
        return sum(layer.fused for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        data = dict(data)
        data["layers"] = [_layer_from_dict(x) for x in data.get("layers", [])]
        data["rules"] = [RuleReport(**x) for x in data.get("rules", [])]
        data["violations"] = [
            Violation(**{**x, "needs": tuple(x["needs"])}) if isinstance(x, dict) else x
            for x in data.get("violations", [])
        ]
        return cls(**data)

    def summary(self) -> str:
        """A readable table for the terminal."""
        lines = [
            f"epfuse: {self.ep} / {self.dtype}: {self.fused_layers} of {len(self.layers)} "
            f"attention layers fused; {self.nodes_before} -> {self.nodes_after} nodes "
            f"in {self.seconds:.2f}s",
        ]
        if self.precision:
            p = self.precision
            lines.append(f"precision: {p.get('chosen')} ({p.get('reason')})")
            for key in ("conversion", "quantization", "kv_cache", "drift"):
                if p.get(key):
                    value = p[key]
                    text = value if isinstance(value, str) else value.get("summary", str(value))
                    lines.append(f"  {key}: {text}")
        lines += ["", f"{'layer':>5}  {'result':<36}  details"]
        for layer in self.layers:
            noted = {part for note in layer.notes for part in note.split("; ")}
            # A part a fused layer kept outside is in its note and its reasons: shown once.
            details = "; ".join(layer.notes + [r for r in layer.reasons if r not in noted])
            details = details or "-"
            lines.append(f"{layer.layer:>5}  {layer.result:<36}  {details}")
        ran = [r for r in self.rules if r.rewritten or r.kept]
        skipped = [r for r in self.rules if not r.selected]
        # One column as wide as the longest listed rule name, so every outcome lines up.
        width = max((len(r.name) for r in ran + skipped), default=0)
        if ran:
            lines += ["", "rules:"]
            for r in ran:
                lines.append(
                    f"  {r.stage:<12} {r.name:<{width}}  rewrote {r.rewritten}, kept {r.kept}"
                )
        for r in skipped:
            lines.append(
                f"  {r.stage:<12} {r.name:<{width}}  not selected: {r.not_selected_because}"
            )
        if self.verification:
            lines += ["", f"verification: {self.verification}"]
        if self.warnings:
            lines += ["", "warnings:"]
            lines += [f"  - {w}" for w in self.warnings]
        if self.assumptions:
            lines += ["", "the optimized model assumes:"]
            lines += [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)
