"""The text table ``epfuse verify`` prints for a :class:`VerificationResult`."""

from __future__ import annotations

import dataclasses

from .comparison import OutputComparison, VerificationResult


def format_result(result: VerificationResult) -> str:
    """The comparison table: one row per scenario and output."""
    tol = result.tolerance
    head = (
        f"equivalence {'PASSED' if result.passed else 'FAILED'} "
        f"(dtype {result.dtype}, atol {tol.atol:g}, rtol {tol.rtol:g}; "
        f"ratio = max|d| / (atol + rtol*|ref|), pass if <= 1)"
    )
    rows = [("scenario", "output", "shape", "max_abs", "max_rel", "ratio", "ok")]
    # Reasons and errors are footnotes below the table: a column padded to a 180-character
    # message would push every number off the screen.
    notes: list[str] = []
    errors: list[str] = []  # one line each, as is (an ORT error's first line)

    def footnote(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    for s in result.scenarios:
        if s.skipped is not None:
            rows.append(
                (s.name, f"skipped {footnote(f'skipped: {s.skipped}')}", "", "", "", "", "-")
            )
            continue
        if s.error is not None:
            if s.error not in errors:
                errors.append(s.error)
            rows.append((s.name, "ERROR (below)", "", "", "", "", "FAIL"))
            continue
        for c in _summarise(s.comparisons):
            rows.append(
                (
                    s.name,
                    c.output + (f" ({c.note})" if c.note else ""),
                    "x".join(map(str, c.shape)),
                    f"{c.max_abs_err:.3g}",
                    f"{c.max_rel_err:.3g}",
                    f"{c.ratio:.3g}",
                    "ok" if c.passed else "FAIL",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head]
    for j, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.extend(f"[{i}] {text}" for i, text in enumerate(notes, 1))
    lines.extend(errors)
    return "\n".join(line.rstrip() for line in lines)


def _summarise(comparisons: list[OutputComparison]) -> list[OutputComparison]:
    """Logits plus failing presents individually; passing presents folded into their worst."""
    out = [c for c in comparisons if c.kind != "kv" or not c.passed]
    passing = [c for c in comparisons if c.kind == "kv" and c.passed]
    if len(passing) == 1:
        out.append(passing[0])
    elif passing:
        worst = max(passing, key=lambda c: c.ratio)
        note = f"worst of {len(passing)} passing presents"
        out.append(dataclasses.replace(worst, note=f"{worst.note}; {note}".lstrip("; ")))
    return out
