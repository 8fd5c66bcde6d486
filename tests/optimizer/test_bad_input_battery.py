"""The bad-input battery: every user mistake and hostile file layout we know of, run through
the real ``epfuse`` command (a subprocess each, as a user would), on a few shared tiny models.

For every case it asserts what the issue asks of all of them: no traceback on stderr, no exit 3
for a user mistake, no input file (nor its external data) modified, no ``.epfuse-*`` temporary
entry and no partial output left behind. The module-level test at the end re-checks the whole
battery's totals. Kept fast: each case is one start-up plus at most one optimization of the
bundled 2-layer example.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from external_data import symlinked_data_model, with_external_data
from onnx import TensorProto, helper

import epfuse
from epfuse.examples import EXAMPLE_MODEL

ROOT = Path(__file__).resolve().parents[2]
TOTALS = {"cases": 0, "tracebacks": 0, "exit3": 0, "modified": 0, "leftovers": 0}


def _hash_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The shared inputs, made once: never written by any case (hashed before and after)."""
    d = tmp_path_factory.mktemp("inputs")
    shutil.copy(EXAMPLE_MODEL, d / "tiny.onnx")
    proto = onnx.load(str(EXAMPLE_MODEL))
    # a.onnx reads b.onnx.data: the name `-o b.onnx` would give its own data.
    onnx.save(proto, str(d / "a.onnx"), save_as_external_data=True, location="b.onnx.data")
    # Every initializer external, small shape constants included.
    with_external_data(EXAMPLE_MODEL, d / "t0.onnx", "t0.onnx.data", size_threshold=0)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), d / "mlp.onnx")
    future = onnx.load(str(EXAMPLE_MODEL))
    for opset in future.opset_import:
        if opset.domain == "":
            opset.version = 9999
    onnx.save(future, str(d / "op9999.onnx"))
    # An already optimized CPU model (GQA, SkipSimplifiedLayerNormalization).
    optimized = epfuse.optimize(onnx.load(str(EXAMPLE_MODEL)), "cpu")
    onnx.save(optimized, str(d / "tiny.cpu.onnx"))
    # External data through a symlinked folder pointing outside the model's folder.
    symlinked_data_model(EXAMPLE_MODEL, tmp_path_factory.mktemp("outside"), d / "linked")
    # Hugging Face folders: right, wrong architecture, empty, not JSON.
    gqa = next(n for n in optimized.graph.node if n.op_type == "GroupQueryAttention")
    heads = next(a.i for a in gqa.attribute if a.name == "num_heads")
    kv_heads = next(a.i for a in gqa.attribute if a.name == "kv_num_heads")
    good = {"model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    good |= {"num_hidden_layers": 2, "max_position_embeddings": 64}
    for name, config in {
        "hf_good": json.dumps(good),
        "hf_wrong": json.dumps(good | {"model_type": "gemma2", "num_hidden_layers": 26}),
        "hf_empty": "{}",
        "hf_notjson": "this is { not json",
    }.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(config)
    return d


@pytest.fixture(scope="module")
def input_hashes(inputs):
    return _hash_tree(inputs)


def _leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".epfuse*")]


def _epfuse(args, cwd, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "epfuse.optimizer.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kwargs,
    )


@pytest.fixture
def case(inputs, input_hashes, tmp_path):
    """One CLI case run in the test's folder against the battery's inputs (see ``_case``)."""
    return functools.partial(_case, inputs, input_hashes, tmp_path)


def _case(
    inputs: Path,
    input_hashes,
    work: Path,
    args: list[str],
    *,
    rc: int,
    err: str | None = None,
    copy: tuple[str, ...] = (),
    expect_files: set[str] | None = None,
):
    """Run one CLI case in ``work`` (with ``copy`` copied from the inputs) and check the
    battery's invariants; return the completed process."""
    work.mkdir(exist_ok=True)
    for name in copy:
        shutil.copy(inputs / name, work / name)
    before = _hash_tree(work)
    entries = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    done = _epfuse([a.replace("@", str(inputs) + "/") for a in args], work)
    TOTALS["cases"] += 1
    stderr = done.stderr
    TOTALS["tracebacks"] += "Traceback" in stderr
    TOTALS["exit3"] += done.returncode == 3
    after_hashes = _hash_tree(work)
    changed = [k for k, v in before.items() if after_hashes.get(k) != v]
    changed_inputs = _hash_tree(inputs) != input_hashes
    TOTALS["modified"] += bool(changed) or changed_inputs
    left = _leftovers(work) + _leftovers(inputs)
    TOTALS["leftovers"] += bool(left)
    assert "Traceback" not in stderr, stderr
    assert done.returncode == rc, (done.returncode, stderr, done.stdout[-500:])
    assert not changed and not changed_inputs, changed
    assert not left, left
    if rc == 1:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("epfuse: error: "), stderr
    if err is not None:
        assert err in stderr, stderr
    if rc != 0:
        # Nothing written: the folder holds exactly what the case put there.
        after = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
        assert after == entries, after
    if expect_files is not None:
        assert {p.name for p in work.iterdir()} == expect_files
    return done


