"""Stage 3: the bounded waiting queue, ordering policies, aging, tenant fairness, the window.

Pure and synchronous: :class:`Scheduler` decides which tickets the engine gets next and
reserves their KV blocks; the gateway's async shell carries the decisions out. Every ordering
policy is a one-method class chosen by name from :data:`ORDERING_POLICIES` (they live in
ordering.py and are re-exported here); aging, tenant fairness and the KV window apply to all of
them.

How a ticket is chosen, in order:

1. **Tenant fairness.** Among tenants with waiting tickets (and under their in-flight share),
   the one with the fewest tickets in flight, then the least recently served, goes next (a
   sorted index over tenants, not a scan). The steps below choose within that tenant's queue. A
   tenant at its share waits while another tenant has requests in flight (dispatch stops with
   ``tenant_share``); with nobody else busy it may use more (work-conserving). The share is of
   the engine's ``max_num_seqs``.

   With ``tenant_order="global"`` the policy's order holds across tenants instead: the tenant
   whose smallest key is the smallest of all goes next (the same sorted index, ranked by each
   tenant's smallest key), so ``priority`` serves a gold tenant's priority-0 requests before a
   free tenant's priority-5 ones that arrived earlier. In-flight shares still apply; aging
   (step 2) looks at the oldest ticket of *all* tenants; a circular policy is refused (its walk
   is per tenant): use a non-circular one (a key of ``(priority, block_hashes, seq)`` still
   keeps siblings adjacent).
2. **Aging.** If the tenant's oldest waiting ticket (under ``"global"``: the oldest of all, if
   its tenant is under its share) has been overtaken (a ticket that arrived
   more than ``min_aging_wait`` after it was dispatched) and has waited more than
   ``max_wait_factor`` × the median wait of recently dispatched tickets *that waited* (at least
   ``min_aging_wait``; before any did, ``max_wait_factor`` × ``min_aging_wait``), it goes first,
   whatever the policy or its riders say: the bound holds even under an endless group. Tickets
   that arrived together (a burst) do not overtake each other.
3. **Riders.** Under a circular policy, a waiting sibling of the tenant's last dispatch
   (sharing at least half its cacheable prefix) goes next: it reuses the prefix just loaded.
4. **Policy.** The policy's smallest key, or for a *circular* policy (``prefix``) the next key
   after the last one dispatched, wrapping around: the queue is sorted by block-hash chain, so
   siblings that share a prefix are adjacent and dispatched together. When a circular policy
   finishes a group it prefers, among the oldest few tickets and those whose prefix was
   resident when they arrived or that the engine reported stored since (the mirror learning
   it from cache events), one whose prefix is resident in the engine (per the mirror).
5. **Window.** The chosen ticket is dispatched only if its KV blocks fit (see admission.py),
   fewer than ``max_in_flight`` requests are running and, with ``max_prefill_backlog`` set, the
   tickets dispatched but not yet started hold fewer prompt tokens to compute than that;
   otherwise dispatch stops (no overtaking).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedKeyList, SortedList

from .admission import Admission
from .clock import Clock
from .config import TenantLimits
from .errors import Outcome, QueueFull, Reason
from .mirror import PrefixMirror
from .ordering import (
    ORDERING_POLICIES,
    TENANT_ORDERS,
    Fcfs,
    OrderingPolicy,
    PrefixOrder,
    PriorityOrder,
    make_policy,
)
from .tickets import Ticket, TicketState

__all__ = [
    "ORDERING_POLICIES",
    "TENANT_ORDERS",
    "Dispatch",
    "Fcfs",
    "OrderingPolicy",
    "PrefixOrder",
    "PriorityOrder",
    "Scheduler",
    "WaitingQueue",
    "make_policy",
]

_RESIDENT_LOOKAHEAD = 8  # oldest tickets checked for a resident prefix when a group ends
_WARM_LOOKAHEAD = 64  # tickets that arrived to a resident prefix, checked when a group ends


class WaitingQueue:
    """One tenant's waiting tickets, sorted by the policy's key, and in arrival order.

    The policy's key is computed once, at :meth:`add`, and kept on the ticket. The arrival
    order is a deque from which dispatched tickets are dropped lazily (when they reach its head
    or it is iterated), so adding and removing cost one sorted insert and delete each.

    Invariant: each ticket appears at most once in the sorted list; its key never changes while
    it waits; every waiting ticket is in the arrival deque, in the order it was added.
    """

    def __init__(self, policy: OrderingPolicy) -> None:
        self.policy = policy
        self._items: SortedKeyList = SortedKeyList(key=_queue_key)
        self._arrivals: deque[Ticket] = deque()
        self.warm: deque[Ticket] = deque()
        """Tickets that arrived while half their cacheable prefix was resident in the engine
        (per the mirror), oldest first; dispatched ones are dropped lazily."""

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._items)

    def add(self, ticket: Ticket, warm: bool = False) -> None:
        """Queues ``ticket``; ``warm``: its prefix is resident (see :attr:`warm`)."""
        ticket.enqueue(self.policy.sort_key(ticket))
        self._items.add(ticket)
        self._arrivals.append(ticket)
        if warm:
            self.warm.append(ticket)
            if len(self.warm) > 2 * len(self._items) + 16:  # riders went without a pick
                self.warm = deque(t for t in self.warm if t.state is TicketState.QUEUED)

    def remove(self, ticket: Ticket) -> None:
        """Removes ``ticket``, which waits here."""
        self._items.remove(ticket)
        arrivals = self._arrivals
        if arrivals and arrivals[0] is ticket:
            arrivals.popleft()
        elif len(arrivals) > 2 * len(self._items) + 16:  # drop what left out of order
            self._arrivals = deque(t for t in arrivals if t.state is TicketState.QUEUED
                                   and t is not ticket)

    def first(self) -> Ticket:
        ticket: Ticket = self._items[0]
        return ticket

    def oldest(self) -> Ticket:
        """The ticket that has waited longest."""
        arrivals = self._arrivals
        while arrivals[0].state is not TicketState.QUEUED:
            arrivals.popleft()
        return arrivals[0]

    def by_age(self) -> Iterator[Ticket]:
        """Tickets, longest waiting first."""
        return (t for t in self._arrivals if t.state is TicketState.QUEUED)

    def after(self, key: Any) -> Ticket:
        """The first ticket whose key is greater than ``key``, wrapping to the first."""
        i = self._items.bisect_key_right(key)
        ticket: Ticket = self._items[i if i < len(self._items) else 0]
        return ticket

    def __repr__(self) -> str:
        return f"WaitingQueue({type(self.policy).__name__}, len={len(self)})"


def _queue_key(ticket: Ticket) -> Any:
    return ticket.queue_key


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A decision to hand ``ticket`` to the engine now, with what it was charged.

    Attributes:
        ticket: The ticket (now RUNNING).
        hit_blocks: Leading prompt blocks predicted to be served from cache.
        blocks: KV blocks its reservation added to the ledger (shared blocks already held by
            running tickets are not counted again).
    """

    ticket: Ticket
    hit_blocks: int
    blocks: int


