"""``epfuse verify ORIGINAL OPTIMIZED``: the subcommand lives beside the harness it drives, so
that the main CLI only registers it (``add_verify_command``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from epfuse.errors import EpfuseError

EXIT_NOT_EQUIVALENT = 4


def add_pair_command(
    sub: argparse._SubParsersAction, name: str, *, help: str, description: str
) -> argparse.ArgumentParser:
    """A subcommand on ORIGINAL OPTIMIZED (``verify``, ``fuzz``): its two positionals and the
    hidden ``--debug`` written once, the rest added by the caller."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument("original", help="the model before optimization")
    parser.add_argument("optimized", help="the optimized model")
    # SUPPRESS: leave a top-level `epfuse --debug` alone.
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    return parser


def raise_load_error(path: str, err: Exception) -> NoReturn:
    """``err`` from loading or running ``path`` on ORT CPU as a one-line error; any other
    exception is raised as it is (a bug, not a bad model)."""
    if not type(err).__module__.startswith("onnxruntime"):
        raise err
    line = (str(err).strip().splitlines() or [""])[0][:300]
    raise EpfuseError(f"{path}: does not load in ORT CPU: {line}") from None


def add_verify_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ver = add_pair_command(
        sub,
        "verify",
        help="check on ORT CPU that OPTIMIZED computes what ORIGINAL computes",
        description="Run both models on ORT CPU for a prompt, decode with a real past, chunked "
        "prefill, a right-padded batch and decode after a padded prompt (inputs made from the "
        "models' input signatures, lengths past every sliding window and length threshold "
        "read from both graphs); print max abs/rel error per output and PASS or FAIL "
        f"(exit {EXIT_NOT_EQUIVALENT}).",
    )
    ver.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt length (default: past every sliding window and length threshold of "
        "either model, at least 7)",
    )
    ver.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="NAME",
        help="run this scenario instead of the built-in set, e.g. 'prompt[9, 4]', "
        "'decode[b=2,past=11,new=1]', 'chunk[b=1,past=4,new=3]', 'padded_decode[9, 4]x2' "
        "(repeatable; the form `epfuse fuzz` prints to replay a failure)",
    )
    ver.add_argument(
        "--seed", type=int, default=0, help="seed of the token ids (default 0; with --scenario)"
    )
    ver.set_defaults(handler=run_verify)
    return ver


def load_pair(original: str, optimized: str) -> list:
    """Both models as ModelProtos with their weights in memory (ORT gets bytes)."""
    import onnx_ir as ir

    from epfuse.optimizer.io import load_model

    models = []
    for path in (original, optimized):
        model = load_model(Path(path))  # clear one-line errors for bad files
        ir.external_data.load_to_model(model)
        models.append(ir.to_proto(model))
    return models


def compare_or_explain(original_path: str, models: list, **kwargs):
    """``compare_models`` with every way it can fail as input turned into a one-line error."""
    from .roles import discover_io
    from .runner import LengthError, compare_models

    for which, model in zip(("original", "optimized"), models, strict=False):
        # Both directions alike: a model whose I/O roles are not found cannot be compared
        # (exit 1); exit 4 is only for comparable models that differ.
        try:
            discover_io(model)
        except ValueError as err:
            raise EpfuseError(f"cannot compare these models: {which} model: {err}") from None
    try:
        result = compare_models(*models, **kwargs)
    except LengthError as err:
        raise EpfuseError(str(err)) from None
    except ValueError as err:  # I/O roles not recognised or not matching
        raise EpfuseError(f"cannot compare these models: {err}") from None
    except Exception as err:
        raise_load_error(original_path, err)
    for scenario in result.scenarios:
        if scenario.error and scenario.error.startswith("original model failed"):
            raise EpfuseError(f"{original_path}: cannot run on ORT CPU: {scenario.error}")
    return result


def print_result(args: argparse.Namespace, result) -> None:
    print(f"original:  {args.original}\noptimized: {args.optimized}")
    print(f"matched (original):  {result.roles[0]}")
    print(f"matched (optimized): {result.roles[1]}")
    print(f"lengths: {result.limits}\n")
    print(result)
    print("\nper output (worst over all scenarios):")
    worst: dict[str, tuple[float, float]] = {}
    for scenario in result.scenarios:
        for c in scenario.comparisons:
            abs_err, rel_err = worst.get(c.output, (0.0, 0.0))
            worst[c.output] = (max(abs_err, c.max_abs_err), max(rel_err, c.max_rel_err))
    width = max((len(name) for name in worst), default=6)
    for name, (abs_err, rel_err) in worst.items():
        print(f"  {name:<{width}}  max abs {abs_err:.3g}  max rel {rel_err:.3g}")


def run_verify(args: argparse.Namespace) -> int:
    from .scenarios import parse_scenario

    if args.prompt_len is not None and args.prompt_len < 1:
        raise EpfuseError("--prompt-len must be positive")
    kwargs: dict = {"seed": args.seed}
    if args.scenario:
        try:
            kwargs["scenarios"] = [parse_scenario(text) for text in args.scenario]
        except ValueError as err:
            raise EpfuseError(f"--scenario: {err}") from None
    if args.prompt_len is not None:
        kwargs["prompt_len"] = args.prompt_len
    models = load_pair(args.original, args.optimized)
    try:
        result = compare_or_explain(args.original, models, **kwargs)
    except EpfuseError as err:
        if args.prompt_len is not None and "positions" in str(err):
            raise EpfuseError(f"--prompt-len {args.prompt_len}: {err}") from None
        raise
    print_result(args, result)
    if result.passed:
        print("\nPASS")
        return 0
    failed = ", ".join(result.failed_scenarios())
    print(f"\nFAIL ({failed})")
    return EXIT_NOT_EQUIVALENT
