"""``epfuse verify ORIGINAL OPTIMIZED``: the subcommand lives beside the harness it drives, so
that the main CLI only registers it (``add_verify_command``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from epfuse.errors import EpfuseError

EXIT_NOT_EQUIVALENT = 4


def add_verify_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ver = sub.add_parser(
        "verify",
        help="check on ORT CPU that OPTIMIZED computes what ORIGINAL computes",
        description="Run both models on ORT CPU for a prompt, decode with a real past, chunked "
        "prefill, a right-padded batch and decode after a padded prompt (inputs made from the "
        "models' input signatures); print max abs/rel error per output and PASS or FAIL "
        f"(exit {EXIT_NOT_EQUIVALENT}).",
    )
    ver.add_argument("original", help="the model before optimization")
    ver.add_argument("optimized", help="the optimized model")
    ver.add_argument(
        "--prompt-len",
        type=int,
        default=7,
        help="prompt length (raise it past a sliding window; default 7)",
    )
    ver.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    ver.set_defaults(handler=run_verify)
    return ver


def run_verify(args: argparse.Namespace) -> int:
    import onnx_ir as ir

    from epfuse.optimizer.io import load_model

    from .runner import compare_models

    if args.prompt_len < 1:
        raise EpfuseError("--prompt-len must be positive")
    models = []
    for path in (args.original, args.optimized):
        model = load_model(Path(path))  # clear one-line errors for bad files
        ir.external_data.load_to_model(model)  # ORT gets bytes: weights must be in memory
        models.append(ir.to_proto(model))
    kwargs = {
        "prompt_len": args.prompt_len,
        "decode_past_len": max(1, args.prompt_len - 1),
        "chunk_past_len": max(1, args.prompt_len - 2),
    }
    try:
        result = compare_models(*models, **kwargs)
    except ValueError as err:  # I/O roles not recognised or not matching
        raise EpfuseError(f"cannot compare these models: {err}") from None
    except Exception as err:
        if not type(err).__module__.startswith("onnxruntime"):
            raise
        line = (str(err).strip().splitlines() or [""])[0][:300]
        raise EpfuseError(f"{args.original}: does not load in ORT CPU: {line}") from None
    for scenario in result.scenarios:
        if scenario.error and scenario.error.startswith("original model failed"):
            raise EpfuseError(f"{args.original}: cannot run on ORT CPU: {scenario.error}")
    print(f"original:  {args.original}\noptimized: {args.optimized}\n")
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
    errors = [f"{s.name}: {s.error}" for s in result.scenarios if s.error]
    for line in errors:
        print(f"  error in {line}")
    if result.passed:
        print("\nPASS")
        return 0
    failed = ", ".join(result.failed_scenarios())
    print(f"\nFAIL ({failed})")
    return EXIT_NOT_EQUIVALENT
