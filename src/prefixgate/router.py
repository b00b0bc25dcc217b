"""Stage 5 over several engines: place each request on a replica, then queue and serve it there.

A gateway over several engines holds one :class:`Unit` per engine (its
:class:`~prefixgate.replica.Replica`, :class:`~prefixgate.queueing.Scheduler` and
:class:`~prefixgate.dispatch.Dispatcher`, as a one-engine gateway holds one) and a
:class:`Router` in front of them, which the gateway uses as it would use a dispatcher. The router
places a prepared request with the configured policy (:mod:`prefixgate.placement`); from there
that replica's dispatcher admits, queues, dispatches and streams it. The units share the
gateway's statistics, admission policy, tenant rate limits and request ids.

Deferred placement: a policy with a ``defer(ticket, replicas, saturated)`` method (the default
``cost`` has one) may hold a request back before it is placed. Held requests wait in the
router, counted in the gateway's ``queued``, and are let go together (each then placed in arrival
order) once none has joined them for the policy's ``defer_quiet`` seconds (10 ms), a live
replica's queue empties (or a request arrives while one is empty, unless it came within
``defer_quiet`` of the first after a lull: early in a burst), ``defer_seconds`` (1 s) pass since
the first, or the gateway closes;
the policy's ``released(burst)`` (if any) is told whether it was the first (the burst had
arrived), and every replica's circular walk then starts again from its smallest key. A held
request meets admission (the admission policy, its tenant's rate, the queue's bounds) when it is
let go, so a refusal may come up to that long after its arrival, still before any output;
``queue_timeout`` counts the time held. At most 4,096 are held at once. A request cancelled
while held leaves nothing behind; one let go by the close meets the close like any queued one.

Failover: a dead replica is skipped by placement from then on. A request it had given no output
yet when it died (waiting in its queue, or in the engine before its first token) is placed again
on a live one, its arrival kept so aging still sees how long it waited; a request already
streaming from it ends with ``EngineDead``, as with one engine. A request placed again (failover,
or a move: ``GatewayConfig.move_to_stored``) keeps the admission it had: the admission policy is
not asked again nor told of the first ticket (it hears of the request once, when it ends), and
its tenant's rate is not charged again; the new replica's queue bounds and load shedding apply.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import statistics
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from .dispatch import Dispatcher
from .errors import EngineDead, EngineError, Outcome, PrefixgateError, ShuttingDown
from .placement import PlacementPolicy, ReplicaState
from .queueing import Scheduler
from .replica import Replica
from .statistics import ReplicaStatistics, StatsRecorder
from .streaming import ResponseStream
from .tickets import Ticket, TicketState

__all__ = ["Router", "Unit"]

log = logging.getLogger(__name__)

_POOL_LIMIT = 4096
"""Requests held back to be placed at most at once; past it, requests are placed as they come."""


class _Moved(EngineError):
    """A waiting request goes back to placement (:meth:`Router._stored`); caught by
    :meth:`Router.serve`, which places it again, or, if the gateway closed meanwhile, ends it
    with ``ShuttingDown`` (so counted as that)."""

    outcome = Outcome.SHUTTING_DOWN


@dataclass(slots=True)
class Unit:
    """One replica and what serves it: its own queue and dispatcher."""

    replica: Replica
    scheduler: Scheduler
    dispatcher: Dispatcher
    state: ReplicaState


class Router:
    """Places requests on replicas and serves them through each replica's dispatcher.

    Offers what the gateway uses of a :class:`~prefixgate.dispatch.Dispatcher` (``live``,
    ``check_open``, ``enter``, ``serve``, ``forget``, ``dispatch_now``, ``can_dispatch``,
    ``close``, ``closing``).

    Invariant: a ticket is counted in its replica's ``load`` and ``pending_tokens`` from its
    placement until it ends (the dispatcher's ``release``) or its admission fails.

    Args:
        units: The replicas, each with its scheduler and dispatcher (sharing ``live``, the
            statistics, the admission gate and the tenants' rate limits).
        policy: Chooses a replica for each request.
        stats: The gateway's counters.
        live: The request ids of live streams (the dispatchers' shared dict).
        move_to_stored: Place a request waiting cold on one replica again when another
            replica's engine reports its prefix stored (see ``GatewayConfig.move_to_stored``).
    """

    def __init__(self, units: Sequence[Unit], policy: PlacementPolicy, *, stats: StatsRecorder,
                 live: dict[str, Ticket | None], move_to_stored: bool = False) -> None:
        if not units:
            raise ValueError("a router needs at least one replica")
        self.units = list(units)
        self.states = [u.state for u in self.units]
        self.policy = policy
        self.stats = stats
        self.live = live
        self._placed: dict[Ticket, tuple[Unit, int]] = {}  # ticket -> (its unit, its pending tokens)
        # Requests waiting to be placed (the policy's ``defer``), in arrival order, each with the
        # future that lets it go on: while every replica has requests waiting, and at most
        # ``defer_seconds`` (the policy's; 1 s if it has none).
        self._pool: dict[Ticket, asyncio.Future[None]] = {}
        self._pool_timer: asyncio.Task[None] | None = None
        self._defer = getattr(policy, "defer", None)
        self._released = getattr(policy, "released", None)
        self.defer_seconds = float(getattr(policy, "defer_seconds", 1.0))
        self.defer_quiet = float(getattr(policy, "defer_quiet", 0.01))
        self._pool_since = 0.0
        self._pool_last = 0.0
        # The first arrival after none came for defer_quiet (a burst's start), and the last one.
        self._burst_since = -math.inf
        self._last_arrival = -math.inf
        self.gate = self.units[0].dispatcher.gate
        for unit in self.units:
            unit.dispatcher.on_release = self._unplace
            if len(self.units) > 1:
                unit.dispatcher.holds_admission = self._may_place_again
            if move_to_stored and len(self.units) > 1:
                unit.state.mirror.learned.append(functools.partial(self._stored, unit))

    def _stored(self, where: Unit, keys: Sequence[Any]) -> None:
        """``where``'s engine reported it stored ``keys`` (its mirror learned them). The
        requests waiting cold on another live replica whose prefix's first half is one of them,
        where nothing of it is cached or running, go back to placement (see
        :meth:`serve`), which now finds them warm on ``where``; not while closing, nor while
        ``where``'s queue is full."""
        if self.closing or not where.scheduler.has_room:
            return
        for unit in self.units:
            if unit is where or not unit.state.alive:
                continue
            watched = unit.scheduler.watched
            if not watched:
                continue
            for key in keys:
                tickets = watched.get(key)
                if not tickets or unit.state.mirror.holds(key) or unit.replica.admission.ledger.held((key,)):
                    continue
                for ticket in list(tickets):  # failing one dequeues it (and unwatches it)
                    if ticket.state is TicketState.QUEUED:
                        unit.dispatcher.fail(ticket, _Moved(f"{ticket.request_id} is placed again"))

    def _may_place_again(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` ended in a way :meth:`serve` may answer by placing its request
        again (moved, or its replica died before its first output): its admission is then held
        for the new ticket (:meth:`AdmissionGate.hold`), or settled if it is not."""
        error = ticket.failure or ticket.kill
        return (isinstance(error, _Moved | EngineDead) and ticket.first_output_at is None
                and not self.closing)

    @property
    def closing(self) -> bool:
        """Whether the gateway is closing (nothing more is admitted)."""
        return self.units[0].dispatcher.closing

    def _refresh(self) -> bool:
        """Marks dead replicas out of placement; whether any replica is alive."""
        alive = False
        for unit in self.units:
            now = unit.replica.dead is None
            if now and not unit.state.alive:  # back (a remote server): what was placed there is gone
                unit.state.placed_chains.clear()
            unit.state.alive = now
            alive = alive or now
        return alive

    def check_open(self) -> None:
        """Raises ``ShuttingDown`` while closing, ``EngineDead`` once every replica has died."""
        if self.closing:
            raise ShuttingDown("gateway is shutting down")
        if not self._refresh():
            raise EngineDead("every replica has died")

    def check_fits_ever(self, ticket: Ticket) -> None:
        """Raises ``RequestTooLarge`` unless ``ticket`` fits some replica's KV budget."""
        error: PrefixgateError | None = None
        for unit in self.units:
            try:
                unit.replica.admission.check_fits_ever(ticket)
                return
            except PrefixgateError as e:
                error = e
        assert error is not None
        raise error

    # -- placement --------------------------------------------------------------------------

    def _choose(self, ticket: Ticket) -> Unit:
        if not self._refresh():
            raise EngineDead("every replica has died")
        i = self.policy.place(ticket, self.states)
        if not (isinstance(i, int) and 0 <= i < len(self.units) and self.states[i].alive):
            log.warning("prefixgate: placement chose %r, not a live replica; placing by load", i)
            i = min((s for s in self.states if s.alive), key=lambda s: (s.load, s.index)).index
        return self.units[i]

    def _place(self, ticket: Ticket, unit: Unit) -> None:
        state = unit.state
        # Its uncached tokens as placement predicts them: what the replica's cache holds or the
        # requests placed there lately bring. (Counting only what the cache holds now made
        # every request of a burst count its whole prompt, hits or not, so the pending work
        # evened out request counts, not work: simulated W5 at 16 replicas left 9 to 22
        # prefills per replica, with imbalance 1.16.)
        pending = ticket.num_prompt_tokens - state.expected_hit_tokens(ticket)
        self._placed[ticket] = (unit, pending)
        state.placed_refs.hold(id(ticket), ticket.block_hashes)
        state.placed_chains.insert(ticket.block_hashes)
        state.load += 1
        state.pending_tokens += pending
        state.placed += 1

    def _unplace(self, ticket: Ticket) -> None:
        placed = self._placed.pop(ticket, None)
        if placed is not None:
            unit, pending = placed
            unit.state.placed_refs.release(id(ticket))
            unit.state.load -= 1
            unit.state.pending_tokens -= pending
        if self._pool and not self._saturated():
            self._release_pool()

    # -- deferred placement -----------------------------------------------------------------

    @property
    def waiting_to_place(self) -> int:
        """Requests held back by the policy's ``defer``, not yet placed on a replica."""
        return len(self._pool)

    def _saturated(self) -> bool:
        """Whether every live replica has requests waiting in its queue (a request placed now
        would wait anyway)."""
        return all(u.scheduler.num_waiting > 0 for u in self.units if u.state.alive)

    def _note_arrival(self) -> bool:
        """Records a request's arrival; returns whether it came less than ``defer_quiet`` after
        the first that came after a lull (none for ``defer_quiet``). A burst's first requests come while every
        replica is idle; let go as each next one came (a replica's queue being empty), those held
        back would be placed one by one, as they came and not as the whole burst's set puts
        them, unlike another gateway's share of the same burst. So early in a burst a request
        arriving while a replica's queue is empty does not let them go; it is asked whether to
        wait with them. In a stream (no lull), it does, as it always did."""
        now = self.units[0].dispatcher.clock.now()
        if now - self._last_arrival >= self.defer_quiet:
            self._burst_since = now
        self._last_arrival = now
        return now - self._burst_since < self.defer_quiet

    def _release_pool(self, burst: bool = False) -> None:
        """Lets every request waiting to be placed go on (each places itself, in arrival order);
        ``burst``: none joined them for ``defer_quiet`` (told to the policy's ``released``)."""
        pool, self._pool = self._pool, {}
        if self._pool_timer is not None:
            self._pool_timer.cancel()
            self._pool_timer = None
        if pool:
            if self._released is not None:
                self._released(burst)
            for unit in self.units:
                unit.scheduler.rewind()
        for future in pool.values():
            if not future.done():
                future.set_result(None)

    async def _expire_pool(self) -> None:
        """Lets the pool go once no request joined it for ``defer_quiet`` seconds (the burst
        has arrived) or its first one waited ``defer_seconds``."""
        clock = self.units[0].dispatcher.clock
        while True:
            now = clock.now()
            due = min(self._pool_last + self.defer_quiet, self._pool_since + self.defer_seconds)
            if now >= due:
                break
            await clock.sleep(due - now)
        self._pool_timer = None
        self._release_pool(burst=now >= self._pool_last + self.defer_quiet)

    async def _wait_to_place(self, ticket: Ticket) -> None:
        """Waits until the pool is let go (a replica's queue empties, ``defer_seconds`` pass,
        the gateway closes)."""
        future = asyncio.get_running_loop().create_future()
        now = self.units[0].dispatcher.clock.now()
        if not self._pool:
            self._pool_since = now
        self._pool[ticket] = future
        self._pool_last = now
        if self._pool_timer is None:
            self._pool_timer = asyncio.ensure_future(self._expire_pool())
        try:
            await future
        finally:
            self._pool.pop(ticket, None)
            if not self._pool and self._pool_timer is not None:
                self._pool_timer.cancel()
                self._pool_timer = None

    def unit_of(self, ticket: Ticket) -> Unit | None:
        """The unit ``ticket`` is placed on, while it is."""
        placed = self._placed.get(ticket)
        return None if placed is None else placed[0]

    async def _admit(self, ticket: Ticket, *, again: bool = False) -> Unit:
        self.check_open()
        if self._defer is not None:
            saturated, early = self._saturated(), self._note_arrival()
            if self._pool and not saturated and not early:
                self._release_pool()
            elif len(self._pool) < _POOL_LIMIT and self._defer(ticket, self.states, saturated):
                await self._wait_to_place(ticket)
                try:
                    self.check_open()
                except PrefixgateError as e:  # closed (or every replica died) while it waited
                    self.stats.refuse(e.outcome)
                    ticket.end(e.outcome)
                    raise
        unit = self._choose(ticket)
        self._place(ticket, unit)
        try:
            await unit.dispatcher.admit(ticket, again=again)
        except BaseException:
            self._unplace(ticket)
            raise
        unit.dispatcher.schedule_pump()
        return unit

    # -- serving ----------------------------------------------------------------------------

    async def enter(self, stream: ResponseStream) -> None:
        """Prepares (if not yet), places and admits ``stream``'s request: every refusal is
        raised here. Once. (The first unit's dispatcher prepares it: ingress, ids and statistics
        are the gateway's, shared by every unit.)"""
        await self.units[0].dispatcher.enter(stream, admit=self._admit)

    async def serve(self, stream: ResponseStream) -> AsyncGenerator[Any, None]:
        """Places (if not yet) and streams one request from its replica; places it again if that
        replica dies before its first output."""
        if not stream.entered:
            await self.enter(stream)
        while True:
            ticket = stream.ticket
            assert ticket is not None
            unit = self.unit_of(ticket)
            if unit is None:  # ended while unread (a dead engine, the gateway closing)
                unit = self.units[0]
            outputs = unit.dispatcher.serve(stream)
            started = False
            moved: bool | None = None  # set when it is placed again
            try:
                async for out in outputs:
                    started = True
                    yield out
                return
            except _Moved:
                if started or self.closing:  # moved, then the gateway closed before it was read
                    raise ShuttingDown("gateway is shutting down") from None
                moved = True
            except EngineDead:
                if started or unit.replica.dead is None or self.closing or not self._refresh():
                    raise
                moved = False
            finally:
                try:
                    await outputs.aclose()
                finally:
                    if moved is None and self.gate is not None and ticket in self.gate.held:
                        self.gate.release(ticket)  # held for placing again, which it is not
            # Its replica died before answering it, or it was moved (see _stored): the same
            # request, placed again, with the admission it already had (no second consultation
            # of the admission policy, no second slot of its tenant's rate).
            fresh = ticket.requeued()
            self.stats.replace(ticket, moved=moved)
            stream._prepared(fresh)
            self.live[fresh.request_id] = fresh
            if self.gate is not None:
                self.gate.hand_over(ticket, fresh)
            try:
                await self._admit(fresh, again=True)
            except BaseException:
                self.live.pop(fresh.request_id, None)
                if self.gate is not None:
                    self.gate.release(fresh)  # refused before its queue (or cancelled): settled
                raise

    def forget(self, stream: ResponseStream) -> None:
        """Ends a stream that was never iterated (see :meth:`Dispatcher.forget`)."""
        ticket = stream.ticket
        unit = self.unit_of(ticket) if ticket is not None else None
        (unit or self.units[0]).dispatcher.forget(stream)

    def dispatch_now(self, ticket: Ticket) -> None:
        """Dispatches ``ticket`` at once on the replica placement chooses or, if that one cannot
        take it now, on the least loaded one that can; else raises as that first one would."""
        self.check_open()
        chosen = self._choose(ticket)
        unit = chosen
        if not chosen.dispatcher.can_dispatch(ticket):
            ready = [u for u in self.units if u.state.alive and u.dispatcher.can_dispatch(ticket)]
            if ready:
                unit = min(ready, key=lambda u: (u.state.load, u.state.index))
        self._place(ticket, unit)
        try:
            unit.dispatcher.dispatch_now(ticket)
        except BaseException:
            self._unplace(ticket)
            raise

    def can_dispatch(self, ticket: Ticket) -> bool:
        """Whether :meth:`dispatch_now` would dispatch ``ticket`` now. Pure."""
        return any(u.replica.dead is None and u.dispatcher.can_dispatch(ticket) for u in self.units)

    async def close(self, timeout: float | None) -> None:
        """Closes every replica's dispatcher (see :meth:`Dispatcher.close`), side by side."""
        self._release_pool()
        await asyncio.gather(*(u.dispatcher.close(timeout) for u in self.units))

    # -- statistics -------------------------------------------------------------------------

    def replica_statistics(self) -> tuple[ReplicaStatistics, ...]:
        """Each replica's counters now."""
        self._refresh()
        return tuple(ReplicaStatistics(
            name=u.state.name, alive=u.state.alive, placed=u.state.placed,
            queued=u.scheduler.num_waiting + u.scheduler.outside, running=len(u.scheduler.running),
            reserved_blocks=u.replica.admission.ledger.reserved, kv=u.replica.engine.kv_stats())
            for u in self.units)

    def median_wait(self) -> float | None:
        """The median of the replicas' median recent waits, or ``None`` before any."""
        waits = [w for u in self.units if (w := u.scheduler.median_wait()) is not None]
        return statistics.median(waits) if waits else None

    def __repr__(self) -> str:
        return (f"Router({type(self.policy).__name__}, replicas={len(self.units)}, "
                f"live={len(self.live)}, closing={self.closing})")
