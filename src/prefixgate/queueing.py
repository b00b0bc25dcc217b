"""Stage 3: the bounded waiting queue, its ordering policies, and the in-flight window.

Pure and synchronous: :class:`Scheduler` only decides which tickets to hand to the engine next;
the gateway's async shell carries the decisions out. Policies are one-method classes chosen by
name from :data:`ORDERING_POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from sortedcontainers import SortedKeyList

from .errors import QueueFull
from .tickets import Ticket, TicketState

__all__ = ["ORDERING_POLICIES", "Fcfs", "OrderingPolicy", "PriorityOrder", "Scheduler",
           "WaitingQueue"]


class OrderingPolicy(Protocol):
    """Orders the waiting queue: the ticket with the smallest key is dispatched first."""

    def sort_key(self, ticket: Ticket) -> Any:
        """A key fixed at enqueue time; ties must be broken (``ticket.seq`` does it)."""
        ...


class Fcfs:
    """First come, first served: vLLM's own order."""

    def sort_key(self, ticket: Ticket) -> Any:
        return ticket.seq


class PriorityOrder:
    """Lower ``priority`` first, then arrival order."""

    def sort_key(self, ticket: Ticket) -> Any:
        return (ticket.priority, ticket.seq)


ORDERING_POLICIES: dict[str, Callable[[], OrderingPolicy]] = {
    "fcfs": Fcfs,
    "priority": PriorityOrder,
}


class WaitingQueue:
    """Tickets waiting for dispatch, sorted by the policy's key, at most ``max_len`` of them.

    Invariant: ``len(self) <= max_len``; each ticket appears at most once.

    Args:
        policy: Orders the queue.
        max_len: The bound; :meth:`push` refuses beyond it.
    """

    def __init__(self, policy: OrderingPolicy, max_len: int) -> None:
        self.policy = policy
        self.max_len = max_len
        self._items: SortedKeyList = SortedKeyList(key=self._key)
        self._keys: dict[int, Any] = {}

    def _key(self, ticket: Ticket) -> Any:
        return self._keys[id(ticket)]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._items)

    def push(self, ticket: Ticket) -> None:
        """Adds ``ticket``.

        Raises:
            QueueFull: If ``max_len`` tickets are already waiting.
        """
        if len(self._items) >= self.max_len:
            raise QueueFull(f"waiting queue is full ({self.max_len} requests)",
                            retry_after=0.0, reason="queue_full")
        self._keys[id(ticket)] = self.policy.sort_key(ticket)
        self._items.add(ticket)

    def peek(self) -> Ticket | None:
        """The next ticket, without removing it."""
        return self._items[0] if self._items else None

    def pop(self) -> Ticket | None:
        """Removes and returns the next ticket, or ``None`` when empty."""
        if not self._items:
            return None
        ticket = self._items.pop(0)
        del self._keys[id(ticket)]
        return ticket

    def remove(self, ticket: Ticket) -> bool:
        """Removes ``ticket`` if it is waiting; returns whether it was."""
        if id(ticket) not in self._keys:
            return False
        self._items.remove(ticket)
        del self._keys[id(ticket)]
        return True

    def __repr__(self) -> str:
        return f"WaitingQueue({type(self.policy).__name__}, len={len(self)}, max_len={self.max_len})"


class Scheduler:
    """Decides which waiting tickets go to the engine, keeping at most ``max_in_flight`` there.

    Invariant: every ticket it knows is in exactly one of ``queue`` (QUEUED) and ``running``
    (RUNNING); :meth:`finish` forgets a ticket in either.

    Args:
        queue: The waiting queue.
        max_in_flight: The most RUNNING tickets; ``None`` for no cap.
    """

    def __init__(self, queue: WaitingQueue, max_in_flight: int | None) -> None:
        self.queue = queue
        self.max_in_flight = max_in_flight
        self.running: set[Ticket] = set()

    def enqueue(self, ticket: Ticket) -> None:
        """Queues ``ticket``. Raises ``QueueFull`` as :meth:`WaitingQueue.push` does."""
        self.queue.push(ticket)
        ticket.state = TicketState.QUEUED

    def next_batch(self) -> list[Ticket]:
        """Pops the tickets to dispatch now, in order, and marks them RUNNING."""
        out = []
        while self.max_in_flight is None or len(self.running) < self.max_in_flight:
            ticket = self.queue.pop()
            if ticket is None:
                break
            ticket.state = TicketState.RUNNING
            self.running.add(ticket)
            out.append(ticket)
        return out

    def finish(self, ticket: Ticket) -> None:
        """Forgets ``ticket`` wherever it is (idempotent) and marks it DONE."""
        if ticket.state is TicketState.QUEUED:
            self.queue.remove(ticket)
        self.running.discard(ticket)
        ticket.state = TicketState.DONE

    def __repr__(self) -> str:
        return (f"Scheduler(queued={len(self.queue)}, running={len(self.running)}, "
                f"max_in_flight={self.max_in_flight})")