class _Tenant:
    """What the scheduler keeps per tenant while it has tickets waiting or running (then it is
    forgotten: per-tenant state is bounded by the tenants with work)."""

    __slots__ = ("entry", "last_hashes", "last_key", "name", "queue", "running", "served", "tid")

    def __init__(self, name: str | None, tid: int) -> None:
        self.name = name
        self.tid = tid
        self.queue: WaitingQueue | None = None
        self.running = 0
        self.served = -1  # serial of its last dispatch
        self.last_key: Any = None
        self.last_hashes: tuple[Any, ...] = ()
        self.entry: tuple[Any, ...] | None = None  # its place in the ranking, if eligible


class Scheduler:
    """Owns waiting and running tickets and decides dispatches.

    Invariant: a known ticket is in exactly one of the waiting queues (QUEUED) and ``running``
    (RUNNING); a RUNNING ticket holds exactly one ledger reservation; ``finish`` releases both.
    A tenant is known while it has a ticket waiting or running. A decision never raises: a
    ticket whose reservation fails is taken out and listed in ``failed`` with the error.

    Bounds: waiting tickets ``max_queue_len``; tenants known, those with work; recent waits 256.

    Args:
        policy: Orders each tenant's queue.
        admission: KV fit decisions and the block ledger.
        mirror: The engine-cache mirror used to predict hits.
        clock: The gateway's clock.
        max_queue_len: The most waiting tickets over all tenants.
        max_in_flight: The most running tickets; ``None`` for no cap besides KV.
        max_wait_factor: The aging bound, in multiples of the median recent wait.
        min_aging_wait: Waits shorter than this never trigger aging (seconds).
        tenant_limits: Per-tenant limits; tenants not listed use ``default_limits``.
        default_limits: Limits of tenants not in ``tenant_limits``.
        share_base: What ``max_in_flight_share`` is a share of: the engine's ``max_num_seqs``
            (the requests it really runs at once); ``None`` for ``max_in_flight``.
        tenant_order: ``"fair"`` or ``"global"`` (see :data:`TENANT_ORDERS`).
        prefer_resident: Under a circular policy, when a group ends, prefer a waiting ticket
            whose prefix the engine holds (per the mirror) to the walk's next one (see
            :meth:`_pick`; a ticket whose prefix the mirror learns from cache events while it
            waits becomes a candidate); ``False``: the walk alone.
        max_prefill_backlog: Dispatch stops while the tickets dispatched and not yet started
            (no output yet) hold this many prompt tokens the mirror predicts uncached (their
            :attr:`backlog`); ``None``: no such cap. One ticket always may go when none holds
            any, however long its prompt.

    Raises:
        ValueError: If ``tenant_order`` is unknown, or ``"global"`` with a circular policy.
    """

    def __init__(self, policy: OrderingPolicy, *, admission: Admission, mirror: PrefixMirror,
                 clock: Clock, max_queue_len: int, max_in_flight: int | None,
                 max_wait_factor: float, min_aging_wait: float,
                 tenant_limits: dict[str, TenantLimits], default_limits: TenantLimits,
                 share_base: int | None = None, tenant_order: str = "fair",
                 prefer_resident: bool = True, max_prefill_backlog: int | None = None) -> None:
        if tenant_order not in TENANT_ORDERS:
            raise ValueError(f"unknown tenant_order {tenant_order!r}; one of {TENANT_ORDERS}")
        if tenant_order == "global" and policy.circular:
            raise ValueError(f"tenant_order='global' needs a non-circular ordering, not "
                             f"{type(policy).__name__}")
        self.policy = policy
        self.circular = policy.circular
        self.prefer_resident = prefer_resident and policy.circular
        self.global_order = tenant_order == "global"
        self._arrivals: deque[Ticket] = deque()  # under "global": every waiting ticket, by age
        self.outside = 0  # requests the gateway holds as queued outside this queue (rate waits)
        self.admission = admission
        self.mirror = mirror
        self.clock = clock
        self.max_queue_len = max_queue_len
        self.max_in_flight = max_in_flight
        self.max_prefill_backlog = max_prefill_backlog
        self.backlog = 0  # prompt tokens predicted uncached of dispatched tickets not yet started
        self.max_wait_factor = max_wait_factor
        self.min_aging_wait = min_aging_wait
        self.tenant_limits = tenant_limits
        self.default_limits = default_limits
        self.share_base = share_base
        self._shares = bool(tenant_limits) or default_limits.max_in_flight_share is not None
        self.tenants: dict[str | None, _Tenant] = {}
        self._tids = itertools.count()
        self._by_tid: dict[int, _Tenant] = {}
        # Tenants that may go, best first: (running, served, tid), or (smallest key, tid) when
        # the order is global.
        self._rank: SortedList = SortedList()
        self._queued_tenants = 0
        self._spare: list[WaitingQueue] = []  # emptied queues, reused (creating one costs µs)
        self._waiting = 0
        self.running: set[Ticket] = set()
        self._serial = 0
        self.recent_waits: deque[float] = deque(maxlen=256)
        self._sorted_waits: SortedList = SortedList()  # recent waits of tickets that waited
        self.newest_dispatched_arrival = float("-inf")
        self.aged_dispatches = 0
        # Waiting tickets whose prefix was not resident when they arrived, by the key of the half
        # of it that makes them warm: when the engine reports it stored that block (the mirror
        # learns it from cache events: another gateway's request loaded it) they turn warm. Only
        # while the mirror follows the engine's events (nothing else makes it learn).
        self._watch: dict[Any, dict[Ticket, None]] = {}
        if self.prefer_resident:
            mirror.learned.append(self._learned)
        self.blocked: Reason | None = None
        self.failed: list[tuple[Ticket, Exception]] = []

    # -- bookkeeping ------------------------------------------------------------------------

    @property
    def has_room(self) -> bool:
        """Whether one more request may wait (:meth:`enqueue` would not raise ``QueueFull``)."""
        return self._waiting + self.outside < self.max_queue_len

    @property
    def watched(self) -> Mapping[Any, Mapping[Ticket, None]]:
        """The cold waiting tickets by the key of their prefix's first half, while the mirror
        follows cache events and ``prefer_resident`` (see :meth:`_learned`). Read-only."""
        return self._watch

    @property
    def num_waiting(self) -> int:
        return self._waiting

    @property
    def queues(self) -> dict[str | None, WaitingQueue]:
        """Each tenant's waiting queue (tenants with tickets waiting)."""
        return {t.name: t.queue for t in self.tenants.values() if t.queue is not None}

    def running_of(self, tenant: str | None) -> int:
        """Tickets of ``tenant`` running now."""
        state = self.tenants.get(tenant)
        return 0 if state is None else state.running

    def waiting(self) -> list[Ticket]:
        """Every waiting ticket, oldest first within each tenant."""
        return [t for state in self.tenants.values() if state.queue is not None
                for t in state.queue.by_age()]

    def _state(self, tenant: str | None) -> _Tenant:
        state = self.tenants.get(tenant)
        if state is None:
            state = self.tenants[tenant] = _Tenant(tenant, next(self._tids))
            self._by_tid[state.tid] = state
        return state

    def _forget_if_idle(self, state: _Tenant) -> None:
        if state.queue is None and state.running == 0:
            del self.tenants[state.name]
            del self._by_tid[state.tid]

    def _cap(self, tenant: str | None) -> int | None:
        """The most tickets ``tenant`` may run while others run, or ``None``."""
        share = self._limits(tenant).max_in_flight_share
        if share is None:
            return None
        slots = [n for n in (self.share_base, self.max_in_flight) if n is not None]
        cap_base = min(slots) if slots else max(1, len(self.running))
        return max(1, int(share * cap_base))

    def _rerank(self, state: _Tenant) -> None:
        """Puts ``state`` in the ranking where it belongs (or out of it)."""
        if state.entry is not None:
            self._rank.remove(state.entry)
            state.entry = None
        if state.queue is None:
            return
        cap = self._cap(state.name) if self._shares else None
        if cap is not None and state.running >= cap:
            return  # at its share
        if self.global_order:
            state.entry = (state.queue.first().queue_key, state.tid)
        else:
            state.entry = (state.running, state.served, state.tid)
        self._rank.add(state.entry)

    def enqueue(self, ticket: Ticket) -> None:
        """Queues ``ticket``.

        Raises:
            QueueFull: If ``max_queue_len`` tickets already wait (``retry_after``: the predicted
                wait of the queue ahead).
        """
        if self._waiting + self.outside >= self.max_queue_len:
            wait = self.admission.estimated_wait(self._waiting)
            raise QueueFull(f"waiting queue is full ({self.max_queue_len} requests)",
                            retry_after=wait if wait is not None else 1.0, reason=Reason.QUEUE_FULL)
        state = self._state(ticket.tenant)
        queue = state.queue
        half = (ticket.cacheable_blocks + 1) // 2
        warm = self.prefer_resident and half > 0 and self.mirror.holds(ticket.block_hashes[half - 1])
        if self.prefer_resident and not warm and half > 0 and self.mirror.followed:
            self._watch.setdefault(ticket.block_hashes[half - 1], {})[ticket] = None
        if queue is None:
            queue = state.queue = self._spare.pop() if self._spare else WaitingQueue(self.policy)
            self._queued_tenants += 1
            queue.add(ticket, warm)
            self._rerank(state)
        else:
            queue.add(ticket, warm)
            if self.global_order and queue.first() is ticket:
                self._rerank(state)  # its smallest key changed
        if self.global_order:
            self._arrivals.append(ticket)
        self._waiting += 1

    def finish(self, ticket: Ticket) -> None:
        """Forgets ``ticket`` wherever it is and releases its blocks. Idempotent."""
        if ticket.state is TicketState.QUEUED:
            self._dequeue(ticket)
            if ticket.predicted_wait is not None:  # it waited at least this long
                self.admission.observe_wait(ticket.predicted_wait, self.clock.now() - ticket.arrival)
            self._forget_if_idle(self.tenants[ticket.tenant])
        elif ticket.state is TicketState.RUNNING:
            self.running.discard(ticket)
            self._leave_backlog(ticket)
            state = self.tenants[ticket.tenant]
            state.running -= 1
            if state.queue is not None:
                self._rerank(state)
            else:
                self._forget_if_idle(state)
            self.admission.ledger.release(ticket)
            if ticket.outcome is Outcome.COMPLETED:
                self.admission.drain.record()
        ticket.retire()

    def _dequeue(self, ticket: Ticket) -> None:
        state = self.tenants[ticket.tenant]
        queue = state.queue
        assert queue is not None
        if self._watch:
            half = (ticket.cacheable_blocks + 1) // 2
            watched = self._watch.get(ticket.block_hashes[half - 1]) if half else None
            if watched is not None:
                watched.pop(ticket, None)
                if not watched:
                    del self._watch[ticket.block_hashes[half - 1]]
        head = self.global_order and queue.first() is ticket
        queue.remove(ticket)
        self._waiting -= 1
        if self.global_order:
            self._forget_arrival(ticket)
        if head and queue:
            self._rerank(state)  # its smallest key changed
        if not queue:
            state.queue = None
            self._queued_tenants -= 1
            if state.entry is not None:
                self._rank.remove(state.entry)
                state.entry = None
            queue._arrivals.clear()
            queue.warm.clear()
            if len(self._spare) < 16:
                self._spare.append(queue)

    def _forget_arrival(self, ticket: Ticket) -> None:
        """Drops ``ticket`` (leaving the queue now) from the global arrival order, lazily."""
        arrivals = self._arrivals
        if arrivals and arrivals[0] is ticket:
            arrivals.popleft()
        elif len(arrivals) > 2 * self._waiting + 16:  # drop what left out of order
            self._arrivals = deque(t for t in arrivals if t.state is TicketState.QUEUED
                                   and t is not ticket)

    def _oldest(self) -> Ticket:
        """The ticket that has waited longest, over all tenants (``"global"`` order only)."""
        arrivals = self._arrivals
        while arrivals[0].state is not TicketState.QUEUED:
            arrivals.popleft()
        return arrivals[0]

    def rewind(self) -> None:
        """Starts the circular walk again from the smallest key (for every tenant). A router
        calls it when requests held back to be placed together join the queues, so that
        independent gateways holding the same groups walk them in the same order."""
        for state in self.tenants.values():
            state.last_key = None

    def median_wait(self) -> float | None:
        """Median queue wait of recently dispatched tickets that waited (at least
        ``min_aging_wait``), or ``None`` before any did."""
        waits = self._sorted_waits
        n = len(waits)
        if not n:
            return None
        median: float = waits[n // 2] if n % 2 else (waits[n // 2 - 1] + waits[n // 2]) / 2
        return median

    def _note_wait(self, wait: float) -> None:
        if wait < self.min_aging_wait:
            return
        waits = self.recent_waits
        if len(waits) == waits.maxlen:
            self._sorted_waits.remove(waits[0])
        waits.append(wait)
        self._sorted_waits.add(wait)

    def _limits(self, tenant: str | None) -> TenantLimits:
        return self.tenant_limits.get(tenant, self.default_limits) if tenant else self.default_limits

    # -- decisions --------------------------------------------------------------------------

    def _aged(self, now: float, oldest: Ticket) -> Ticket | None:
        """``oldest`` if the aging bound says it must go now, else ``None``."""
        if self.newest_dispatched_arrival - oldest.arrival <= self.min_aging_wait:
            return None  # nothing newer has gone ahead of it
        median = self.median_wait()
        bound = self.max_wait_factor * (median if median is not None else self.min_aging_wait)
        return oldest if now - oldest.arrival > max(self.min_aging_wait, bound) else None

    def _tenant(self) -> _Tenant | None:
        """The tenant to serve next, or ``None`` when every waiting tenant is at its in-flight
        share while another tenant has requests in flight."""
        if self._rank:
            return self._by_tid[self._rank[0][-1]]
        waiting = [t for t in self.tenants.values() if t.queue is not None]
        if sum(t.running for t in waiting) < len(self.running):
            return None  # others are being served: the shares hold
        # Nobody else has work here: work-conserving, the share does not idle the engine.
        if self.global_order:
            return min(waiting, key=lambda t: (t.queue.first().queue_key, t.tid))  # type: ignore[union-attr]
        return min(waiting, key=lambda t: (t.running, t.served))

    def _rider(self, state: _Tenant, queue: WaitingQueue) -> Ticket | None:
        """For a circular policy, the next ticket of the tenant's group being dispatched, if
        any: one that shares at least half its cacheable prefix with the tenant's last dispatch.
        It rides along on the prefix just loaded."""
        if not self.circular or state.last_key is None:
            return None
        ticket = queue.after(state.last_key)
        last = state.last_hashes
        half = (ticket.cacheable_blocks + 1) // 2  # at least one block, at least half of them
        # Keys stand for their whole prefix: sharing key half-1 means sharing all before it.
        if half and half <= len(last) and ticket.block_hashes[half - 1] == last[half - 1]:
            return ticket
        return None

    def _learned(self, keys: Sequence[Any]) -> None:
        """The mirror learned that the engine stored ``keys``: the waiting tickets watching one
        of them (see ``_watch``) turn warm, so :meth:`_pick` considers them when a group ends."""
        watch = self._watch
        if not watch:
            return
        for key in keys:
            tickets = watch.pop(key, None)
            if tickets:
                for ticket in tickets:
                    queue = self.tenants[ticket.tenant].queue
                    if ticket.state is TicketState.QUEUED and queue is not None:
                        queue.warm.append(ticket)

    def _pick(self, state: _Tenant, queue: WaitingQueue) -> Ticket:
        """A group ended: the walk's next ticket, unless another has more of its prefix resident
        in the engine (per the mirror). Candidates: the oldest few, and the first few of those
        that arrived to a resident prefix. These are a group's late siblings: in a burst the
        first arrivals are dispatched as they come, one or two per group, until the KV cache
        fills; the rest of each group arrives after and waits. Left to the walk, a sibling
        waits for its group's turn in key order, by when the engine may have evicted the
        prefix its group loaded (and a cold group dispatched first evicts it)."""
        if not self.circular or state.last_key is None:
            return queue.first()
        ticket = queue.after(state.last_key)
        if not self.prefer_resident:
            return ticket
        mirror = self.mirror
        best, best_hits = ticket, mirror.match(ticket.block_hashes, ticket.cacheable_blocks)
        for i, other in enumerate(queue.by_age()):
            if i >= _RESIDENT_LOOKAHEAD:
                break
            if other is not ticket:
                hits = mirror.match(other.block_hashes, other.cacheable_blocks)
                if hits > best_hits:
                    best, best_hits = other, hits
        warm = queue.warm
        if warm:
            kept: list[Ticket] = []
            checked = 0
            while warm and checked < _WARM_LOOKAHEAD:
                other = warm.popleft()
                if other.state is not TicketState.QUEUED:
                    continue  # dispatched or gone since
                checked += 1
                hits = mirror.match(other.block_hashes, other.cacheable_blocks)
                if hits == 0:
                    continue  # evicted since: the walk will come to it
                kept.append(other)
                if hits > best_hits:
                    best, best_hits = other, hits
            warm.extendleft(reversed(kept))
        return best

    def choose(self) -> Ticket | None:
        """The ticket that should go next, or ``None`` when nothing waits. Pure."""
        if not self._waiting:
            return None
        choice = self._choose(self.clock.now())
        return None if choice is None else choice[0]

    def _choose(self, now: float) -> tuple[Ticket, bool] | None:
        """The next ticket and whether aging chose it (something must wait); ``None`` when
        every waiting tenant is held at its in-flight share."""
        state = self._tenant()
        if state is None:
            return None
        queue = state.queue
        assert queue is not None
        if self.global_order:  # aging over all tenants; the policy's smallest key otherwise
            oldest = self._oldest()
            owner = self.tenants[oldest.tenant]
            aged = self._aged(now, oldest) if owner is state or owner.entry is not None else None
            return (aged, True) if aged is not None else (queue.first(), False)
        if len(queue) == 1:  # no choice to make
            return queue.first(), False
        aged = self._aged(now, queue.oldest())
        if aged is not None:
            return aged, True
        rider = self._rider(state, queue)
        return (rider, False) if rider is not None else (self._pick(state, queue), False)

    def started(self, ticket: Ticket) -> bool:
        """Notes that a running ``ticket`` produced its first output (the engine started it):
        its tokens leave the prefill backlog. Returns whether that may let a waiting ticket go
        (dispatch stopped on the backlog and tickets wait): then pump."""
        if not ticket.backlog_tokens:
            return False
        self._leave_backlog(ticket)
        return self.blocked is Reason.PREFILL_BACKLOG and self._waiting > 0

    @property
    def backlog_full(self) -> bool:
        """Whether ``max_prefill_backlog`` stops dispatch now."""
        return self.max_prefill_backlog is not None and self.backlog >= self.max_prefill_backlog

    def _leave_backlog(self, ticket: Ticket) -> None:
        self.backlog -= ticket.backlog_tokens
        ticket.backlog_tokens = 0

    def next_batch(self) -> list[Dispatch]:
        """Dispatches, in order, every ticket that may go now; reserves blocks, predicts hits.

        Sets ``blocked`` to why dispatch stopped (``None`` when the queue emptied). A ticket
        whose reservation raises is taken out and appended to ``failed``; the others go on.
        """
        out: list[Dispatch] = []
        now = self.clock.now()
        self.blocked = None
        admission = self.admission
        cap = self.max_prefill_backlog
        while self._waiting:
            if self.max_in_flight is not None and len(self.running) >= self.max_in_flight:
                self.blocked = Reason.MAX_IN_FLIGHT
                break
            if self.backlog_full:
                self.blocked = Reason.PREFILL_BACKLOG
                break
            choice = self._choose(now)
            if choice is None:
                self.blocked = Reason.TENANT_SHARE
                break
            ticket, aged = choice
            queued = True
            try:
                shared, private = admission.split(ticket)
                reason = admission.blocked_reason(admission.ledger.need(shared, private),
                                                  admission.may_look_ahead(ticket))
                if reason is not None:
                    self.blocked = reason
                    break
                hit_blocks = self.mirror.match(ticket.block_hashes, ticket.cacheable_blocks)
                self._dequeue(ticket)
                queued = False
                blocks = admission.reserve(ticket, shared, private)
            except Exception as e:  # never strand the queue behind one bad ticket
                if queued:
                    self._dequeue(ticket)
                ticket.retire()
                self._forget_if_idle(self.tenants[ticket.tenant])
                self.failed.append((ticket, e))
                continue
            self.mirror.insert(ticket.block_hashes)
            hit_tokens = hit_blocks * admission.block_size
            ticket.start(now, hit_tokens)
            if cap is not None:
                ticket.backlog_tokens = max(1, len(ticket.prompt_token_ids) - hit_tokens)
                self.backlog += ticket.backlog_tokens
            if ticket.predicted_wait is not None:
                admission.observe_wait(ticket.predicted_wait, now - ticket.arrival)
            self.running.add(ticket)
            state = self.tenants[ticket.tenant]
            state.running += 1
            self._serial += 1
            state.served = self._serial
            state.last_key = ticket.queue_key
            state.last_hashes = ticket.block_hashes
            if state.queue is not None:
                self._rerank(state)
            self._note_wait(now - ticket.arrival)
            if ticket.arrival > self.newest_dispatched_arrival:
                self.newest_dispatched_arrival = ticket.arrival
            self.aged_dispatches += aged
            out.append(Dispatch(ticket, hit_blocks, blocks))
        return out

    def __repr__(self) -> str:
        return (f"Scheduler({type(self.policy).__name__}, waiting={self._waiting}, "
                f"running={len(self.running)}, tenants={len(self.tenants)}, blocked={self.blocked})")
