"""SimEngine: a faithful simulator of vLLM v1's block pool and scheduler on a virtual clock.

Its cache hits equal vLLM's on the same trace (``tests/test_sim_vs_vllm.py`` checks it); its
timing is a step-time model, ``alpha + beta * prefill_tokens + gamma * decode_seqs`` seconds per
scheduler step, fitted from a real run by ``benchmarks/fit_step_model.py``. The block pool and
scheduler live in :mod:`prefixgate.sim.scheduler`; this module is the async shell: the virtual clock,
the step loop and the :class:`~prefixgate.engine.Engine` surface.

Everything that takes time in a simulation must sleep on ``sim.clock`` (pass it to the
:class:`~prefixgate.Gateway` and to load generators). Virtual time jumps from one event to the
next only once every task on the event loop is blocked, so 100k requests simulate in seconds
and the same inputs always give the same outputs at the same virtual times.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..engine import EngineRequest, KvStats, SamplingCheck, Tokenizer, check_max_tokens
from ..errors import EngineDead, InvalidRequest, PromptTooLong
from ..keys import Namespace
from ..testing import ByteTokenizer, FakeCompletion, FakeOutput, FakeSamplingParams
from .scheduler import OUTPUT_TOKEN, SimRequest, SimScheduler, StepPlan

__all__ = ["SimClock", "SimEngine", "StepTimeModel"]


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds one scheduler step takes: ``alpha + beta * prefill_tokens + gamma * decode_seqs``.

    The default is a guess for an 8B-parameter model on one current datacenter GPU (5 ms per
    step, 20k prefill tokens/s, 40 µs per decoding sequence); fit your own from a real run with
    ``python -m benchmarks.fit_step_model``.

    Attributes:
        alpha: Fixed cost of a step, in seconds.
        beta: Seconds per prefill (or recomputed) token.
        gamma: Seconds per sequence decoding one token.

    Raises:
        ValueError: If a coefficient is negative or not finite, or all are zero.
    """

    alpha: float = 0.005
    beta: float = 5e-5
    gamma: float = 4e-5

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ValueError(f"StepTimeModel.{name} must be a finite number >= 0, got {value!r}")
        if self.alpha == self.beta == self.gamma == 0:
            raise ValueError("StepTimeModel needs a positive coefficient, or virtual time never moves")

    def seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        """The duration of a step with this much prefill and decode work."""
        return self.alpha + self.beta * prefill_tokens + self.gamma * decode_seqs


