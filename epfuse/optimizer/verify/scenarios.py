"""Comparison scenarios: explicit batch and lengths, and the named built-in set."""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

SCENARIOS: tuple[str, ...] = ("prompt", "decode", "chunk", "padded", "padded_decode")
SCENARIO_KINDS: tuple[str, ...] = ("prompt", "continue", "padded_decode")


@dataclass(frozen=True)
class Scenario:
    """One comparison scenario with explicit batch and lengths (build with the classmethods).

    - ``prompt``: batch ``len(lens)``, empty past, row ``b`` has ``lens[b]`` valid tokens and is
      right-padded to ``max(lens)``; positions ``arange``.
    - ``continue``: the ORIGINAL model runs an unpadded ``past_len``-token prompt of batch
      ``len(lens)``; its presents are the past of both models for ``new_len`` new tokens
      (decode when ``new_len == 1``, chunked prefill otherwise). ``past_len == 0`` is a prompt.
    - ``padded_decode``: each model runs the right-padded prompt of ``lens`` and then ``steps``
      single-token decode steps on its OWN presents. Row ``b``'s mask at step ``t`` is
      ``[1]*lens[b] + [0]*(max(lens)-lens[b]) + [1]*(t+1)``: the prompt's padding stays in the
      concat cache. Only logits and the prompt part of the presents (``:lens[b]``) are
      compared, because a GroupQueryAttention model writes the new token at its row's length
      (``seqlens_k``), a concat cache at the end. This is what catches a lost padding mask: in
      a right-padded prompt causality already hides padded keys from valid queries. The
      scenario is skipped when the ORIGINAL model's rows do not each equal the same row run
      alone (e.g. a sliding window counted over cache slots, padding included).
    """

    name: str
    kind: str
    lens: tuple[int, ...]
    past_len: int = 0
    new_len: int = 1
    steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCENARIO_KINDS:
            raise ValueError(f"unknown scenario kind {self.kind!r}; known: {SCENARIO_KINDS}")
        if self.past_len < 0 or self.new_len < 1 or self.steps < 1:
            raise ValueError(f"{self.name}: need past_len >= 0, new_len >= 1, steps >= 1")
        if not self.lens or min(self.lens) < 1:
            raise ValueError(f"{self.name}: lens must be non-empty and >= 1, got {self.lens}")

    @property
    def batch(self) -> int:
        return len(self.lens)

    @classmethod
    def prompt(cls, lens: Sequence[int], name: str | None = None) -> Scenario:
        lens = tuple(int(n) for n in lens)
        return cls(name or f"prompt{list(lens)}", "prompt", lens)

    @classmethod
    def continuation(
        cls, batch: int, past_len: int, new_len: int, name: str | None = None
    ) -> Scenario:
        kind = "decode" if new_len == 1 else "chunk"
        label = name or f"{kind}[b={batch},past={past_len},new={new_len}]"
        return cls(label, "continue", (new_len,) * batch, past_len=past_len, new_len=new_len)

    @classmethod
    def padded_decode(
        cls, lens: Sequence[int], steps: int = 2, name: str | None = None
    ) -> Scenario:
        lens = tuple(int(n) for n in lens)
        return cls(name or f"padded_decode{list(lens)}x{steps}", "padded_decode", lens, steps=steps)


_PARSE = (
    (re.compile(r"prompt\[([\d, ]+)\]"), "prompt"),
    (re.compile(r"(?:decode|chunk)\[b=(\d+),past=(\d+),new=(\d+)\]"), "continue"),
    (re.compile(r"padded_decode\[([\d, ]+)\]x(\d+)"), "padded_decode"),
)


def parse_scenario(text: str) -> Scenario:
    """The scenario a default name stands for (``prompt[5, 3]``, ``decode[b=2,past=9,new=1]``,
    ``chunk[b=1,past=4,new=3]``, ``padded_decode[9, 4]x2``): the name also seeds its inputs,
    so ``epfuse verify --scenario NAME --seed S`` replays exactly what ``epfuse fuzz`` ran."""
    text = text.strip()
    for pattern, kind in _PARSE:
        match = pattern.fullmatch(text)
        if match is None:
            continue
        if kind == "prompt":
            return Scenario.prompt(_ints(match.group(1)))
        if kind == "padded_decode":
            return Scenario.padded_decode(_ints(match.group(1)), int(match.group(2)))
        batch, past, new = (int(g) for g in match.groups())
        scenario = Scenario.continuation(batch, past, new)
        if scenario.name == text:
            return scenario
    raise ValueError(
        f"cannot read scenario {text!r}: expected prompt[L1, L2, ...], "
        "decode[b=B,past=P,new=1], chunk[b=B,past=P,new=N] or padded_decode[L1, L2, ...]xSTEPS"
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def builtin_scenarios(
    prompt_len: int = 7,
    decode_past_len: int = 6,
    chunk_past_len: int = 5,
    chunk_len: int = 3,
    padded_lens: tuple[int, ...] | None = None,
    padded_decode_lens: tuple[int, ...] | None = None,
    padded_decode_steps: int = 2,
) -> dict[str, Scenario]:
    """The named default scenarios (see the module docstring) for the given lengths."""
    if padded_lens is None:
        padded_lens = (prompt_len, (prompt_len + 1) // 2)
    if padded_decode_lens is None:
        padded_decode_lens = padded_lens
    return {
        "prompt": Scenario.prompt((prompt_len, prompt_len), name="prompt"),
        "decode": Scenario.continuation(2, decode_past_len, 1, name="decode"),
        "chunk": Scenario.continuation(1, chunk_past_len, chunk_len, name="chunk"),
        "padded": Scenario.prompt(padded_lens, name="padded"),
        "padded_decode": Scenario.padded_decode(
            padded_decode_lens, padded_decode_steps, name="padded_decode"
        ),
    }


def _scenario_seed(name: str) -> int:
    """Inputs depend only on (seed, scenario name), not on which other scenarios run."""
    return SCENARIOS.index(name) if name in SCENARIOS else zlib.crc32(name.encode())
