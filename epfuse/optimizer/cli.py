"""The ``epfuse`` command line.

    epfuse optimize [IN] [-o OUT] [--ep EP] [--precision P] [--report FILE.json]
                    [--kv-cache int8] [--max-seq-len N] [--verify] [--require-fusion]
                    [--genai [--hf-config DIR]]
                    [--int4-block-size N] [--int4-asymmetric] [--int4-accuracy-level N]
                    [--int4-no-lm-head] [--int4-embeddings]
    epfuse verify ORIGINAL OPTIMIZED [--prompt-len N] [--scenario NAME ...] [--seed S]
    epfuse fuzz ORIGINAL OPTIMIZED [--examples N] [--seed S] [--deadline SECONDS] [--max-len L]
    epfuse capabilities [--ep EP] [--probe]

Every failure is one line on stderr and a non-zero exit: 1 for bad input or a model epfuse
cannot handle, 2 for bad usage, 3 for an internal error (``--debug`` shows the traceback),
4 when ``epfuse verify`` or ``epfuse fuzz`` finds the models not equivalent.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epfuse.optimizer.precision import Int4Options

# Only light imports here: onnx and ORT load inside main(), after the signal handlers are in
# place, so that Ctrl-C or SIGTERM during start-up still ends with one line.
from epfuse.errors import EpfuseError

EXIT_INPUT, EXIT_USAGE, EXIT_INTERNAL, EXIT_NOT_EQUIVALENT = 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that every ``finally`` cleans up."""


# While the heavy modules import, a signal is only recorded: an exception raised inside a C
# extension's initialisation can crash the interpreter (seen: SIGSEGV when Ctrl-C hit the
# import of onnx). It is raised as soon as the imports are done.
_startup = {"deferring": False, "pending": None}


def _on_signal(signum, frame):
    if _startup["deferring"]:
        _startup["pending"] = _startup["pending"] or signum
        return
    _raise_for(signum)


def _raise_for(signum: int):
    if signum == signal.SIGTERM:
        raise Terminated
    raise KeyboardInterrupt


@contextlib.contextmanager
def _deferred_signals():
    """Signals during the block are raised after it (see ``_startup``)."""
    _startup["deferring"] = True
    try:
        yield
    finally:
        _startup["deferring"] = False
    pending, _startup["pending"] = _startup["pending"], None
    if pending is not None:
        _raise_for(pending)


def _import_heavy(command: str) -> None:
    """Import what the subcommand needs first, with signals deferred. ``optimize`` checks its
    paths with onnx alone and imports the optimizer (onnx_ir, ORT) after that."""
    with _deferred_signals():
        importlib.import_module("onnx")
        if command != "optimize":
            importlib.import_module("onnx_ir")
            importlib.import_module("onnxruntime")


