"""``epfuse fuzz ORIGINAL OPTIMIZED``: hypothesis-drawn in-contract scenarios for one pair of
models (``epfuse.testing.fuzz``); a failure is shrunk and printed as the ``epfuse verify``
command line that replays it. Hypothesis is imported only when the command runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from epfuse.errors import EpfuseError

from .cli import EXIT_NOT_EQUIVALENT, add_pair_command, load_pair, raise_load_error

DEFAULT_EXAMPLES = 100
DEFAULT_BUDGET = 50.0  # seconds: a default run stays under a minute


def add_fuzz_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    fz = add_pair_command(
        sub,
        "fuzz",
        help="hypothesis-drawn equivalence check of OPTIMIZED against ORIGINAL on ORT CPU",
        description="Draw in-contract scenarios for this pair of models (batch, right-padded "
        "prompts, decode on a real past, chunked prefill, decode after a padded prompt, "
        "lengths up to past every sliding window and length threshold read from either "
        "graph, token ids over the vocabulary), run both on ORT CPU and compare logits and "
        "present K/V on valid rows. On a failure, shrink it and print the `epfuse verify` "
        f"command line that replays it (exit {EXIT_NOT_EQUIVALENT}). Derandomized: the same "
        "examples on every run unless --seed is given. Needs hypothesis (the fuzz extra).",
    )
    fz.add_argument(
        "--examples",
        type=int,
        default=DEFAULT_EXAMPLES,
        help=f"examples to draw (default {DEFAULT_EXAMPLES})",
    )
    fz.add_argument(
        "--seed",
        type=int,
        default=None,
        help="draw fresh examples from this seed (default: "
        "derandomized, the same examples every run)",
    )
    fz.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="SECONDS",
        help=f"time budget of the search (default {DEFAULT_BUDGET:g}; shrinking a failure "
        "gets as long again; 0: no budget)",
    )
    fz.add_argument(
        "--max-len",
        type=int,
        default=None,
        metavar="L",
        help="longest drawn prompt or past (a chunk adds up to 5 tokens; default: 4 past the "
        "longest window or threshold, at least 12, within the models' positions)",
    )
    fz.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    fz.set_defaults(handler=run_fuzz)
    return fz


def run_fuzz(args: argparse.Namespace) -> int:
    if args.examples < 1:
        raise EpfuseError("--examples must be positive")
    if args.deadline < 0:
        raise EpfuseError("--deadline must be >= 0")
    if args.max_len is not None and args.max_len < 1:
        raise EpfuseError("--max-len must be positive")
    try:
        from epfuse.testing.fuzz import fuzz_models
    except ImportError as err:
        raise EpfuseError(
            f"epfuse fuzz needs hypothesis ({err}): pip install 'epfuse[fuzz]'"
        ) from None
    from .runner import Comparator, LengthError

    models = load_pair(args.original, args.optimized)
    try:
        pair = Comparator(*models)
    except ValueError as err:
        raise EpfuseError(f"cannot compare these models: {err}") from None
    except Exception as err:
        raise_load_error(args.original, err)
    if pair.load_error:
        print(f"{pair.load_error}\n\nFAIL")
        return EXIT_NOT_EQUIVALENT

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        result = fuzz_models(
            *models,
            examples=args.examples,
            seed=args.seed,
            budget=args.deadline or None,
            max_len=args.max_len,
            progress=progress,
            pair=pair,
        )
    except (ValueError, LengthError) as err:
        raise EpfuseError(f"cannot fuzz these models: {err}") from None
    print(f"original:  {args.original}\noptimized: {args.optimized}")
    print(f"matched (original):  {pair.ref.io.describe()}")
    print(f"matched (optimized): {pair.opt.io.describe()}")
    sig = result.signature
    print(f"lengths: {result.limits}; drawn up to {sig.max_len}")
    mode = f"seed {args.seed}" if args.seed is not None else "derandomized"
    budget = " (time budget spent)" if result.budget_spent else ""
    print(
        f"{result.examples} examples in {result.seconds:.1f}s ({mode}){budget}"
        + (f", {result.rejected} out of the original's contract" if result.rejected else "")
    )
    if args.json:
        data = result.to_dict(args.original, args.optimized)
        try:
            Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as err:
            raise EpfuseError(f"cannot write {args.json}: {err.strerror or err}") from None
    if result.passed:
        print("\nPASS")
        return 0
    failure = result.failure
    assert failure is not None
    print(
        f"\nminimal failing example: {', '.join(s.name for s in failure.scenarios)}, "
        f"seed {failure.seed}"
    )
    print(f"worst: {failure.worst()}\n")
    print(failure.result)
    print(f"\nreplay: {failure.replay(args.original, args.optimized)}")
    print(f"\nFAIL ({', '.join(failure.result.failed_scenarios())})")
    return EXIT_NOT_EQUIVALENT
