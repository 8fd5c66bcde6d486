"""The emission table is the one map of capabilities: every record switch is a member, and
conformance, the schema check and the known-answer runs cover every member."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import pytest

from epfuse.capabilities import GQASupport, OpSupport
from epfuse.capabilities.conformance import required_flags
from epfuse.capabilities.emissions import EMISSIONS, Capability
from epfuse.capabilities.known_answers import KNOWN_ANSWERS, NOT_RUN


def _switches() -> set[str]:
    # A cost choice between two emissions, not one itself.
    ops = {f.name for f in dataclasses.fields(OpSupport)} - {"experts_loop_min_decode_weights"}
    gqa = {f"gqa.{f.name}" for f in dataclasses.fields(GQASupport) if f.type in ("bool", bool)}
    # Not capabilities: constraints on how the kernel is called, read where the rules build it.
    gqa -= {"gqa.chunked_prefill_needs_batch1", "gqa.requires_rotary_caches"}
    return ops | gqa


def test_every_record_switch_is_a_member():
    assert {c.value for c in Capability} == _switches()


@pytest.mark.parametrize("cap", list(Capability))
def test_member_reads_its_own_field(cap):
    """``supported_by`` reads exactly the field ``field`` names (the probe writes that one)."""
    base = OpSupport(gqa=GQASupport())
    if cap is Capability.GQA:
        assert cap.supported_by(base) and not cap.supported_by(OpSupport())
        return
    for value in (True, False):
        if cap.on_gqa:
            ops = dataclasses.replace(base, gqa=dataclasses.replace(base.gqa, **{cap.field: value}))
            assert not cap.supported_by(OpSupport())  # no GQA at all: no GQA feature
        else:
            ops = dataclasses.replace(base, **{cap.field: value})
        assert cap.supported_by(ops) is value
    assert cap.lacking("x").startswith("x") and cap.lacking("x").endswith(" for this dtype")


def test_probe_covers_every_member():
    assert set(EMISSIONS) == set(Capability)
    assert set(KNOWN_ANSWERS) | set(NOT_RUN) == set(Capability)
    assert not set(KNOWN_ANSWERS) & set(NOT_RUN)


def _node(op: str, inputs: list[str], domain: str = "", **attrs) -> ir.Node:
    values = [ir.Value(name=name) if name else None for name in inputs]
    return ir.node(op, values, attributes=attrs, domain=domain)


def _gqa_node(**attrs) -> ir.Node:
    inputs = ["q", "k", "v", "pk", "pv", "s", "t", "cos", "sin", "pos", "bias", "sink", "", ""]
    inputs += ["wq", "wk"]
    return _node("GroupQueryAttention", inputs, "com.microsoft", **attrs)


def test_conformance_covers_every_member():
    """Each member is needed by some node ``required_flags`` can see."""
    nodes = [
        _gqa_node(
            do_rotary=1,
            rotary_interleaved=1,
            softcap=2.0,
            local_window_size=4,
            k_quant_type="PER_CHANNEL",
        ),
        _node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "s", "t"], "com.microsoft"),
        _node("Attention", ["q", "k", "v"], softcap=2.0),
    ]
    nodes += [
        _node(op, ["x"], domain)
        for domain, op in {(e.domain, e.op_type) for es in EMISSIONS.values() for e in es}
        | {("com.microsoft", "GatherBlockQuantized")}
    ]
    needed = {flag for node in nodes for flag in required_flags(node) or ()}
    assert needed == set(Capability)