# ----------------------------------------------------------------------------- data loss


def test_report_path_is_input_output_or_data(case):
    run = lambda args, err, copy=(): case(args, rc=1, err=err, copy=copy)  # noqa: E731
    run(
        ["optimize", "tiny.onnx", "-o", "o.onnx", "--report", "tiny.onnx"],
        "cannot write tiny.onnx: refusing to overwrite the input model",
        copy=("tiny.onnx",),
    )
    run(
        ["optimize", "@tiny.onnx", "-o", "o.onnx", "--report", "o.onnx"],
        "cannot write o.onnx: it is the optimized model's path",
    )
    run(
        ["optimize", "@a.onnx", "-o", "o.onnx", "--report", "@b.onnx.data"],
        "the input model reads its weights from it",
    )


def test_output_data_never_overwrites_input_data(case, tmp_path):
    done = case(
        ["optimize", "a.onnx", "-o", "b.onnx"],
        rc=0,
        copy=("a.onnx", "b.onnx.data"),
    )
    assert "wrote b.onnx" in done.stdout
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"a.onnx", "b.onnx.data", "b.onnx", "b.onnx.epfuse.data"}
    # The input still loads and the output reads its own data.
    onnx.checker.check_model(str(tmp_path / "a.onnx"))
    out = onnx.load(str(tmp_path / "b.onnx"), load_external_data=False)
    locations = {
        e.value for t in out.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"b.onnx.epfuse.data"}
    case(
        ["optimize", "a.onnx", "-o", "b.onnx.data"],
        rc=1,
        err="cannot write b.onnx.data: the input model reads its weights from it",
    )


def test_failed_report_write_leaves_nothing(case):
    case(
        ["optimize", "@tiny.onnx", "-o", "out.onnx", "--report", "no/such/r.json"],
        rc=1,
        err="cannot write no/such/r.json: no such directory no/such",
    )


