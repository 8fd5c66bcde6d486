"""The CLI, run in-process through ``main`` and once as a real console script."""

import json
import shutil
import subprocess
import sys

import onnx
import pytest

from epfuse.optimizer.cli import main


def test_optimize_bundled_example_default_output(capsys):
    assert main(["optimize"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 attention layers fused" in out
    assert out.count("GroupQueryAttention(do_rotary=1)") == 2
    written = out.strip().splitlines()[-1].removeprefix("wrote ").strip()
    model = onnx.load(written)
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph.node) == 2
    shutil.rmtree(written.rsplit("/", 1)[0])


def test_optimize_with_output_and_report(tmp_path, example_model, capsys):
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    before = example_model.read_bytes()
    rc = main(
        [
            "optimize",
            str(example_model),
            "-o",
            str(out),
            "--ep",
            "CPUExecutionProvider",
            "--report",
            str(report),
        ]
    )
    assert rc == 0
    data = json.loads(report.read_text())
    assert data["ep"] == "cpu" and len(data["layers"]) == 2
    assert all(layer["fused"] for layer in data["layers"])
    stored = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(stored["epfuse.report"])["ep"] == "cpu"
    assert example_model.read_bytes() == before  # input untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx", "r.json"]  # no temp left


def test_cuda_fp32_keeps_attention_and_says_why(tmp_path, example_model, capsys):
    out_path = str(tmp_path / "o.onnx")
    argv = ["optimize", str(example_model), "-o", out_path, "--ep", "cuda", "--precision", "fp32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0 of 2 attention layers fused" in out
    assert "cuda has no GroupQueryAttention" in out


def test_cuda_default_precision_is_fp16_gqa(tmp_path, example_model, capsys):
    out_path = tmp_path / "o.onnx"
    assert main(["optimize", str(example_model), "-o", str(out_path), "--ep", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "cuda / float16: 2 of 2 attention layers fused" in out
    assert "precision: float16 (auto: cuda prefers float16" in out
    model = onnx.load(str(out_path))
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph.node) == 2


def test_int4_cli_options(tmp_path, example_model, capsys):
    out_path = tmp_path / "o.onnx"
    argv = ["optimize", str(example_model), "-o", str(out_path), "--precision", "int4"]
    argv += ["--int4-block-size", "16", "--int4-asymmetric", "--int4-no-lm-head"]
    assert main(argv) == 0
    assert "int4: " in capsys.readouterr().out
    model = onnx.load(str(out_path))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) == 4 for n in nbits)
    assert [n.output[0] for n in model.graph.node if n.op_type == "MatMul"] == ["logits"]


@pytest.mark.parametrize(("precision", "reference"), [("fp16", "float16"), ("int4", "int4")])
def test_low_precision_verify_end_to_end(tmp_path, example_model, capsys, precision, reference):
    """fp16 and int4 outputs pass --verify against their same-precision unfused reference."""
    out_path = tmp_path / "o.onnx"
    argv = ["optimize", str(example_model), "-o", str(out_path), "--precision", precision]
    assert main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 attention layers fused" in out
    assert "verification: passed (scenarios prompt, decode, chunk, padded" in out
    assert f"reference: the unfused model at {reference}" in out
    assert "drift: vs the float32 original" in out
    stored = {p.key: p.value for p in onnx.load(str(out_path)).metadata_props}
    assert json.loads(stored["epfuse.report"])["verification"].startswith("passed")


def test_kv_cache_int8_verify(tmp_path, example_model, capsys):
    out_path = tmp_path / "o.onnx"
    argv = ["optimize", str(example_model), "-o", str(out_path), "--kv-cache", "int8"]
    assert main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "kv_cache: int8 KV cache on 2 layer(s)" in out
    assert "int8 KV cache within the kv-int8 tolerance" in out
    model = onnx.load(str(out_path))
    past = [v for v in model.graph.input if "past" in v.name]
    assert {v.type.tensor_type.elem_type for v in past} == {onnx.TensorProto.INT8}


def test_kv_cache_int8_on_an_ep_without_it_is_one_line(tmp_path, example_model, capsys):
    argv = ["optimize", str(example_model), "-o", str(tmp_path / "o.onnx"), "--ep", "cuda"]
    err = _bad(tmp_path, capsys, [*argv, "--kv-cache", "int8"])
    assert "kv_cache int8: cuda's record takes no int8 KV cache for float16" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-cache", "int4"], "--kv-cache: unknown kv_cache 'int4'"),
        (["--precision", "fp8"], "--precision: unknown precision 'fp8'"),
        (["--int4-block-size", "64"], "--int4-* options need --precision int4"),
        (["--precision", "int4", "--int4-block-size", "48"], "power of two"),
        (["--precision", "int4", "--int4-accuracy-level", "9"], "accuracy level"),
    ],
)
def test_bad_precision_is_a_one_line_usage_error(tmp_path, example_model, capsys, extra, message):
    before = sorted(tmp_path.iterdir())
    rc = main(["optimize", str(example_model), "-o", str(tmp_path / "o.onnx"), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("epfuse: usage error: ") and err.count("\n") == 1, err
    assert message in err
    assert sorted(tmp_path.iterdir()) == before


def _bad(tmp_path, capsys, argv):
    before = sorted(tmp_path.iterdir())
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert err.startswith("epfuse: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before  # no output written
    return err


def test_missing_file(tmp_path, capsys):
    err = _bad(
        tmp_path, capsys, ["optimize", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "o.onnx")]
    )
    assert "no such file" in err


def test_not_onnx(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_text("this is not a model")
    assert "not an ONNX model" in _bad(
        tmp_path, capsys, ["optimize", str(bad), "-o", str(tmp_path / "o.onnx")]
    )


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_truncated(tmp_path, capsys, example_model, keep):
    data = example_model.read_bytes()
    bad = tmp_path / "trunc.onnx"
    bad.write_bytes(data[: int(len(data) * keep)])
    _bad(tmp_path, capsys, ["optimize", str(bad), "-o", str(tmp_path / "o.onnx")])


def test_unknown_ep(tmp_path, capsys, example_model):
    err = _bad(
        tmp_path,
        capsys,
        ["optimize", str(example_model), "-o", str(tmp_path / "o.onnx"), "--ep", "tpu"],
    )
    assert "unknown execution provider 'tpu'" in err


def _relu_model(path, elem) -> str:
    """A model with no attention: one Relu over a (1, 4) tensor of type ``elem``."""
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, [1, 4])],
        [helper.make_tensor_value_info("y", elem, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), str(path))
    return str(path)


@pytest.mark.parametrize(
    ("elem", "error"),
    [(onnx.TensorProto.FLOAT, "no attention"), (onnx.TensorProto.DOUBLE, "unsupported dtype")],
    ids=["no-attention", "float64"],
)
def test_model_the_optimizer_cannot_take(tmp_path, capsys, elem, error):
    path = _relu_model(tmp_path / "relu.onnx", elem)
    assert error in _bad(tmp_path, capsys, ["optimize", path, "-o", str(tmp_path / "o.onnx")])


def test_refuses_to_overwrite_input(tmp_path, capsys, example_model):
    copy = tmp_path / "m.onnx"
    shutil.copy(example_model, copy)
    before = copy.read_bytes()
    rc = main(["optimize", str(copy), "-o", str(copy)])
    assert rc != 0 and "overwrite the input" in capsys.readouterr().err
    assert copy.read_bytes() == before


def test_capabilities_table(capsys):
    assert main(["capabilities"]) == 0
    out = capsys.readouterr().out
    for name in ["cpu", "cuda", "dml", "webgpu", "trt-rtx", "qnn", "openvino", "coreml", "default"]:
        assert f"\n{name}: " in out
    assert "KV-int8" in out.splitlines()[0]
    cpu_rows = [line.split() for line in out.splitlines() if line.startswith("cpu ")]
    header = out.splitlines()[0].split()
    kv = header.index("KV-int8")
    assert {row[1]: row[kv] for row in cpu_rows} == {
        "float32": "yes",
        "float16": "yes",
        "bfloat16": "-",
    }
    assert main(["capabilities", "--ep", "DmlExecutionProvider"]) == 0
    assert "dml" in capsys.readouterr().out


def test_console_script_runs():
    exe = shutil.which("epfuse")
    cmd = [exe] if exe else [sys.executable, "-m", "epfuse.optimizer.cli"]
    done = subprocess.run(
        [*cmd, "capabilities", "--ep", "cpu"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and "CPUExecutionProvider" in done.stdout