class UsageError(Exception):
    """A bad combination or value of options: one line on stderr, exit 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, _on_signal)
    try:
        with _deferred_signals():  # building the parser imports verify (onnx, ORT)
            parser = _parser()
        args = parser.parse_args(argv)
        debug = debug or bool(getattr(args, "debug", False))
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        _import_heavy(args.command)
        return args.handler(args)
    except UsageError as err:
        print(f"epfuse: usage error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except EpfuseError as err:
        print(f"epfuse: error: {err}", file=sys.stderr)
        return EXIT_INPUT
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except KeyboardInterrupt:
        print("epfuse: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("epfuse: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as err:
        if debug:
            raise
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(
            f"epfuse: internal error: {type(err).__name__}: {message} (rerun with --debug)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    from epfuse.capabilities import known_eps
    from epfuse.optimizer.precision import PRECISIONS, Int4Options
    from epfuse.optimizer.verify.cli import add_verify_command
    from epfuse.optimizer.verify.fuzz_cli import add_fuzz_command

    parser = argparse.ArgumentParser(
        prog="epfuse",
        description="Rewrite generically exported ONNX language models for an ORT execution provider.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    sub = parser.add_subparsers(dest="command")

    opt = sub.add_parser("optimize", help="optimize a model for one execution provider")
    opt.add_argument("input", nargs="?", help="model to optimize (default: the bundled example)")
    opt.add_argument(
        "-o",
        "--output",
        help="where to write the optimized model (ending in '/': into that folder)",
    )
    opt.add_argument("--ep", default="cpu", help=f"execution provider ({', '.join(known_eps())})")
    opt.add_argument(
        "--precision",
        default="auto",
        metavar="P",
        help=f"{', '.join(PRECISIONS)} (default auto: the dtype the EP's record prefers, e.g. "
        "fp16 for cuda, else the input's; int4: int4 MatMul weights)",
    )
    opt.add_argument(
        "--kv-cache",
        default=None,
        metavar="int8",
        help="int8: GroupQueryAttention past/present in int8 with calibrated per-channel "
        "scales, where the EP's record takes it (cpu); default the compute dtype",
    )
    opt.add_argument("--report", help="also write the report as JSON to this file")
    opt.add_argument(
        "--max-seq-len",
        type=_positive_int,
        default=4096,
        help="rows of the cos/sin caches made from run-time RoPE (default 4096)",
    )
    opt.add_argument(
        "--verify",
        action="store_true",
        help="compare with the original on ORT CPU; roll back layers whose rewrite fails",
    )
    opt.add_argument(
        "--require-fusion",
        action="store_true",
        help="fail (exit 1) unless every attention layer is fused for the EP",
    )
    opt.add_argument(
        "--genai",
        action="store_true",
        help="write an onnxruntime-genai folder (OUT/model.onnx + genai_config.json)",
    )
    opt.add_argument(
        "--hf-config",
        metavar="DIR",
        help="with --genai: Hugging Face folder to read config/generation_config and copy "
        "tokenizer files from",
    )
    defaults = Int4Options()
    int4 = opt.add_argument_group("int4 (with --precision int4; defaults: genai builder, CPU)")
    int4.add_argument(
        "--int4-block-size",
        type=int,
        metavar="N",
        help=f"quantization block size (power of two >= 16, default {defaults.block_size})",
    )
    int4.add_argument(
        "--int4-asymmetric", action="store_true", help="zero points (default symmetric)"
    )
    int4.add_argument(
        "--int4-accuracy-level",
        type=int,
        metavar="N",
        help=f"MatMulNBits accuracy_level 0-4 (default {defaults.accuracy_level}: int8 compute)",
    )
    int4.add_argument("--int4-no-lm-head", action="store_true", help="keep lm_head in float")
    int4.add_argument(
        "--int4-embeddings", action="store_true", help="quantize the embedding table too"
    )
    opt.set_defaults(handler=_optimize)

    add_verify_command(sub)
    add_fuzz_command(sub)

    caps = sub.add_parser("capabilities", help="print what each execution provider supports")
    caps.add_argument("--ep", help="only this execution provider")
    caps.add_argument(
        "--probe",
        action="store_true",
        help="check each record against the installed ONNX Runtime (schemas; known-answer "
        "runs for EPs in this build) and print mismatches",
    )
    caps.set_defaults(handler=_capabilities)
    for command in (opt, caps):
        # SUPPRESS: a subcommand that does not see --debug leaves the top-level value alone
        # (`epfuse --debug optimize ...` and `epfuse optimize ... --debug` both count);
        # verify and fuzz add theirs the same way.
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def _precision_options(args: argparse.Namespace) -> tuple[str, Int4Options | None]:
    """``--precision`` and the ``--int4-*`` options, checked (UsageError on a bad one)."""
    from epfuse.optimizer.precision import Int4Options
    from epfuse.optimizer.precision import normalize as normalize_precision

    try:
        precision = normalize_precision(args.precision)
    except ValueError as err:
        raise UsageError(f"--precision: {err}") from None
    given = {
        "block_size": args.int4_block_size,
        "symmetric": False if args.int4_asymmetric else None,
        "accuracy_level": args.int4_accuracy_level,
        "lm_head": False if args.int4_no_lm_head else None,
        "embeddings": True if args.int4_embeddings else None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if precision != "int4":
        if given:
            raise UsageError("--int4-* options need --precision int4")
        return precision, None
    try:
        return precision, Int4Options(**given)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _kv_cache_option(args: argparse.Namespace) -> None:
    """``--kv-cache``, checked (UsageError on an unknown value)."""
    from epfuse.optimizer.precision.kv_cache import normalize

    try:
        args.kv_cache = normalize(args.kv_cache)
    except ValueError as err:
        raise UsageError(f"--kv-cache: {err}") from None


def _output_path(args: argparse.Namespace, source: Path, suffix: str) -> Path:
    """-o as given; ending in a separator, a file named after the input inside that folder."""
    if args.output:
        if args.output.endswith(("/", os.sep)):
            return Path(args.output) / f"{source.stem}{suffix}"
        return Path(args.output)
    if args.input:
        return source.with_name(f"{source.stem}{suffix}")
    return Path(tempfile.mkdtemp(prefix="epfuse-")) / f"{source.stem}{suffix}"


def _report_check(args, protected: dict[Path, str], output: Path, data_name: str | None) -> None:
    """The report may be none of the files either model reads or is written to."""
    from epfuse.optimizer.io import check_output

    if not args.report:
        return
    taken = dict(protected)
    taken[output.resolve()] = "it is the optimized model's path"
    if data_name:
        taken[(output.parent / data_name).resolve()] = "it is the optimized model's data file"
    check_output(args.report, taken, create_parents=False)


def _warn(report) -> None:
    for line in report.warnings:
        print(f"epfuse: warning: {line}", file=sys.stderr)


def _optimize(args: argparse.Namespace) -> int:
    from epfuse.capabilities import get_ep
    from epfuse.examples import EXAMPLE_MODEL
    from epfuse.optimizer.io import (
        check_output,
        external_data_name,
        input_files,
        remove_written,
        save_model,
        write_text,
    )

    record = get_ep(args.ep)  # fail on a bad EP before reading anything
    precision, int4 = _precision_options(args)
    args.precision_plan = (precision, int4)
    _kv_cache_option(args)
    source = Path(args.input) if args.input else EXAMPLE_MODEL
    if args.hf_config and not args.genai:
        raise EpfuseError("--hf-config needs --genai")
    if args.hf_config and not Path(args.hf_config, "config.json").is_file():
        raise EpfuseError(f"{args.hf_config}: no config.json (not a Hugging Face folder)")
    protected = input_files(source)
    if args.genai:
        return _optimize_genai(args, record, source, protected)
    output = _output_path(args, source, f".{record.name}.onnx")
    check_output(output, protected)
    data_name = external_data_name(output, protected)
    _report_check(args, protected, output, data_name)
    with _deferred_signals():
        from epfuse.optimizer.api import optimize_with_report

    model, report = optimize_with_report(source, record, **_optimize_options(args))
    save_model(model, output, protected=protected)
    if args.report:
        try:
            write_text(args.report, report.to_json(indent=2) + "\n")
        except BaseException:
            remove_written(output)
            raise
    _warn(report)
    print(f"input:  {source}")
    print(report.summary())
    print(f"\nwrote {output}")
    return 0


def _optimize_options(args: argparse.Namespace) -> dict:
    """The optimize() options both output forms (a model file, a genai package) take from
    the command line."""
    return dict(
        max_seq_len=args.max_seq_len,
        verify=args.verify,
        require_fusion=args.require_fusion,
        precision=args.precision_plan[0],
        int4=args.precision_plan[1],
        kv_cache=args.kv_cache,
    )


def _optimize_genai(args: argparse.Namespace, record, source: Path, protected) -> int:
    from epfuse.optimizer.io import check_output, external_data_name, write_text

    with _deferred_signals():
        from epfuse.optimizer.api import optimize_with_report
        from epfuse.optimizer.genai import check_hf_config, write_genai_package

    outdir = _output_path(args, source, f".{record.name}.genai")
    check_output(outdir, protected, directory=True)
    target = outdir / "model.onnx"
    check_output(target, protected)
    _report_check(args, protected, target, external_data_name(target, protected))
    hf_text = check_hf_config(args.hf_config) if args.hf_config else None
    model, report = optimize_with_report(
        source,
        record,
        **_optimize_options(args),
        model_max_positions=(hf_text or {}).get("max_position_embeddings"),
    )
    made = not outdir.exists()
    try:
        package = write_genai_package(
            model, report, outdir, hf_config_dir=args.hf_config, ep=record, protected=protected
        )
        if args.report:
            write_text(args.report, report.to_json(indent=2) + "\n")
    except BaseException:
        if made:
            import shutil

            shutil.rmtree(outdir, ignore_errors=True)
        raise
    _warn(report)
    print(f"input:  {source}")
    print(report.summary())
    if package.share_buffer:
        print("\ngenai: past and present share one KV buffer (past_present_share_buffer)")
    else:
        print(
            "\ngenai: past and present cannot share one KV buffer "
            f"({package.share_buffer_blocker}); past_present_share_buffer is false"
        )
    if args.hf_config:
        copied = ", ".join(package.copied) or "nothing"
        print(f"genai: copied from {args.hf_config}: {copied}")
    else:
        print("genai: no --hf-config: add tokenizer files before loading it with a tokenizer")
    print(f"\nwrote {outdir}")
    return 0


_COLUMNS = (
    ("GQA", lambda o: o.gqa is not None),
    ("fused-RoPE", lambda o: bool(o.gqa and o.gqa.fused_rotary)),
    ("packed-QKV", lambda o: bool(o.gqa and o.gqa.packed_qkv)),
    ("GQA-softcap", lambda o: bool(o.gqa and o.gqa.softcap)),
    ("GQA-window", lambda o: bool(o.gqa and o.gqa.local_window)),
    ("GQA-sink", lambda o: bool(o.gqa and o.gqa.head_sink)),
    ("KV-int8", lambda o: bool(o.gqa and o.gqa.kv_cache_int8)),
    ("MoE", lambda o: o.moe),
    ("Attention", lambda o: o.attention),
    ("RotaryEmb", lambda o: o.rotary_embedding),
    ("MS-RoPE", lambda o: o.ms_rotary_embedding),
    ("MRoPE", lambda o: o.mrotary_embedding),
    ("RMSNorm", lambda o: o.rms_normalization),
    ("SimplLN", lambda o: o.simplified_layer_norm),
    ("SkipSimplLN", lambda o: o.skip_simplified_layer_norm),
)


def capability_table(records) -> str:
    from epfuse.capabilities import DTYPES

    header = ["EP", "dtype", *[name for name, _ in _COLUMNS]]
    rows = []
    for record in records:
        for dtype in DTYPES:
            ops = record.ops(dtype)
            marks = ["yes" if check(ops) else "-" for _, check in _COLUMNS]
            rows.append([record.name, dtype, *marks])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _capabilities(args: argparse.Namespace) -> int:
    from epfuse.capabilities import all_eps, get_ep

    records = [get_ep(args.ep)] if args.ep else all_eps()
    print(capability_table(records))
    for record in records:
        provider = record.provider or "(any; standard ONNX only)"
        notes = "; ".join(record.notes)
        print(
            f"\n{record.name}: {record.description}, {provider}" + (f". {notes}" if notes else "")
        )
    if args.probe:
        from epfuse.capabilities.probe import probe

        print("\nprobe (installed onnxruntime):")
        for record in records:
            print(probe(record).summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