def test_stale_temp_entries_are_cleaned(inputs, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".epfuse-tmp-{dead.pid}-abcd1234"
    stale.mkdir(parents=True)
    (stale / "out.onnx.data").write_bytes(b"\0" * 1000)
    live = tmp_path / f".epfuse-tmp-{os.getpid()}-live"
    live.mkdir()
    done = _epfuse(["optimize", str(inputs / "tiny.onnx"), "-o", "out.onnx"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert not stale.exists()  # its writer is gone
    assert live.exists()  # a running writer's entry is left alone
    live.rmdir()


def _wait_for_startup(proc: subprocess.Popen) -> None:
    """Until the process is importing onnx (inside main, after the handlers are in place)."""
    deadline = time.monotonic() + 60
    maps = Path(f"/proc/{proc.pid}/maps")
    while time.monotonic() < deadline:
        try:
            if "onnx_cpp2py_export" in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.005)
    raise AssertionError("the process never started importing onnx")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    ("sig", "rc", "line"),
    [(signal.SIGINT, 130, "epfuse: interrupted"), (signal.SIGTERM, 143, "epfuse: terminated")],
)
def test_signal_during_startup_is_one_line(inputs, input_hashes, tmp_path, sig, rc, line):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epfuse.optimizer.cli",
            "optimize",
            str(inputs / "tiny.onnx"),
            "-o",
            "out.onnx",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_startup(proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    TOTALS["cases"] += 1
    TOTALS["tracebacks"] += "Traceback" in stderr
    assert proc.returncode == rc, stderr
    assert stderr.strip() == line
    assert list(tmp_path.iterdir()) == []
    assert _hash_tree(inputs) == input_hashes


# -------------------------------------------------------------------- wrong results as fine


def test_all_external_small_constants_fuse_like_inline(case):
    done = case(["optimize", "@t0.onnx", "-o", "o.onnx"], rc=0)
    assert "2 of 2 attention layers fused" in done.stdout
    assert done.stderr == ""  # no logged shape-inference traceback


@pytest.mark.parametrize("ep", ["default", "dml"])
def test_retarget_optimized_model_is_refused(case, ep):
    done = case(
        ["optimize", "@tiny.cpu.onnx", "-o", "o.onnx", "--ep", ep, "--report", "r.json"],
        rc=1,
        err=f"{ep} does not run com.microsoft::GroupQueryAttention",
    )
    assert f"epfuse: error: cannot re-target this model to {ep} (" in done.stderr


def test_hf_config_checked_against_graph(case, tmp_path):
    base = ["optimize", "@tiny.onnx", "-o", "pkg", "--genai", "--hf-config"]
    case(
        [*base, "@hf_wrong"],
        rc=1,
        err="does not describe this model: num_hidden_layers 26 (the graph has 2)",
    )
    case([*base, "@hf_empty"], rc=1, err="describes no decoder")
    case([*base, "@hf_notjson"], rc=1, err="not a JSON file")
    done = case([*base, "@hf_good"], rc=0)
    config = json.loads((tmp_path / "pkg" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == 2
    # --max-seq-len 4096 is above the config's max_position_embeddings 64: warned.
    assert "epfuse: warning: max_seq_len 4096 is above the model's own maximum position 64" in (
        done.stderr
    )


# -------------------------------------------------------------------------------- errors


def test_unwritable_outputs_are_user_errors(case, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    for args, err in [
        (["-o", "/proc/x.onnx"], "cannot write /proc/x.onnx: cannot create files in /proc"),
        (["-o", "adir"], "cannot write adir: is a directory"),
        (["-o", "afile/x.onnx"], "cannot write afile/x.onnx: afile is not a directory"),
        (["-o", "o.onnx", "--report", "missing/r.json"], "no such directory missing"),
    ]:
        case(["optimize", "@tiny.onnx", *args], rc=1, err=err)


def test_symlinked_external_data_folder_is_refused(case):
    case(
        ["optimize", "@linked/s.onnx", "-o", "o.onnx"],
        rc=1,
        err="lies outside the model's folder",
    )


def test_max_seq_len_validated(case):
    for value in ["2.5", "0"]:  # (the parser's type: more values in test_cli)
        done = case(
            ["optimize", "@tiny.onnx", "-o", "o.onnx", "--max-seq-len", value],
            rc=2,
        )
        assert f"expected a positive integer, got '{value}'" in done.stderr
    case(
        ["optimize", "@tiny.onnx", "-o", "o.onnx", "--max-seq-len", "99999999999"],
        rc=1,
        err="is above 2147483647",
    )
    case(
        ["optimize", "@tiny.onnx", "-o", "o.onnx", "--max-seq-len", "2000000000"],
        rc=1,
        err="the limit here is",
    )


def test_verify_cannot_compare_is_exit_1_both_ways(case):
    for pair in (["@tiny.onnx", "@mlp.onnx"], ["@mlp.onnx", "@tiny.onnx"]):
        case(["verify", *pair], rc=1, err="cannot compare")


def test_usage_debug_and_paths(case, tmp_path):
    done = case([], rc=2)
    assert "usage: epfuse" in done.stderr
    # --debug before the subcommand is honoured: an internal error would now raise; a user
    # error stays one line.
    done = case(
        ["--debug", "optimize", "@op9999.onnx", "-o", "o.onnx"],
        rc=1,
        err="input opset 9999 unsupported",
    )
    done = case(["optimize", "@tiny.onnx", "-o", "newdir/"], rc=0)
    assert (tmp_path / "newdir" / "tiny.cpu.onnx").is_file()


def test_debug_position_is_honoured():
    from epfuse.optimizer.cli import _parser

    for argv in (["--debug", "optimize", "x"], ["optimize", "x", "--debug"]):
        assert _parser().parse_args(argv).debug is True
    assert _parser().parse_args(["optimize", "x"]).debug is False


def test_battery_totals():
    """The issue's measure, over every case above that ran in this session."""
    assert TOTALS["cases"] > 0
    assert (TOTALS["tracebacks"], TOTALS["exit3"], TOTALS["modified"], TOTALS["leftovers"]) == (
        0,
        0,
        0,
        0,
    )
    print(f"\nbad-input battery: {TOTALS}")
