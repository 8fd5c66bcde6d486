"""Schema check: does the installed ONNX Runtime know every op, input and attribute a
capability emits (``emissions.EMISSIONS``), with the dtype in the op's type constraint?

A record that promises what this ORT cannot even load is wrong; ``probe`` reports it.
"""

from __future__ import annotations

import functools

import onnxruntime as ort

from .emissions import EMISSIONS, Capability

_TYPE_NAMES = {
    "float32": "tensor(float)",
    "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)",
}


@functools.cache
def _schemas() -> dict[tuple[str, str], object]:
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    latest: dict[tuple[str, str], object] = {}
    for schema in get_all_operator_schema():
        key = (schema.domain, schema.name)
        if key not in latest or schema.since_version > latest[key].since_version:
            latest[key] = schema
    return latest


def schema_mismatches(flag: Capability | str, dtype: str) -> list[str]:
    """Why ``flag``'s emissions for ``dtype`` are not in the installed ORT schema set."""
    problems = []
    for e in EMISSIONS.get(Capability(flag), ()):
        schema = _schemas().get((e.domain, e.op_type))
        name = f"{e.domain or 'ai.onnx'}::{e.op_type}"
        if schema is None:
            problems.append(f"{flag}: {name} is not an op of onnxruntime {ort.__version__}")
            continue
        for index, expected in e.inputs:
            got = schema.inputs[index].name if index < len(schema.inputs) else None
            if got != expected:
                problems.append(f"{flag}: {name} input {index} is {got!r}, not {expected!r}")
        for index, expected in e.outputs:
            got = schema.outputs[index].name if index < len(schema.outputs) else None
            if got != expected:
                problems.append(f"{flag}: {name} output {index} is {got!r}, not {expected!r}")
        missing = [a for a in e.attributes if a not in schema.attributes]
        if missing:
            problems.append(f"{flag}: {name} has no attribute(s) {missing}")
        first = schema.type_constraints[0] if schema.type_constraints else None
        if first is not None and _TYPE_NAMES[dtype] not in first.allowed_type_strs:
            problems.append(f"{flag}: {name} does not take {dtype}")
    return problems
