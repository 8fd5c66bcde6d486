"""Which precision ``auto`` picks per EP record, and what is refused."""

import pytest

from epfuse.capabilities import get_ep
from epfuse.errors import UnsupportedModelError
from epfuse.optimizer.precision import Int4Options, choose, normalize


@pytest.mark.parametrize(
    ("ep", "expected"),
    [
        ("cpu", "float32"),
        ("cuda", "float16"),
        ("dml", "float16"),
        ("webgpu", "float16"),
        ("trt-rtx", "float16"),
        ("qnn", "float32"),
        ("default", "float32"),
    ],
)
def test_auto_follows_the_record(ep, expected):
    plan = choose("auto", get_ep(ep), "float32")
    assert plan.compute_dtype == expected
    assert plan.int4 is None
    assert plan.reason.startswith("auto: ")
    assert plan.converts == (expected != "float32")


def test_auto_never_converts_a_low_precision_export():
    plan = choose("auto", get_ep("cuda"), "bfloat16")
    assert plan.compute_dtype == "bfloat16" and not plan.converts


def test_explicit_wins_and_aliases():
    assert choose("fp32", get_ep("cuda"), "float32").compute_dtype == "float32"
    assert choose("float16", get_ep("cpu"), "float32").compute_dtype == "float16"
    assert choose("BF16", get_ep("cuda"), "float32").compute_dtype == "bfloat16"
    assert normalize("bfloat16") == "bf16"


def test_int4_takes_the_auto_activation_dtype():
    cpu = choose("int4", get_ep("cpu"), "float32")
    assert (cpu.compute_dtype, cpu.name, cpu.int4) == ("float32", "int4", Int4Options())
    cuda = choose("int4", get_ep("cuda"), "float32", Int4Options(block_size=128))
    assert cuda.compute_dtype == "float16" and cuda.int4.block_size == 128
    assert cuda.to_dict()["int4"]["block_size"] == 128


def test_refusals():
    with pytest.raises(ValueError, match="unknown precision"):
        normalize("fp8")
    with pytest.raises(UnsupportedModelError, match="float32 exports only"):
        choose("fp32", get_ep("cpu"), "float16")
    with pytest.raises(UnsupportedModelError, match="no MatMulNBits"):
        choose("int4", get_ep("qnn"), "float32")
    with pytest.raises(ValueError, match="precision is not int4"):
        choose("fp16", get_ep("cpu"), "float32", Int4Options())
    with pytest.raises(ValueError, match="power of two"):
        Int4Options(block_size=48)
    with pytest.raises(ValueError, match="accuracy level"):
        Int4Options(accuracy_level=7)
