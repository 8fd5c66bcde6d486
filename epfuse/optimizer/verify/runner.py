"""Run both models on ORT CPU over the scenarios and collect the comparisons.

Verify reads models in onnx_ir, whatever it is given (a path, an ``onnx.ModelProto`` or an
``onnx_ir.Model``): the roles (``DecoderSignature``), the lengths (``limits``) and the
boundaries a session needs (the int8 KV cache's float boundary, bf16's float32 boundary) all
read the one converted model. ORT sessions take protobuf bytes, so each session's model is
serialized once, in :func:`_session_bytes`: the only place verify leaves onnx_ir.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict, Unpack

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from epfuse.patterns._evaluate import float32_boundary
from epfuse.tolerances import Tolerance, tolerance_for

from .comparison import (
    ScenarioResult,
    VerificationResult,
    _compare,
    _compare_valid,
)
from .feeds import (
    PositionStreams,
    _Case,
    _continue_case,
    _feed_float,
    _prompt_case,
    _tokens,
    position_feed,
    text_positions,
)
from .limits import Limits, check_length, default_lengths, read_limits
from .roles import discover_io
from .scenarios import SCENARIOS, Scenario, _scenario_seed, builtin_scenarios

ModelLike = str | os.PathLike | onnx.ModelProto | Any  # Any: an onnx_ir.Model
OPTIMIZED_FAILED = "optimized model failed to run in scenario"


class LengthError(ValueError):
    """A scenario needs more positions than the models can take (cos/sin cache rows...)."""


def _to_ir(model: ModelLike) -> ir.Model:
    """The one conversion in: everything verify reads (roles, limits, boundaries) is onnx_ir."""
    if isinstance(model, onnx.ModelProto):
        converted = ir.serde.deserialize_model(model)
    elif isinstance(model, (str, os.PathLike)):
        converted = ir.load(str(model))
    elif isinstance(model, ir.Model):
        converted = model
    else:
        raise TypeError(f"expected a path, onnx.ModelProto or onnx_ir.Model, got {type(model)}")
    # ORT gets the model as bytes, so external weights are read into memory (in place).
    ir.external_data.load_to_model(converted)
    return converted


def _session_bytes(model: ir.Model) -> bytes:
    """The one conversion out: ORT takes a serialized protobuf."""
    return ir.serde.serialize_model(model).SerializeToString()


class _Runner:
    """An ORT CPU session for one model plus its discovered I/O roles."""

    def __init__(
        self,
        model: ModelLike,
        providers: Sequence[str],
        session_options: ort.SessionOptions | None,
        position_streams: PositionStreams | None = None,
    ):
        from epfuse.optimizer.precision.kv_cache import float_cache_boundary

        # An int8 KV cache is fed and read in the compute dtype (quantized with the model's
        # own scales at the boundary), so both models take the same past.
        source = _to_ir(model)
        run = float_cache_boundary(source)  # a copy when it changes anything
        self.int8_cache = run is not source
        self.io = discover_io(run)
        self.position_streams = position_streams or text_positions
        boundary = [*run.graph.inputs, *run.graph.outputs]
        if any(v.dtype == ir.DataType.BFLOAT16 for v in boundary):
            # numpy has no bfloat16: feed and read float32, cast at the boundary (exact).
            run = run if self.int8_cache else run.clone()
            float32_boundary(run.graph)
        if session_options is None:
            # FATAL only: a failing kernel's error comes back as the exception, which the
            # result reports in one line; ORT's own (colored, multi-line) log would repeat it.
            session_options = ort.SessionOptions()
            session_options.log_severity_level = 4
        self.session = ort.InferenceSession(
            _session_bytes(run), sess_options=session_options, providers=list(providers)
        )
        self.run_options = ort.RunOptions()
        self.run_options.log_severity_level = 4
        self.embed_table: np.ndarray | None = None
        """For an ``inputs_embeds`` model: token id -> embedding (shared by both models)."""

    def run(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: Sequence[np.ndarray] | None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits and the presents: the KV's, then the states' (``past`` in that order)."""
        io = self.io
        if io.token_kind == "embeds":
            assert self.embed_table is not None
            tokens = self.embed_table[input_ids].astype(_feed_float(io.dtype))
        else:
            tokens = input_ids.astype(io.input_ids_dtype)
        feed: dict[str, np.ndarray] = {io.input_ids: tokens}
        if io.attention_mask is not None:
            feed[io.attention_mask] = attention_mask.astype(io.attention_mask_dtype)
        if io.position_ids is not None:
            feed[io.position_ids] = position_feed(io, position_ids, self.position_streams)
        batch = input_ids.shape[0]
        for i, spec in enumerate(io.kv):
            if past is None:
                value = np.zeros((batch, spec.num_kv_heads, 0, spec.head_dim), np.float32)
            else:
                value = past[i]
            feed[spec.past] = value.astype(_feed_float(io.dtype))
        for i, state in enumerate(io.states, start=len(io.kv)):
            # Zeros are a fresh state: a causal conv over zero padding, a scan from zero.
            value = np.zeros((batch, *state.shape), np.float32) if past is None else past[i]
            feed[state.past] = value.astype(_feed_float(io.dtype))
        names = [io.logits, *present_names(io)]
        outs = self.session.run(names, feed, self.run_options)
        return outs[0], list(outs[1:])


