"""How far a converted or quantized model drifts from its float32 original: information, not a test
of the rewrite.

fp16, bf16 and int4 cannot equal float32, so the rewrite is verified against the unfused model
converted the same way (``optimize(verify=True)``). What the precision itself costs is measured
here, on the verify harness's inputs: a right-padded batch-2 prompt, then decode steps where
each model reads its own cache (a converted model's cache is in its own dtype), the same
tokens fed to both. Reported: max |logits difference| over valid rows and the fraction of
valid rows whose top-1 token agrees, next to the expected bound from
:data:`epfuse.tolerances.DRIFT`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from epfuse.optimizer.verify.feeds import _prompt_case, _tokens
from epfuse.optimizer.verify.runner import ModelLike, _Runner
from epfuse.tolerances import drift_bound


@dataclasses.dataclass
class Drift:
    precision: str
    max_abs_logits: float
    top1_agreement: float
    rows: int
    logits_scale: float
    """max |logits| of the original on the compared rows (to read the error against)."""
    expected_max_abs: float
    expected_top1: float

    @property
    def within_expected(self) -> bool:
        return (
            self.max_abs_logits <= self.expected_max_abs
            and self.top1_agreement >= self.expected_top1
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["within_expected"] = self.within_expected
        data["summary"] = self.summary()
        return data

    def summary(self) -> str:
        verdict = "within" if self.within_expected else "OUTSIDE"
        return (
            f"vs the float32 original: max |d logits| {self.max_abs_logits:.3g} "
            f"(|logits| <= {self.logits_scale:.3g}), top-1 agreement "
            f"{100 * self.top1_agreement:.1f}% over {self.rows} rows; {verdict} the expected "
            f"{self.precision} drift (<= {self.expected_max_abs:g}, >= "
            f"{100 * self.expected_top1:.0f}%)"
        )


def measure_drift(
    original: ModelLike,
    converted: ModelLike,
    precision: str,
    *,
    lens: tuple[int, ...] = (12, 7),
    steps: int = 4,
    seed: int = 0,
) -> Drift:
    """Logits drift of ``converted`` from ``original`` (float32) over a padded prompt and
    ``steps`` decode steps, each model on its own cache."""
    providers = ("CPUExecutionProvider",)
    ref = _Runner(original, providers, None)
    got = _Runner(converted, providers, None)
    vocab = ref.io.vocab_size or got.io.vocab_size or 32
    rng = np.random.default_rng(seed)
    batch = len(lens)
    prompt = _prompt_case(rng, batch, lens, vocab)
    tokens = _tokens(rng, (batch, steps), vocab)
    diffs: list[float] = []
    agree = rows = 0
    scale = 0.0
    caches: list[Any] = [None, None]
    mask, pos, ids = prompt.attention_mask, prompt.position_ids, prompt.input_ids
    for step in range(steps + 1):
        outs = []
        for i, runner in enumerate((ref, got)):
            logits, presents = runner.run(ids, mask, pos, caches[i])
            caches[i] = presents if ref.io.has_cache else None
            outs.append(np.asarray(logits, dtype=np.float64))
        for b, n in enumerate(lens):
            valid = slice(0, n) if step == 0 else slice(0, 1)
            a, c = outs[0][b, valid], outs[1][b, valid]
            diffs.append(float(np.abs(a - c).max()))
            scale = max(scale, float(np.abs(a).max()))
            agree += int((a.argmax(-1) == c.argmax(-1)).sum())
            rows += a.shape[0]
        if not ref.io.has_cache or step == steps:
            break
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        pos = np.array([[n + step] for n in lens], dtype=np.int64)
        ids = tokens[:, step : step + 1]
    bound = drift_bound(precision)
    return Drift(
        precision,
        max(diffs),
        agree / rows,
        rows,
        scale,
        bound.max_abs_logits,
        bound.top1_agreement,
    )
