"""Check the capability records against the installed ONNX Runtime: the probe runner.

Two checks, per record and dtype, over every member of ``emissions.Capability``:

1. **Schema** (``capabilities.schema``): every op, input and attribute epfuse may emit for a
   capability the record turns on exists in the installed ORT's schema set, with the dtype in
   the op's type constraint.
2. **Known answers** (``capabilities.known_answers``; only for EPs present in the installed
   build, here the CPU EP): a tiny model per fused op and feature runs on the EP alone and is
   compared with a float64 numpy reference. A capability the record turns on that fails, or
   one it turns off that passes, is a mismatch.

:func:`probed_record` derives a record that trusts the probe over the static data
(``dataclasses.replace``); ``epfuse.optimize(..., probe=True)`` uses it.
"""

from __future__ import annotations

import dataclasses

import onnxruntime as ort

from .emissions import EMISSIONS, Capability, Emission
from .known_answers import _NP, KNOWN_ANSWERS, known_answer
from .records import DTYPES, EPCapabilities, GQASupport, OpSupport
from .schema import schema_mismatches


@dataclasses.dataclass
class ProbeReport:
    ep: str
    installed: bool
    schema: list[str] = dataclasses.field(default_factory=list)
    """Schema mismatches of flags the record turns on."""
    observed: dict[tuple[str, str], bool] = dataclasses.field(default_factory=dict)
    """(dtype, flag) -> known-answer outcome, for the EP present in this build."""
    mismatches: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        if self.installed:
            head = f"{self.ep}: schema checked; {len(self.observed)} known-answer runs"
        else:
            head = f"{self.ep}: schema checked only (its EP is not in this onnxruntime build)"
        lines = [head]
        lines += [f"  mismatch: {m}" for m in self.mismatches] or ["  record agrees"]
        return "\n".join(lines)


def probe(record: EPCapabilities) -> ProbeReport:
    installed = record.provider is not None and record.provider in ort.get_available_providers()
    report = ProbeReport(record.name, installed)
    for dtype in record.dtypes:
        for flag in Capability:
            if flag.supported_by(record.ops(dtype)):
                for problem in schema_mismatches(flag, dtype):
                    report.schema.append(f"{dtype}: {problem}")
                    report.mismatches.append(f"{dtype} {problem}")
    if installed:
        for dtype in (d for d in DTYPES if d in _NP and d in record.dtypes):
            for flag in KNOWN_ANSWERS:
                if flag.on_gqa and record.ops(dtype).gqa is None:
                    continue
                why = known_answer(flag, dtype, record.provider)
                report.observed[(dtype, flag)] = why is None
                claimed = flag.supported_by(record.ops(dtype))
                if claimed and why is not None:
                    report.mismatches.append(f"{dtype} {flag}: record says yes, but it {why}")
                elif not claimed and why is None:
                    report.mismatches.append(f"{dtype} {flag}: record says no, but it works")
    return report


def probed_record(record: EPCapabilities, report: ProbeReport | None = None) -> EPCapabilities:
    """``record`` with every capability the probe decided set to the probe's answer."""
    report = report or probe(record)
    bad_schema = {line.split(":")[1].strip() for line in report.schema}
    dtypes = {}
    for dtype, ops in record.dtypes.items():
        updates: dict[str, object] = {}
        gqa_updates: dict[str, bool] = {}
        for flag in Capability:
            value = report.observed.get((dtype, flag))
            if flag in bad_schema:
                value = False
            if value is None:
                continue
            if flag.on_gqa:
                gqa_updates[flag.field] = value
            elif flag is not Capability.GQA:
                updates[flag.field] = value
        gqa = ops.gqa
        gqa_seen = report.observed.get((dtype, Capability.GQA))
        if gqa_seen is False or Capability.GQA in bad_schema:
            gqa = None
        elif gqa is not None and gqa_updates:
            gqa = dataclasses.replace(gqa, **gqa_updates)
        elif gqa is None and gqa_seen:
            gqa = dataclasses.replace(GQASupport(), **gqa_updates)
        dtypes[dtype] = dataclasses.replace(ops, gqa=gqa, **updates)
    return dataclasses.replace(record, dtypes=dtypes)


_PROBED: dict[int, tuple[EPCapabilities, EPCapabilities, ProbeReport]] = {}


def cached_probe(record: EPCapabilities) -> tuple[EPCapabilities, ProbeReport]:
    """(probed record, report), computed once per record object in this process."""
    hit = _PROBED.get(id(record))
    if hit is None or hit[0] is not record:
        report = probe(record)
        hit = (record, probed_record(record, report), report)
        _PROBED[id(record)] = hit
    return hit[1], hit[2]


__all__ = [
    "EMISSIONS",
    "KNOWN_ANSWERS",
    "Capability",
    "Emission",
    "OpSupport",
    "ProbeReport",
    "cached_probe",
    "known_answer",
    "probe",
    "probed_record",
    "schema_mismatches",
]