def present_names(io) -> list[str]:
    """The presents :meth:`_Runner.run` returns: the KV's, then the states'."""
    return [spec.present for spec in io.kv if spec.present] + [s.present for s in io.states]


def _compare_step(
    scenario: str,
    case: _Case,
    original: _Runner,
    optimized: _Runner,
    past: Sequence[np.ndarray] | None,
    tol: Tolerance,
) -> ScenarioResult:
    result = ScenarioResult(scenario)
    outputs = []
    for which, runner in enumerate((original, optimized)):
        try:
            outputs.append(runner.run(case.input_ids, case.attention_mask, case.position_ids, past))
        except Exception as exc:
            # The original failing means the scenario is out of its contract (callers read
            # the prefix); the optimized failing is a failed verification.
            result.error = (
                f"original model failed: {type(exc).__name__}: {_first_line(exc)}"
                if which == 0
                else f"{OPTIMIZED_FAILED} {scenario}: {_first_line(exc)}"
            )
            return result
    (ref_logits, ref_presents), (opt_logits, opt_presents) = outputs

    def valid_rows(x: np.ndarray, axis: int, offset: int) -> np.ndarray:
        # Concatenate each row's valid slice along ``axis`` (padding rows hold garbage).
        parts = []
        for b, n in enumerate(case.new_lens):
            index: list[Any] = [slice(None)] * x.ndim
            index[0] = slice(b, b + 1)
            index[axis] = slice(0, offset + n)
            parts.append(x[tuple(index)].reshape(-1))
        return np.concatenate(parts)

    logits_name = original.io.logits
    result.comparisons.append(
        _compare_valid(
            scenario, logits_name, "logits", ref_logits, opt_logits, tol, valid_rows, 1, 0
        )
    )
    names = present_names(original.io)
    num_kv = len(names) - len(original.io.states)
    if len(opt_presents) != len(ref_presents):
        result.error = (
            f"optimized model has {len(opt_presents)} present outputs, "
            f"original has {len(ref_presents)}"
        )
        return result
    for i, (name, ref, opt) in enumerate(zip(names, ref_presents, opt_presents, strict=True)):
        if i >= num_kv:
            # A state has no length axis: all of it, padded rows' included (both models
            # compute those from the same masked inputs of the untouched layers).
            result.comparisons.append(_compare(scenario, name, "state", ref, opt, tol))
            continue
        result.comparisons.append(
            _compare_valid(scenario, name, "kv", ref, opt, tol, valid_rows, 2, case.past_len)
        )
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


