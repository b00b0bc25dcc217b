"""Stage 5 over several engines: place each request on a replica, then queue and serve it there.

A gateway over several engines holds one :class:`Unit` per engine (its
:class:`~prefixgate.replica.Replica`, :class:`~prefixgate.queueing.Scheduler` and
:class:`~prefixgate.dispatch.Dispatcher`, as a one-engine gateway holds one) and a
:class:`Router` in front of them, which the gateway uses as it would use a dispatcher. The router
places a prepared request with the configured policy (:mod:`prefixgate.placement`); from there
that replica's dispatcher admits, queues, dispatches and streams it. The units share the
gateway's statistics, admission policy, tenant rate limits and request ids.

Failover: a dead replica is skipped by placement from then on. A request it had given no output
yet when it died (waiting in its queue, or in the engine before its first token) is placed again
on a live one, its arrival kept so aging still sees how long it waited; a request already
streaming from it ends with ``EngineDead``, as with one engine.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from .dispatch import Dispatcher
from .errors import EngineDead, PrefixgateError, ShuttingDown
from .placement import PlacementPolicy, ReplicaState
from .queueing import Scheduler
from .replica import Replica
from .statistics import ReplicaStatistics, StatsRecorder
from .streaming import ResponseStream
from .tickets import Ticket

__all__ = ["Router", "Unit"]

log = logging.getLogger(__name__)


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
    """

    def __init__(self, units: Sequence[Unit], policy: PlacementPolicy, *, stats: StatsRecorder,
                 live: dict[str, Ticket | None]) -> None:
        if not units:
            raise ValueError("a router needs at least one replica")
        self.units = list(units)
        self.states = [u.state for u in self.units]
        self.policy = policy
        self.stats = stats
        self.live = live
        self._placed: dict[Ticket, tuple[Unit, int]] = {}  # ticket -> (its unit, its pending tokens)
        for unit in self.units:
            unit.dispatcher.on_release = self._unplace

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
        state.placed_chains.insert(ticket.block_hashes)
        state.load += 1
        state.pending_tokens += pending
        state.placed += 1

    def _unplace(self, ticket: Ticket) -> None:
        placed = self._placed.pop(ticket, None)
        if placed is not None:
            unit, pending = placed
            unit.state.load -= 1
            unit.state.pending_tokens -= pending

    def unit_of(self, ticket: Ticket) -> Unit | None:
        """The unit ``ticket`` is placed on, while it is."""
        placed = self._placed.get(ticket)
        return None if placed is None else placed[0]

    async def _admit(self, ticket: Ticket) -> Unit:
        self.check_open()
        unit = self._choose(ticket)
        self._place(ticket, unit)
        try:
            await unit.dispatcher.admit(ticket)
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
            try:
                async for out in outputs:
                    started = True
                    yield out
                return
            except EngineDead:
                if started or unit.replica.dead is None or self.closing or not self._refresh():
                    raise
            finally:
                await outputs.aclose()
            # Its replica died before answering it: the same request, on another replica.
            fresh = ticket.requeued()
            self.stats.replace(ticket)
            stream._prepared(fresh)
            self.live[fresh.request_id] = fresh
            try:
                await self._admit(fresh)
            except BaseException:
                self.live.pop(fresh.request_id, None)
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
