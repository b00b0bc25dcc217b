"""Ordering policies: how one tenant's waiting queue is sorted, each a one-method class.

A policy gives every waiting ticket a key, once, when it is queued; the scheduler (queueing.py)
dispatches the smallest key first, or for a *circular* policy the next key after the last one it
dispatched. Built-ins are chosen by name from :data:`ORDERING_POLICIES`; a user's policy is any
class with a ``sort_key(ticket)`` method and a ``circular`` flag (``examples/custom_policy.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .tickets import Ticket

__all__ = ["ORDERING_POLICIES", "TENANT_ORDERS", "Fcfs", "OrderingPolicy", "PrefixOrder", "PriorityOrder",
           "is_ordering_policy", "make_policy"]


class OrderingPolicy(Protocol):
    """Orders one tenant's waiting queue (all tenants' with ``tenant_order="global"``): the
    smallest key goes first.

    Pass an instance, a class (instantiated once per gateway) or the name of a built-in as
    ``GatewayConfig(ordering=...)``. Keys are computed once, at enqueue time, so a policy must
    not depend on anything that changes while a request waits; one instance may serve several
    gateways if it keeps no state of its own. Aging, riders and tenant fairness apply on top.

    Attributes:
        circular: ``False``: every decision starts at the smallest key. ``True``: the scheduler
            resumes after the last key it dispatched (an elevator over the keys), which keeps
            runs of equal-prefix keys together (``prefix`` does this).
    """

    circular: bool

    def sort_key(self, ticket: Ticket) -> Any:
        """A key fixed at enqueue time; include ``ticket.seq`` to break ties.

        ``ticket`` has its final ``tenant``, ``priority``, ``seq`` (arrival order),
        ``arrival``, ``prompt_token_ids`` and ``block_hashes``.
        """
        ...


class Fcfs:
    """First come, first served: vLLM's own order."""

    circular = False

    def sort_key(self, ticket: Ticket) -> Any:
        return ticket.seq


class PriorityOrder:
    """Lower ``priority`` first, then arrival order."""

    circular = False

    def sort_key(self, ticket: Ticket) -> Any:
        return (ticket.priority, ticket.seq)


class PrefixOrder:
    """Siblings together: sorted by block-hash chain, walked circularly from the last dispatch."""

    circular = True

    def sort_key(self, ticket: Ticket) -> Any:
        return (ticket.block_hashes, ticket.seq)


ORDERING_POLICIES: dict[str, Callable[[], OrderingPolicy]] = {
    "fcfs": Fcfs,
    "priority": PriorityOrder,
    "prefix": PrefixOrder,
}


TENANT_ORDERS = ("fair", "global")
"""How tenants' queues are interleaved: ``"fair"`` (fewest in flight first, the default) or
``"global"`` (the ordering policy's keys compared across tenants)."""


def is_ordering_policy(value: object) -> bool:
    """Whether ``value`` (an instance or a class) has :class:`OrderingPolicy`'s members."""
    return callable(getattr(value, "sort_key", None)) and isinstance(getattr(value, "circular", None), bool)


def make_policy(ordering: str | OrderingPolicy | type) -> OrderingPolicy:
    """The policy ``GatewayConfig.ordering`` names: a built-in's name, a class or an instance.

    Raises:
        ValueError: If it is none of these.
    """
    if isinstance(ordering, str):
        if ordering not in ORDERING_POLICIES:
            raise ValueError(f"unknown ordering {ordering!r}; built-ins: {sorted(ORDERING_POLICIES)}")
        return ORDERING_POLICIES[ordering]()
    if not is_ordering_policy(ordering):
        raise ValueError(f"ordering {ordering!r} is not an OrderingPolicy: it needs a sort_key(ticket) "
                         "method and a bool circular attribute")
    return ordering() if isinstance(ordering, type) else ordering