class PairOptions(TypedDict, total=False):
    """The keywords :func:`compare_models` passes on to :class:`Comparator` (defaults there):
    how both models' sessions are made and their outputs compared."""

    tolerance: Tolerance | None
    providers: Sequence[str]
    session_options: ort.SessionOptions | None
    position_streams: PositionStreams | None


class ScenarioPlan(TypedDict, total=False):
    """The keywords :func:`compare_models` passes on to :meth:`Comparator.compare` (defaults
    there): which scenarios run, at what lengths, and the token ids' seed."""

    scenarios: Iterable[str | Scenario]
    prompt_len: int | None
    decode_past_len: int | None
    chunk_past_len: int | None
    chunk_len: int
    padded_lens: tuple[int, ...] | None
    padded_decode_lens: tuple[int, ...] | None
    padded_decode_steps: int
    seed: int


class CompareOptions(PairOptions, ScenarioPlan, total=False):
    """Every keyword of :func:`compare_models`."""


def compare_models(
    original: ModelLike,
    optimized: ModelLike,
    **options: Unpack[CompareOptions],
) -> VerificationResult:
    """Run ``original`` and ``optimized`` over ``scenarios`` and compare logits and presents.

    Models are paths, ``onnx.ModelProto`` or ``onnx_ir.Model``. ``options`` are the keywords of
    :class:`Comparator` (:class:`PairOptions`) and of :meth:`Comparator.compare`
    (:class:`ScenarioPlan`), with their defaults. ``scenarios`` holds names of
    the built-in scenarios (:data:`SCENARIOS`, sized by the length arguments) and/or explicit
    :class:`Scenario` objects (any batch and lengths). Sequence lengths can be raised (e.g.
    ``prompt_len`` / ``decode_past_len`` beyond a sliding window). ``padded_lens`` defaults to
    ``(prompt_len, (prompt_len + 1) // 2)``, ``padded_decode_lens`` to ``padded_lens``.
    ``tolerance`` overrides the dtype's entry in :data:`epfuse.tolerances.TOLERANCES`.
    ``position_streams`` maps the scenario's (batch, seq) positions to (3, batch, seq) mRoPE
    streams for a model whose position input has that shape (default :func:`text_positions`).

    Lengths left as None are read from both graphs (:mod:`.limits`): past every sliding
    window and length threshold, within the positions the models take. A scenario that needs
    more positions than that raises :class:`LengthError`.
    """
    pair = {k: options.pop(k) for k in PairOptions.__optional_keys__ if k in options}
    return Comparator(original, optimized, **pair).compare(**options)


