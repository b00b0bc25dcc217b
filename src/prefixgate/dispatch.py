"""Stage 5: the dispatcher, the async shell that carries out the scheduler's decisions.

A prepared ticket is admitted here (the admission policy, its tenant's rate, load shedding in
shedding.py, the bounded queue), waits for the scheduler to dispatch it (the pump runs once per
loop iteration, so a burst is ordered as one), and is served: the engine's outputs stream to the
caller unchanged, and however the stream ends (completion, error, the consumer cancelled or
closed it, the engine stalled or died, the gateway closed) the ticket's reservations are released
and, if the engine had it, the engine request is aborted. The decisions themselves are made by
the pure stages (queueing.py, admission.py, shedding.py); the replica (replica.py) holds the
engine and what the gateway knows of it.

Nothing waits unbounded: a decision that fails fails only its own ticket; a dead engine fails
every queued request at once; aborts are bounded in time and their errors logged, not raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from .clock import Clock
from .config import GatewayConfig
from .engine import Completion, EngineRequest
from .errors import (
    EngineDead,
    EngineError,
    Outcome,
    Overloaded,
    PrefixgateError,
    QueueFull,
    QueueTimeout,
    RateLimited,
    Reason,
    Rejected,
    ShuttingDown,
)
from .ingress import IngressRequest
from .policies import AdmissionGate
from .queueing import Scheduler
from .ratelimit import RateLimiter, TenantThrottles
from .replica import Replica
from .shedding import LoadShedder
from .statistics import StatsRecorder
from .streaming import ResponseStream
from .tickets import Ticket, TicketState

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)

ABORT_TIMEOUT = 5.0  # real seconds an engine abort may take before it is given up (and logged)


class Dispatcher:
    """Admits tickets, carries out the scheduler's dispatches and serves them on one replica.

    Invariant: every request id in :attr:`live` belongs to a stream that has not ended; a ticket
    leaves the scheduler and is counted in the statistics exactly once (:meth:`release`), as
    soon as its outcome is known.

    Args:
        replica: The engine the tickets are served on.
        scheduler: Decides which waiting ticket goes next (over ``replica``'s ledger).
        config: The gateway's configuration.
        clock: The gateway's clock.
        stats: The gateway's counters.
        prepare: Prepares a request off the event loop (or inline) into its ticket.
        gate: Runs the configured ``AdmissionPolicy``, if any: consulted before rate limits and
            the queue, told of every ticket it admitted once that ticket ends.
        live: The request ids of live streams, when several dispatchers (one per replica) share
            one gateway's; a dict of its own when ``None``.
        throttles: The tenants' rate limiters, likewise shared; its own when ``None``.

    Attributes:
        live: Request ids of streams not yet ended, with their ticket once prepared.
        closing: The gateway is closing: nothing more is admitted.
        throttles: Per-tenant rate limiters.
        shedder: Refuses what would wait too long; prices refusals' ``retry_after``.
    """

    def __init__(self, replica: Replica, scheduler: Scheduler, *, config: GatewayConfig, clock: Clock,
                 stats: StatsRecorder, prepare: Callable[[IngressRequest], Awaitable[Ticket]],
                 gate: AdmissionGate | None = None, live: dict[str, Ticket | None] | None = None,
                 throttles: TenantThrottles | None = None) -> None:
        self.replica = replica
        self.scheduler = scheduler
        self.config = config
        self.clock = clock
        self.stats = stats
        self._prepare = prepare
        self.gate = gate
        self.live: dict[str, Ticket | None] = {} if live is None else live
        self.closing = False
        self.throttles = (TenantThrottles(config.tenants, config.default_tenant_limits, clock)
                          if throttles is None else throttles)
        self.on_release: Callable[[Ticket], None] | None = None
        """Called with each ticket as it ends (the router's placement bookkeeping)."""
        self.holds_admission: Callable[[Ticket], bool] | None = None
        """Whether an ending ticket's admission is held for it to be placed again (the router's
        failover and moves; see :meth:`AdmissionGate.hold`) rather than released now."""
        self.shedder = LoadShedder(scheduler, replica.admission, slots=replica.slots,
                                   max_queue_wait=config.max_queue_wait)
        self._pump_scheduled = False
        self._idle = asyncio.Event()
        self._idle.set()
        replica.watch(scheduler.running, self.kill)
        watch_health = getattr(replica.engine, "watch_health", None)
        if watch_health is not None:
            watch_health(self._on_health)

    # -- admission --------------------------------------------------------------------------

    def check_open(self) -> None:
        """Raises ``ShuttingDown`` while closing, ``EngineDead`` once the engine died."""
        if self.closing:
            raise ShuttingDown("gateway is shutting down")
        if self.replica.dead is not None:  # checked here first: this runs for every request
            self.replica.check_alive()

    async def _wait_for_rate(self, throttle: RateLimiter, ticket: Ticket) -> None:
        """Waits for ``ticket``'s slot of its tenant's rate, counted as queued and bounded by
        ``max_queue_len`` and ``queue_timeout`` (on the gateway's clock)."""
        limit = self.config.max_queue_len
        if self.scheduler.num_waiting + self.scheduler.outside >= limit and self._pump_scheduled:
            self._pump_now()  # count what still waits after the pending dispatch (as enqueue does)
        if self.scheduler.num_waiting + self.scheduler.outside >= limit:
            wait = self.replica.admission.estimated_wait(self.scheduler.num_waiting)
            raise QueueFull(f"waiting queue is full ({self.config.max_queue_len} requests)",
                            retry_after=max(wait or 0.0, throttle.retry_after()),
                            reason=Reason.QUEUE_FULL)
        self.scheduler.outside += 1
        acquire = asyncio.ensure_future(throttle.acquire())
        waits: set[asyncio.Future[Any]] = {acquire}
        if self.config.queue_timeout is not None:
            left = ticket.arrival + self.config.queue_timeout - self.clock.now()
            waits.add(asyncio.ensure_future(self.clock.sleep(max(0.0, left))))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.scheduler.outside -= 1
            for w in waits:
                if w is not acquire or not w.done():
                    w.cancel()
        if not acquire.done() or acquire.cancelled():
            raise QueueTimeout(f"{ticket.request_id} waited over {self.config.queue_timeout} s "
                               "for its tenant's rate")
        acquire.result()

    async def admit(self, ticket: Ticket, *, again: bool = False) -> None:
        """Consults the admission policy, rate-limits, load-checks and queues ``ticket`` (the
        blocking path). ``again``: the request was admitted once and is placed again (see
        :meth:`AdmissionGate.hand_over`): neither the policy nor its tenant's rate is asked again."""
        try:
            self.check_open()
            if self.gate is not None and not (again and ticket in self.gate.admitted):
                self.gate.check(ticket)
            throttle = None if again else self.throttles.get(ticket.tenant)
            if throttle is not None and not throttle.try_acquire():
                if self.throttles.limits(ticket.tenant).on_limit == "refuse":
                    raise RateLimited(f"tenant {ticket.tenant!r} is over its request rate",
                                      retry_after=throttle.retry_after(), reason=Reason.RATE_LIMITED)
                await self._wait_for_rate(throttle, ticket)
                self.check_open()
            self.shedder.check(ticket)
            try:
                self.scheduler.enqueue(ticket)
            except QueueFull:
                if not self._pump_scheduled:
                    raise  # every waiting request was already offered to the engine: truly full
                # Arrivals of this loop iteration wait for the pump: run it now and count what
                # still waits after it, so an idle gateway takes a burst it can dispatch.
                self._pump_now()
                self.scheduler.enqueue(ticket)
        except (Rejected, ShuttingDown, EngineDead, QueueTimeout) as e:
            self.stats.refuse(e.outcome, getattr(e, "reason", None))
            ticket.end(e.outcome)
            raise
        finally:
            if self.gate is not None and ticket.state is TicketState.NEW:
                self.gate.release(ticket)  # refused or cancelled after the policy admitted it
        self.stats.accept(ticket)

    def dispatch_now(self, ticket: Ticket) -> None:
        """Dispatches ``ticket`` at once or raises (the non-blocking path); a refused request
        does not use up a slot of its tenant's rate.

        Raises:
            Overloaded: It does not fit now, or requests already wait.
            RateLimited: Its tenant's rate is used up.
            AdmissionRefused: The admission policy refused it.
        """
        try:
            self._dispatch_now(ticket)
        except PrefixgateError as e:
            if self.gate is not None:
                ticket.end(e.outcome)
                self.gate.release(ticket)  # admitted by the policy, refused after it
            raise

    def _dispatch_now(self, ticket: Ticket) -> None:
        if self.scheduler.num_waiting:
            raise self.shedder.overloaded(Reason.QUEUED_AHEAD)
        throttle = self.throttles.get(ticket.tenant)
        if throttle is not None and throttle.retry_after() > 0:
            raise RateLimited(f"tenant {ticket.tenant!r} is over its request rate",
                              retry_after=throttle.retry_after(), reason=Reason.RATE_LIMITED)
        if self.gate is not None:
            self.gate.check(ticket)
        self.scheduler.enqueue(ticket)
        self._pump_now()
        if ticket.state is not TicketState.RUNNING:
            self.scheduler.finish(ticket)
            if ticket.failure is not None:
                raise ticket.failure
            raise self.shedder.overloaded(self.scheduler.blocked or Reason.KV_RESERVED)
        if throttle is not None:
            throttle.try_acquire()  # only a request that runs uses up a slot of the rate

    def can_dispatch(self, ticket: Ticket) -> bool:
        """Whether :meth:`dispatch_now` would dispatch ``ticket`` now. Pure."""
        throttle = self.throttles.get(ticket.tenant)
        scheduler = self.scheduler
        if self.closing or self.replica.dead is not None or scheduler.num_waiting or (
                throttle is not None and throttle.retry_after() > 0):
            return False
        if scheduler.max_in_flight is not None and len(scheduler.running) >= scheduler.max_in_flight:
            return False
        if scheduler.backlog_full:
            return False
        admission = self.replica.admission
        return admission.fits(admission.need(ticket))

    # -- the pump ---------------------------------------------------------------------------

    def schedule_pump(self) -> None:
        """Pumps at the end of this loop iteration, so a burst of arrivals is ordered as one."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_now)

    def _pump_now(self) -> None:
        """Carries out the scheduler's decisions: grants the tickets it dispatches, fails those
        whose reservation failed. Never raises: a request's failure is its own."""
        self._pump_scheduled = False
        scheduler = self.scheduler
        try:
            dispatches = scheduler.next_batch()
        except Exception as e:  # a bug in a decision: fail what waits rather than strand it
            log.exception("prefixgate: the scheduler failed; failing every queued request")
            for ticket in scheduler.waiting():
                self.fail(ticket, EngineError(f"the gateway's scheduler failed: {e}"))
            return
        for dispatch in dispatches:
            granted = dispatch.ticket.granted
            if granted is not None and not granted.done():
                granted.set_result(None)
        if scheduler.failed:
            failed, scheduler.failed = scheduler.failed, []
            for ticket, error in failed:
                self.fail(ticket, EngineError(f"could not reserve KV blocks for "
                                              f"{ticket.request_id}: {error}"))

    def fail(self, ticket: Ticket, error: PrefixgateError) -> None:
        """Ends a ticket that has not reached the engine with ``error``."""
        if ticket.state is TicketState.QUEUED:
            self.scheduler.finish(ticket)
        ticket.fail(error)
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

    # -- serving ----------------------------------------------------------------------------

    async def enter(self, stream: ResponseStream,
                    admit: Callable[[Ticket], Awaitable[Any]] | None = None) -> None:
        """Prepares (if not yet) and admits (if not dispatched at the call) ``stream``'s request:
        every refusal is raised here. Once. ``admit`` replaces this dispatcher's admission and
        pump (a router places the ticket on a replica there)."""
        request, ticket = stream.request, stream.ticket
        try:
            if ticket is None:
                try:
                    ticket = await self._prepare(request)
                except PrefixgateError as e:
                    self.stats.refuse(e.outcome)
                    raise
                stream._prepared(ticket)
                self.live[request.request_id] = ticket
            if not stream.admitted:
                if admit is not None:
                    await admit(ticket)
                else:
                    await self.admit(ticket)
                    self.schedule_pump()
        except BaseException:
            self.live.pop(request.request_id, None)
            raise
        stream._mark_entered()

    async def serve(self, stream: ResponseStream) -> AsyncGenerator[Any, None]:
        """Prepares (if not yet), queues, dispatches and streams one request; releases
        everything it held on exit."""
        if not stream.entered:
            await self.enter(stream)
        ticket = stream.ticket
        assert ticket is not None
        admitted = stream.admitted
        dispatched = admitted
        replica = self.replica
        try:
            if not admitted:
                self.schedule_pump()
                await asyncio.sleep(0)  # the pump runs first: a burst is ordered as one
                if ticket.failure is not None:
                    raise ticket.failure
                if ticket.state is not TicketState.RUNNING:
                    await self._wait_for_grant(ticket)
            if replica.dead is not None:
                replica.check_alive()
            dispatched = True
            ticket.task = asyncio.current_task()
            replica.arm_watchdog()
            sampling_params = ticket.sampling_params
            outputs = replica.engine.generate(EngineRequest(
                ticket.request_id, ticket.prompt_token_ids, sampling_params, ticket.cache_salt,
                ticket.lora_request, ticket.priority, ticket.media))
            try:
                pull = outputs.__anext__
                completion = replica.completion
                while True:
                    ticket.in_engine = True
                    try:
                        out = await pull()
                    except StopAsyncIteration:
                        break
                    finally:
                        ticket.in_engine = False
                    replica.outputs += 1
                    if ticket.first_output_at is None:
                        ticket.first_output(self.clock.now())
                        if self.scheduler.started(ticket):
                            self.schedule_pump()
                    done = completion(out, sampling_params)
                    if done is not None:
                        if done.aborted:  # by our own aclose(timeout), or behind our back
                            if self.closing:
                                raise ShuttingDown(f"{ticket.request_id} aborted: gateway closed")
                            raise EngineError(f"the engine aborted {ticket.request_id}")
                        self._on_complete(ticket, done)  # before the yield: callers may stop here
                    if ticket.kill is not None:
                        raise ticket.kill
                    yield out
                    if ticket.kill is not None:
                        raise ticket.kill
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]
            if ticket.outcome is not Outcome.COMPLETED:
                if self.closing:
                    raise ShuttingDown(f"{ticket.request_id} aborted: gateway closed")
                raise EngineError(f"engine ended {ticket.request_id} without a finished output")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            kill = ticket.kill
            if kill is not None and task is not None and task.uncancel() == 0:
                ticket.end(kill.outcome)  # ended by the gateway (stall, aclose)
                raise kill from None
            if task is not None and task.cancelling() == 0 and ticket.outcome is not Outcome.COMPLETED:
                ticket.end(Outcome.ENGINE_ERROR)  # the engine raised it; nobody cancelled us
                raise EngineError(f"the engine cancelled {ticket.request_id}") from None
            if ticket.outcome is not Outcome.COMPLETED:
                ticket.end(Outcome.CANCELLED)
            raise
        except GeneratorExit:
            if ticket.outcome is not Outcome.COMPLETED:
                ticket.end(Outcome.CANCELLED)
            raise
        except EngineDead as e:
            ticket.end(e.outcome)
            self._on_dead(e)
            raise
        except Overloaded as e:  # the engine's own admission limit (vLLM's max_num_queued_reqs)
            refusal = self.shedder.overloaded(Reason.ENGINE_BUSY) if e.reason is Reason.ENGINE_BUSY else e
            ticket.end(refusal.outcome)
            if refusal is e:
                raise
            raise refusal from e
        except PrefixgateError as e:
            ticket.end(e.outcome)
            raise
        except Exception as e:
            ticket.end(Outcome.ENGINE_ERROR)
            raise EngineError(f"engine failed on {ticket.request_id}: {e}") from e
        finally:
            if ticket.outcome is None:  # pragma: no cover - every path above sets it
                ticket.end(Outcome.ENGINE_ERROR)
            ticket.task = None
            self.release(ticket)
            try:
                if dispatched and ticket.outcome is not Outcome.COMPLETED and replica.dead is None:
                    await self.abort(ticket.request_id)
            finally:
                self.live.pop(ticket.request_id, None)

    async def abort(self, request_id: str) -> None:
        """Aborts ``request_id`` in the engine, giving up (and logging) after a few seconds or
        on any error: ending a request must not depend on the engine answering."""
        try:
            await asyncio.wait_for(self.replica.engine.abort(request_id), ABORT_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.warning("prefixgate: aborting %s in the engine failed: %r", request_id, e)

    def kill(self, ticket: Ticket, error: PrefixgateError) -> None:
        """Ends a running ticket's stream with ``error``: at once if its consumer is waiting on
        the engine, else when it next asks for an output."""
        if ticket.doom(error):
            task = ticket.task
            if ticket.in_engine and task is not None and not task.done():
                task.cancel()

    def _on_dead(self, error: EngineDead) -> None:
        """The engine died: refuse everything from now on and fail what waits at once."""
        if self.replica.mark_dead(error):
            log.warning("prefixgate: %r is out: %s", self.replica.engine, error)
            for ticket in self.scheduler.waiting():
                self.fail(ticket, EngineDead("the engine has died"))

    def _on_health(self, healthy: bool) -> None:
        """An engine that reports health checks (``Engine.watch_health``): failing them takes
        the replica out as a death would (what waits for it fails with ``EngineDead``, which a
        router re-places); passing them again takes it back."""
        if self.closing:
            return
        if not healthy:
            if self.replica.dead is None:
                self._on_dead(EngineDead("the engine failed its health checks"))
        elif self.replica.revive():
            log.warning("prefixgate: %r is back", self.replica.engine)

    def release(self, ticket: Ticket) -> None:
        """Ends ``ticket``: frees its queue slot or window slot and blocks, counts its outcome,
        and dispatches what now fits. Idempotent; runs as soon as the outcome is known."""
        if ticket.finished_at is not None:  # runs twice for most requests: the check comes first
            return
        ticket.close(self.clock.now())
        scheduler = self.scheduler
        scheduler.finish(ticket)
        self.stats.end(ticket)
        if self.gate is not None:
            if self.holds_admission is not None and self.holds_admission(ticket):
                self.gate.hold(ticket)
            else:
                self.gate.release(ticket)
        if self.on_release is not None:
            self.on_release(ticket)
        if not scheduler.running:
            self._idle.set()
            self.replica.idle()
        if scheduler.num_waiting:
            self._pump_now()

    def forget(self, stream: ResponseStream) -> None:
        """Ends a stream that was never iterated: frees its id and, for a stream admitted at
        the call (``submit``, ``try_generate``), its place in the queue or its reservations."""
        ticket = stream.ticket
        if stream.entered and ticket is not None and (  # try_generate's streams are entered too
                ticket.state in (TicketState.QUEUED, TicketState.RUNNING)):
            ticket.end(Outcome.CANCELLED)
            with contextlib.suppress(RuntimeError):  # no running loop (interpreter teardown)
                self.release(ticket)
        elif ticket is not None and self.gate is not None:
            self.gate.release(ticket)  # failed while unread (aclose, a dead engine)
        self.live.pop(stream.request.request_id, None)

    def _on_complete(self, ticket: Ticket, done: Completion) -> None:
        """Records the finished output and frees the ticket's engine slot at once: the
        consumer may take its time with the last output, the next request need not wait."""
        token_ids = done.token_ids
        if token_ids is None:
            ticket.complete(done.cached_tokens, ())
        else:
            ticket.complete(done.cached_tokens, tuple(token_ids))
            self.replica.cache_output(ticket)
        self.release(ticket)

    # -- closing ----------------------------------------------------------------------------

    async def close(self, timeout: float | None) -> None:
        """Stops admitting, ends queued requests with ``ShuttingDown``, waits up to ``timeout``
        seconds for running ones, then aborts what is left and ends its streams."""
        self.closing = True
        self.replica.draining = True
        self.throttles.close(ShuttingDown("gateway is shutting down"))
        for ticket in self.scheduler.waiting():
            self.fail(ticket, ShuttingDown("gateway is shutting down"))
        if self.scheduler.running:
            self._idle.clear()
            idle = asyncio.ensure_future(self._idle.wait())
            waits: set[asyncio.Future[Any]] = {idle}
            if timeout is not None:  # on the gateway's clock: the simulator's time is virtual
                waits.add(asyncio.ensure_future(self.clock.sleep(timeout)))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            left = list(self.scheduler.running)
            if left:
                await asyncio.gather(*(self.abort(t.request_id) for t in left))
                tasks = [t.task for t in left if t.task is not None and not t.task.done()]
                for ticket in left:
                    self.kill(ticket, ShuttingDown(f"{ticket.request_id} aborted: gateway closed"))
                if tasks:
                    await asyncio.wait(tasks, timeout=ABORT_TIMEOUT)
        self.replica.disarm_watchdog()

    def __repr__(self) -> str:
        return (f"Dispatcher(queued={self.scheduler.num_waiting}, running={len(self.scheduler.running)}, "
                f"live={len(self.live)}, closing={self.closing})")