class SimClock:
    """Virtual time for a discrete-event simulation run by an asyncio event loop.

    Pending events are the deadlines of :meth:`sleep` calls (the engine's steps sleep too). A
    driver task waits until the loop is *quiescent* (no callback ready to run: every task is
    blocked on a future), then moves ``now`` to the earliest deadline and wakes that one
    sleeper, and repeats; when nothing sleeps it exits, and the next :meth:`sleep` restarts it.

    Quiescence is read from the loop's ready queue (``loop._ready``, private but a plain deque
    of ``Handle`` objects in CPython 3.11-3.13) by a probe callback that re-queues itself until
    only probes (of this or another ``SimClock`` on the same loop) are ready. On loops without
    it (uvloop), the probe re-queues ``fallback_yields`` times instead, which is enough for
    shallow await chains only. Work outside the loop (threads, subprocesses, sockets, real
    timers) is not waited for: code under simulation must take all its time from this clock.

    Invariants: ``now()`` never decreases; it changes only while the loop is quiescent; sleepers
    wake in deadline order, ties in the order they began sleeping, one at a time.

    Args:
        start: The initial time in seconds.
        fallback_yields: Yields that stand for quiescence when the ready queue is unreadable.
    """

    def __init__(self, start: float = 0.0, *, fallback_yields: int = 16) -> None:
        self._now = float(start)
        self._events: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._cancelled = 0
        self._driver: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fallback_yields = fallback_yields
        self.events_fired = 0

    def now(self) -> float:
        """The current virtual time in seconds."""
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Suspends the caller until virtual time reaches ``now() + seconds``.

        ``sleep(0)`` is a barrier: it returns at the same virtual time, after every other task
        has run until it blocks.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop: events of the old one can never fire
            self._loop, self._events, self._driver, self._cancelled = loop, [], None, 0
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._events, (self._now + max(0.0, seconds), self._seq, fut))
        self._seq += 1
        if self._driver is None:
            self._driver = loop.create_task(self._drive(loop))
        try:
            await fut
        except asyncio.CancelledError:
            self._cancelled += 1
            if self._cancelled > 1024 and self._cancelled * 2 > len(self._events):
                self._events = [e for e in self._events if not e[2].done()]
                heapq.heapify(self._events)
                self._cancelled = 0
            raise

    def _probe(self, done: asyncio.Future[None], ready: deque[Any] | None, left: int) -> None:
        """A callback that re-queues itself until nothing but probes is ready, then sets ``done``.

        Being a plain callback, not a task step, it lets the probes of several clocks sharing
        one loop recognise each other instead of each seeing the other as pending work.
        """
        if done.done():
            return
        if ready is not None:
            for handle in ready:
                if getattr(getattr(handle, "_callback", None), "__func__", None) is not SimClock._probe \
                        and not handle.cancelled():
                    break
            else:
                done.set_result(None)
                return
        elif left <= 0:  # pragma: no cover - non-CPython event loops
            done.set_result(None)
            return
        done.get_loop().call_soon(self._probe, done, ready, left - 1)

    async def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        ready = getattr(loop, "_ready", None)
        if not isinstance(ready, deque):  # pragma: no cover - non-CPython event loops
            ready = None
        try:
            while True:
                quiescent: asyncio.Future[None] = loop.create_future()
                loop.call_soon(self._probe, quiescent, ready, self._fallback_yields)
                await quiescent
                events = self._events
                while events and events[0][2].done():  # cancelled sleepers: no time passes
                    heapq.heappop(events)
                if not events:
                    return
                when, _, fut = heapq.heappop(events)
                if when > self._now:
                    self._now = when
                self.events_fired += 1
                fut.set_result(None)
        finally:
            if self._driver is asyncio.current_task():
                self._driver = None

    def __repr__(self) -> str:
        return f"SimClock(now={self._now:.6f}, pending={len(self._events)})"


class _Stream:
    """The consumer side of one request: what it has been given and how to wake it."""

    __slots__ = ("delivered", "error", "kind", "waiter")

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "CUMULATIVE", "DELTA" or "FINAL_ONLY", as vLLM's RequestOutputKind
        self.delivered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"SimEngine {name} must be a positive int, got {value!r}")
    return value


