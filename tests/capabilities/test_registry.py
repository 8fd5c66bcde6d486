import dataclasses

import pytest

import epfuse
from epfuse.capabilities import DTYPES, EPCapabilities, OpSupport, all_eps, get_ep, known_eps
from epfuse.capabilities.registry import register_ep

NINE = ["cpu", "cuda", "dml", "webgpu", "trt-rtx", "qnn", "openvino", "coreml", "default"]


def test_all_nine_eps_are_registered():
    assert known_eps()[: len(NINE)] == NINE


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("cuda", "cuda"),
        ("CUDAExecutionProvider", "cuda"),
        ("CPUExecutionProvider", "cpu"),
        ("DmlExecutionProvider", "dml"),
        ("WebGpuExecutionProvider", "webgpu"),
        ("NvTensorRTRTXExecutionProvider", "trt-rtx"),
        ("trt_rtx", "trt-rtx"),
        (" QNN ", "qnn"),
    ],
)
def test_aliases_resolve(alias, name):
    assert get_ep(alias).name == name


def test_unknown_ep_lists_known_ones():
    with pytest.raises(ValueError, match="known: cpu, cuda"):
        get_ep("tpu")
    with pytest.raises(epfuse.UnknownEPError):
        get_ep("tpu")


def test_records_are_frozen():
    record = get_ep("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.name = "x"
    with pytest.raises(TypeError):
        record.dtypes["bfloat16"] = OpSupport()


def test_facts_file_limits():
    cpu, cuda = get_ep("cpu"), get_ep("cuda")
    assert cpu.ops("float32").gqa is not None
    assert cpu.ops("float16").gqa is not None
    assert cpu.ops("bfloat16").gqa is None
    assert cpu.ops("float32").gqa.rotary_head_size_multiple == 16
    assert cuda.ops("float32").gqa is None
    assert cuda.ops("float16").gqa.qk_norm
    assert not get_ep("dml").ops("float16").gqa.fused_rotary
    assert not get_ep("webgpu").ops("float32").gqa.rotary_position_ids
    qnn = get_ep("qnn").ops("float16").gqa
    assert not (qnn.softcap or qnn.local_window or qnn.interleaved_rotary or qnn.attention_bias)
    assert not get_ep("trt-rtx").ops("float16").attention_softcap
    assert all(get_ep("coreml").ops(d).gqa is None for d in DTYPES)


def test_default_ep_never_allows_vendor_ops():
    record = get_ep("default")
    assert not record.vendor_ops
    for dtype in DTYPES:
        ops = record.ops(dtype)
        assert ops.gqa is None and not ops.ms_rotary_embedding and not ops.skip_layer_norm


def test_vendor_ops_flag_is_enforced():
    with pytest.raises(ValueError, match="vendor op"):
        EPCapabilities(
            "x",
            None,
            "x",
            {"float32": OpSupport(gqa=get_ep("cpu").ops("float32").gqa)},
            vendor_ops=False,
        )


def test_register_third_party_ep():
    record = EPCapabilities(
        name="acme-npu",
        provider="AcmeExecutionProvider",
        description="test",
        dtypes={"float16": OpSupport(attention=True)},
    )
    try:
        register_ep(record, aliases=("acme",))
        assert get_ep("AcmeExecutionProvider") is record
        assert get_ep("acme") is record
        with pytest.raises(ValueError, match="already registered"):
            register_ep(record)
    finally:
        from epfuse.capabilities import registry

        registry._RECORDS.pop("acme-npu", None)
        for alias in ("acme-npu", "acme", "acmeexecutionprovider"):
            registry._ALIASES.pop(alias, None)
    assert "acme-npu" not in [r.name for r in all_eps()]


def test_variant_changes_every_dtype_and_keeps_the_rest():
    cpu = get_ep("cpu")
    no_sink = cpu.variant("cpu-no-sink", gqa={"head_sink": False}, moe=False)
    assert no_sink.name == "cpu-no-sink" and set(no_sink.dtypes) == set(cpu.dtypes)
    for dtype, ops in no_sink.dtypes.items():
        assert ops.gqa.head_sink is False and ops.moe is False
        assert ops.gqa.kv_cache_int8 == cpu.ops(dtype).gqa.kv_cache_int8
        assert ops.rotary_embedding == cpu.ops(dtype).rotary_embedding
    assert cpu.ops("float32").gqa.head_sink is True  # the original record is untouched