class Comparator:
    """Both models loaded once (ORT sessions, roles, lengths read from the graphs), to be
    compared over any number of scenario lists: what ``epfuse fuzz`` runs per example.

    Raises ``ValueError`` when the roles of the two models do not match.

    :meth:`with_optimized` compares the same original with another candidate (the
    optimizer's rollback verifies many): the original's session and the lengths read from the
    graphs are reused, not rebuilt.
    """

    def __init__(
        self,
        original: ModelLike,
        optimized: ModelLike,
        *,
        tolerance: Tolerance | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        session_options: ort.SessionOptions | None = None,
        position_streams: PositionStreams | None = None,
        limits: Limits | None = None,
        reference: _Runner | None = None,
    ):
        """``limits``: lengths already read for this original (and a candidate whose windows
        include this one's); ``reference``: the original's runner, already loaded."""
        ref_model, opt_model = _to_ir(original), None
        with contextlib.suppress(Exception):  # reported as a model that does not load
            opt_model = _to_ir(optimized)
        self._original = ref_model
        self._options = PairOptions(
            tolerance=tolerance,
            providers=tuple(providers),
            session_options=session_options,
            position_streams=position_streams,
        )
        self.limits = limits if limits is not None else read_limits(ref_model, opt_model)
        self.gqa = any(
            n.op_type == "GroupQueryAttention"
            for model in (ref_model, opt_model)
            if model is not None
            for n in model.graph
        )
        """Either graph has GroupQueryAttention (ORT CPU's takes chunked prefill at batch 1)."""
        self.ref = reference or _Runner(ref_model, providers, session_options, position_streams)
        self.load_error: str | None = None
        self.opt: _Runner | None = None
        self.tolerance = tolerance or tolerance_for(self.ref.io.dtype)
        try:
            self.opt = _Runner(
                opt_model if opt_model is not None else optimized,
                providers,
                session_options,
                position_streams,
            )
        except Exception as exc:
            # A model that does not load (e.g. an unknown attribute) is a failed verification.
            self.load_error = (
                f"optimized model failed to load: {type(exc).__name__}: {_first_line(exc)}"
            )
            return
        ref, opt = self.ref, self.opt
        if tolerance is None and opt.int8_cache and not ref.int8_cache:
            self.tolerance = tolerance_for(ref.io.dtype, "kv-int8")
        if len(ref.io.kv) != len(opt.io.kv):
            raise ValueError(
                f"original has {len(ref.io.kv)} past/present pairs, optimized has {len(opt.io.kv)}"
            )
        if [s.shape for s in ref.io.states] != [s.shape for s in opt.io.states]:
            raise ValueError(
                f"original has states {[s.past for s in ref.io.states]}, optimized has "
                f"{[s.past for s in opt.io.states]}"
            )
        if ref.io.dtype != opt.io.dtype:
            raise ValueError(f"dtype differs: original {ref.io.dtype}, optimized {opt.io.dtype}")
        if ref.io.token_kind != opt.io.token_kind:
            raise ValueError(
                f"original takes {ref.io.token_kind} ({ref.io.input_ids}), optimized takes "
                f"{opt.io.token_kind} ({opt.io.input_ids})"
            )
        self.vocab = ref.io.vocab_size or opt.io.vocab_size or 32

    def with_optimized(self, optimized: ModelLike) -> Comparator:
        """The same original (session, roles, lengths) compared with ``optimized``: a
        candidate of the same pipeline (its windows, thresholds and tables are those of the
        original and of the model this comparator was built with)."""
        return Comparator(
            self._original, optimized, **self._options, limits=self.limits, reference=self.ref
        )

    def compare(
        self,
        *,
        # The keywords of ScenarioPlan, with their defaults: compare_models passes them on.
        scenarios: Iterable[str | Scenario] = SCENARIOS,
        prompt_len: int | None = None,
        decode_past_len: int | None = None,
        chunk_past_len: int | None = None,
        chunk_len: int = 3,
        padded_lens: tuple[int, ...] | None = None,
        padded_decode_lens: tuple[int, ...] | None = None,
        padded_decode_steps: int = 2,
        seed: int = 0,
    ) -> VerificationResult:
        """:func:`compare_models` on this pair (the same arguments)."""
        lengths = default_lengths(self.limits, padded_decode_steps)
        if prompt_len is None:
            prompt_len = lengths["prompt_len"]
            decode_past_len = decode_past_len or lengths["decode_past_len"]
            chunk_past_len = chunk_past_len or lengths["chunk_past_len"]
            padded_decode_lens = padded_decode_lens or lengths.get("padded_decode_lens")
        decode_past_len = decode_past_len or max(1, prompt_len - 1)
        chunk_past_len = chunk_past_len or max(1, prompt_len - 2)
        named = builtin_scenarios(
            prompt_len,
            decode_past_len,
            chunk_past_len,
            chunk_len,
            padded_lens,
            padded_decode_lens,
            padded_decode_steps,
        )
        plan: list[Scenario] = []
        unknown = []
        for item in scenarios:
            if isinstance(item, Scenario):
                plan.append(item)
            elif item in named:
                plan.append(named[item])
            else:
                unknown.append(item)
        if unknown:
            raise ValueError(f"unknown scenarios {unknown}; known: {SCENARIOS}")
        return self.run(plan, seed)

    @property
    def has_cache(self) -> bool:
        return all(spec.present for spec in self.ref.io.kv) and self.ref.io.has_cache

    def run(self, plan: Sequence[Scenario], seed: int = 0) -> VerificationResult:
        """Compare over ``plan``; inputs depend only on (seed, scenario name)."""
        for scenario in plan:
            why = check_length(
                self.limits, scenario_positions(scenario), f"scenario {scenario.name}"
            )
            if why:
                raise LengthError(why)
        ref, opt, tol = self.ref, self.opt, self.tolerance
        if opt is None:
            return VerificationResult(
                dtype=ref.io.dtype,
                tolerance=tol,
                scenarios=[ScenarioResult(s.name, error=self.load_error) for s in plan],
                roles=(ref.io.describe(), ""),
                limits=self.limits.describe(),
            )
        if ref.io.token_kind == "embeds":
            # Token ids -> fixed unit-scale embeddings, so that scenarios stay token-based.
            rng = np.random.default_rng([seed, 7])
            table = rng.standard_normal((self.vocab, ref.io.hidden_size))
            ref.embed_table = opt.embed_table = table.astype(np.float32)
        results = []
        for scenario in plan:
            rng = np.random.default_rng([seed, _scenario_seed(scenario.name)])
            results.append(self._run_scenario(scenario, rng))
        return VerificationResult(
            dtype=ref.io.dtype,
            tolerance=tol,
            scenarios=results,
            roles=(ref.io.describe(), opt.io.describe()),
            limits=self.limits.describe(),
        )

    def _run_scenario(self, scenario: Scenario, rng: np.random.Generator) -> ScenarioResult:
        ref, opt, tol, vocab = self.ref, self.opt, self.tolerance, self.vocab
        assert opt is not None  # run() reports a load error without running scenarios
        name = scenario.name
        if scenario.kind == "prompt":
            case = _prompt_case(rng, scenario.batch, scenario.lens, vocab)
            return _compare_step(name, case, ref, opt, None, tol)
        if not self.has_cache:
            return ScenarioResult(name, skipped="model has no KV cache")
        if scenario.kind == "padded_decode":
            return self._padded_decode(scenario, rng)
        batch, past_len, new = scenario.batch, scenario.past_len, scenario.new_len
        past = None
        if past_len:
            first = _prompt_case(rng, batch, (past_len,) * batch, vocab)
            try:
                _, past = ref.run(first.input_ids, first.attention_mask, first.position_ids, None)
            except Exception as exc:
                return ScenarioResult(
                    name,
                    error=f"original model failed on the {past_len}-token prompt: "
                    f"{type(exc).__name__}: {_first_line(exc)}",
                )
        case = _continue_case(rng, batch, past_len, new, vocab)
        return _compare_step(name, case, ref, opt, past, tol)

    def _padded_decode(self, scenario: Scenario, rng: np.random.Generator) -> ScenarioResult:
        """See :class:`Scenario`: padded prompt, then decode steps on each model's own cache."""
        ref, opt, tol, vocab = self.ref, self.opt, self.tolerance, self.vocab
        assert opt is not None
        name, lens, batch = scenario.name, scenario.lens, scenario.batch
        prompt = _prompt_case(rng, batch, lens, vocab)
        tokens = _tokens(rng, (batch, scenario.steps), vocab)
        result = ScenarioResult(name)

        def steps(runner: _Runner, rows: Sequence[int] | None) -> list[tuple[np.ndarray, list]]:
            """Prompt + decode steps for ``rows`` (None: the padded batch; else unpadded rows)."""
            if rows is None:
                ids, mask, pos = prompt.input_ids, prompt.attention_mask, prompt.position_ids
            else:
                (b,) = rows
                n = lens[b]
                ids, mask = prompt.input_ids[b : b + 1, :n], np.ones((1, n), np.int64)
                pos = prompt.position_ids[b : b + 1, :n]
            outs = [runner.run(ids, mask, pos, None)]
            for t in range(scenario.steps):
                past = outs[-1][1]
                if rows is None:
                    mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
                    pos = np.array([[n + t] for n in lens], dtype=np.int64)
                    ids = tokens[:, t : t + 1]
                else:
                    mask = np.ones((1, lens[b] + t + 1), np.int64)
                    pos = np.array([[lens[b] + t]], dtype=np.int64)
                    ids = tokens[b : b + 1, t : t + 1]
                outs.append(runner.run(ids, mask, pos, past))
            return outs

        try:
            ref_out = steps(ref, None)
            alone = [steps(ref, [b]) for b in range(batch)]
        except Exception as exc:
            result.error = f"original model failed: {type(exc).__name__}: {_first_line(exc)}"
            return result
        # In contract only if the original computes each padded row as that row alone would.
        for b in range(batch):
            for t in range(1, scenario.steps + 1):
                check = _compare(name, "logits", "logits", alone[b][t][0][0], ref_out[t][0][b], tol)
                if not check.passed:
                    why = (
                        "the padding steps enter its conv/recurrent state"
                        if ref.io.states
                        else "the batch changes its result (e.g. a sliding window over cache "
                        "slots, padding holes included, or LongRoPE's switch on the batch's largest "
                        "position)"
                    )
                    result.skipped = (
                        f"the original's row {b} after its padded prompt differs from the row run "
                        f"alone (max err {check.max_abs_err:.3g}): {why}"
                    )
                    return result
        try:
            opt_out = steps(opt, None)
        except Exception as exc:
            result.error = f"{OPTIMIZED_FAILED} {name}: {_first_line(exc)}"
            return result
        logits = ref.io.logits
        for t in range(1, scenario.steps + 1):
            ref_logits, opt_logits = ref_out[t][0], opt_out[t][0]
            comparison = _compare(name, logits, "logits", ref_logits, opt_logits, tol)
            comparison.note = f"step {t}"
            result.comparisons.append(comparison)
        # The prompt's rows of the final cache: the new tokens sit at different slots (see above).
        ref_presents, opt_presents = ref_out[-1][1], opt_out[-1][1]
        if len(ref_presents) != len(opt_presents):
            result.error = "optimized model has a different number of present outputs"
            return result
        names = present_names(ref.io)
        states = {s.present for s in ref.io.states}
        for present, r, o in zip(names, ref_presents, opt_presents, strict=True):
            if present in states:
                comparison = _compare(name, present, "state", r, o, tol)
            elif r.shape != o.shape:
                comparison = _compare(name, present, "kv", r, o, tol)
            else:
                comparison = _compare(
                    name,
                    present,
                    "kv",
                    np.concatenate([r[b, :, : lens[b]].reshape(-1) for b in range(batch)]),
                    np.concatenate([o[b, :, : lens[b]].reshape(-1) for b in range(batch)]),
                    tol,
                    shape=tuple(r.shape),
                )
            comparison.note = "prompt rows"
            result.comparisons.append(comparison)
        return result


def scenario_positions(scenario: Scenario) -> int:
    """The most positions (past + new) a scenario's steps reach."""
    if scenario.kind == "prompt":
        return max(scenario.lens)
    if scenario.kind == "padded_decode":
        return max(scenario.lens) + scenario.steps
    return scenario.past_len + scenario.new_len


def assert_equivalent(
    original: ModelLike, optimized: ModelLike, **options: Unpack[CompareOptions]
) -> VerificationResult:
    """:func:`compare_models`, raising ``AssertionError`` with the result table on failure."""
    result = compare_models(original, optimized, **options)
    if not result.passed:
        raise AssertionError("optimized model is not equivalent to the original\n" + str(result))
    return result