class SimEngine:
    """An :class:`~prefixgate.engine.Engine` that simulates vLLM v1 on :attr:`clock`.

    Generation emits token ``7`` ``max_tokens`` times (EOS is ignored). A request's media
    items are not loaded; the blocks they sit in are keyed on their identifiers, as the gateway
    and vLLM key them. Outputs are
    :class:`~prefixgate.testing.FakeOutput` objects, cumulative unless the sampling parameters
    ask for ``output_kind`` ``DELTA`` or ``FINAL_ONLY``; a slow consumer gets the latest state
    (vLLM coalesces the same way). Requests added or aborted while a step runs take effect at
    the next step boundary, as in vLLM's engine core.

    Invariants: at most one step is in flight; virtual time advances only by steps and
    sleepers; with no request live the step loop has exited (no task polls).

    Args:
        block_size: Tokens per KV block.
        num_blocks: KV blocks, the null block included (vLLM's ``num_gpu_blocks``).
        max_num_seqs: The most running requests.
        max_num_batched_tokens: Tokens one step may schedule (chunked prefill budget).
        max_model_len: The longest prompt + output.
        enable_caching: Automatic prefix caching on or off.
        step_time: How long a step takes in virtual seconds.
        tokenizer: Returned by :attr:`tokenizer`; a :class:`~prefixgate.testing.ByteTokenizer`
            when ``None``.
        model_name: The served model's name.
        clock: The virtual clock; a new :class:`SimClock` when ``None``.
        on_step: Called after each step with its start time, its duration and its
            :class:`~prefixgate.sim.scheduler.StepPlan` (for instrumentation).

    Raises:
        ValueError: If a size is not a positive int, or one ``max_model_len`` sequence does not
            fit in the pool (vLLM refuses to start then).
    """

    def __init__(self, *, block_size: int = 16, num_blocks: int = 4096, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int = 32768,
                 enable_caching: bool = True, step_time: StepTimeModel | None = None,
                 tokenizer: Tokenizer | None = None, model_name: str = "sim",
                 clock: SimClock | None = None,
                 on_step: Callable[[float, float, StepPlan], None] | None = None) -> None:
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            _positive_int(name, value)
        if (num_blocks - 1) * block_size < max_model_len:
            raise ValueError(f"SimEngine max_model_len={max_model_len} does not fit in {num_blocks - 1} "
                             f"usable blocks of {block_size} tokens; raise num_blocks or lower "
                             "max_model_len")
        self._core = SimScheduler(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, enable_caching=bool(enable_caching))
        self.step_time = step_time or StepTimeModel()
        self.clock = clock or SimClock()
        self._tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self._model_name = model_name
        self._inputs: list[SimRequest | str] = []  # adds and abort ids, applied between steps
        self._live: dict[str, SimRequest] = {}
        self._task: asyncio.Task[None] | None = None
        self._stats: KvStats | None = None
        self._dead: BaseException | None = None
        self._on_step = on_step

    # -- Engine properties --------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks requests can use: the pool less vLLM's null block (as ``VllmEngine`` reports)."""
        return self._core.pool.num_blocks - 1

    @property
    def max_num_seqs(self) -> int:
        """The most requests run at once."""
        return self._core.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def num_preemptions(self) -> int:
        """Requests preempted (and later recomputed) so far."""
        return self._core.num_preemptions

    @property
    def scheduler(self) -> SimScheduler:
        """The synchronous core: block pool, queues and counters (read it, do not drive it)."""
        return self._core

    def default_sampling_params(self) -> FakeSamplingParams:
        return FakeSamplingParams()

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        """Accepts any object with an int-or-``None`` ``max_tokens`` (vLLM's or the fakes').

        The prefix cache is skipped, as vLLM does, when ``skip_reading_prefix_cache`` is true or,
        absent that attribute, when ``prompt_logprobs`` is set.
        """
        if not hasattr(sampling_params, "max_tokens"):
            raise InvalidRequest(f"sampling_params of type {type(sampling_params).__name__} has no "
                                 "max_tokens attribute")
        max_tokens = check_max_tokens(sampling_params.max_tokens)
        skip = getattr(sampling_params, "skip_reading_prefix_cache", None)
        if skip is None:
            skip = getattr(sampling_params, "prompt_logprobs", None) is not None
        return SamplingCheck(max_tokens=max_tokens, reads_cache=not skip)

    def kv_stats(self) -> KvStats | None:
        return self._stats

    # -- requests -----------------------------------------------------------------------------

    def _make_request(self, request: EngineRequest) -> SimRequest:
        check = self.check_sampling_params(request.sampling_params)
        if request.request_id in self._live:
            raise InvalidRequest(f"request_id {request.request_id!r} is already running")
        prompt = tuple(request.prompt_token_ids)
        n, limit = len(prompt), self.max_model_len - 1
        if n == 0:
            raise InvalidRequest("prompt is empty")
        if n > limit:
            raise PromptTooLong(f"prompt has {n} tokens; the model takes at most {limit}",
                                num_tokens=n, limit=limit)
        lora = getattr(request.lora_request, "lora_name", None) if request.lora_request else None
        namespace = Namespace(self._model_name, lora, request.cache_salt or None)
        max_tokens = check.max_tokens if check.max_tokens is not None else self.max_model_len - n
        try:
            media = [(m.position, m.identifier) for m in request.media or () if m.position is not None]
            sim_request = SimRequest(request.request_id, prompt, max_tokens, namespace,
                                     reads_cache=check.reads_cache, block_size=self.block_size,
                                     hash_prompt=self._core.enable_caching, media=media)
        except ValueError as e:
            raise InvalidRequest(f"bad prompt token ids: {e}") from None
        kind = getattr(getattr(request.sampling_params, "output_kind", None), "name", "CUMULATIVE")
        sim_request.stream = _Stream(kind if kind in ("DELTA", "FINAL_ONLY") else "CUMULATIVE")
        return sim_request

    async def generate(self, request: EngineRequest) -> AsyncIterator[FakeOutput]:
        """Queues ``request`` and streams its outputs; the last one has ``finished`` set.

        Raises:
            InvalidRequest: Bad sampling parameters, empty prompt, duplicate live request id.
            PromptTooLong: The prompt leaves no room for an output token.
            EngineDead: The simulator failed (a bug); it accepts no more requests.
        """
        if self._dead is not None:
            raise EngineDead("the simulator has failed") from self._dead
        req = self._make_request(request)
        stream: _Stream = req.stream
        self._live[req.request_id] = req
        self._inputs.append(req)
        self._kick()
        try:
            while True:
                if stream.error is not None:
                    raise EngineDead(f"simulator failed serving {req.request_id}") from stream.error
                done = req.finished
                if done or (req.num_output > stream.delivered and stream.kind != "FINAL_ONLY"):
                    yield self._output(req, stream, done)
                    if done:
                        return
                    continue
                waiter = asyncio.get_running_loop().create_future()
                stream.waiter = waiter
                await waiter
        finally:
            stream.waiter = None
            if self._live.get(req.request_id) is req:
                del self._live[req.request_id]
                if not req.finished:
                    self._inputs.append(req.request_id)
                    self._kick()

    @staticmethod
    def _output(req: SimRequest, stream: _Stream, done: bool) -> FakeOutput:
        n = req.num_output
        first = stream.delivered if stream.kind == "DELTA" else 0
        stream.delivered = n
        completion = FakeCompletion((OUTPUT_TOKEN,) * (n - first),
                                    finish_reason=req.finish_reason if done else None)
        return FakeOutput(req.request_id, req.prompt, (completion,), done, req.num_cached_tokens or 0)

    async def abort(self, request_id: str) -> None:
        """Aborts ``request_id`` at the next step boundary; its stream ends with an abort output."""
        if request_id in self._live:
            self._inputs.append(request_id)
            self._kick()

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached block, as vLLM's ``reset_prefix_cache``.

        Returns:
            ``False`` (and nothing is dropped) while any request holds blocks.
        """
        return self._core.reset_prefix_cache()

    # -- the step loop ------------------------------------------------------------------------

    def _kick(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run())

    def _apply_inputs(self) -> None:
        core, inputs = self._core, self._inputs
        self._inputs = []
        for item in inputs:
            if isinstance(item, SimRequest):
                if self._live.get(item.request_id) is item:
                    core.add_request(item)
            elif (aborted := core.abort(item)) is not None:
                aborted.stream.wake()

    async def _run(self) -> None:
        clock, core = self.clock, self._core
        idle_steps = 0
        try:
            while True:
                await clock.sleep(0)  # barrier: everything due now submits before the step starts
                self._apply_inputs()
                if not core.has_work():
                    return
                plan = core.schedule()
                if not plan.scheduled:
                    # Only a step that preempted its sole runner schedules nothing; the next
                    # one readmits it. Two in a row would mean a bug, not a busy engine.
                    idle_steps += 1
                    if idle_steps > 1:
                        raise RuntimeError(f"scheduler made no progress: {core!r}")
                    self._record()
                    continue
                idle_steps = 0
                start, seconds = clock.now(), self.step_time.seconds(plan.prefill_tokens, plan.decode_seqs)
                await clock.sleep(seconds)
                for req in core.update(plan):
                    req.stream.wake()
                self._record()
                if self._on_step is not None:
                    self._on_step(start, seconds, plan)
        except Exception as e:  # a bug in the simulator: fail every stream, accept no more
            self._dead = e
            for req in list(self._live.values()):
                req.stream.error = e
                req.stream.wake()
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    def _record(self) -> None:
        core = self._core
        # vLLM's kv_cache_usage is 1 - free / (pool - null block); VllmEngine inverts it exactly.
        self._stats = KvStats(
            time=self.clock.now(), total_blocks=core.pool.num_blocks - 1, free_blocks=core.pool.num_free,
            running=len(core.running), waiting=len(core.waiting), prefix_queries=core.prefix_queries,
            prefix_hits=core.prefix_hits, preemptions=core.num_preemptions, steps=core.steps)

    def __repr__(self) -> str:
        return (f"SimEngine(block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"live={len(self._live)}, now={self.clock.now():.6f}, {self._core!r})")

