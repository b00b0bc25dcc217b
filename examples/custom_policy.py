"""A custom ordering policy: the shortest job first, siblings of a cached prefix kept together.

Why: under load, serving short requests first lowers the mean time to first output (a classic
shortest-job-first result), and keeping the requests that share a prefix adjacent keeps the cache
paying. The "job" is what the engine must still compute: the prompt blocks no earlier request in
the queue shares, plus the output limit. Keys are fixed when a request joins the queue.

Use it::

    from prefixgate import Gateway, GatewayConfig
    from examples.custom_policy import ShortestJobFirst

    gw = Gateway.for_vllm(engine, GatewayConfig(ordering=ShortestJobFirst))
    # Shortest job first across tenants too, not only within each:
    gw = Gateway.for_vllm(engine, GatewayConfig(ordering=ShortestJobFirst, tenant_order="global"))

Its tests are in ``examples/test_custom_policy.py`` (run by ``make test``).
"""

from __future__ import annotations

from typing import Any

from prefixgate import OrderingPolicy, Ticket

__all__ = ["ShortestJobFirst"]


class ShortestJobFirst:
    """Orders each tenant's queue by estimated work, smallest first.

    A request's work is its output limit (``default_output`` when it sets none) plus its prompt
    tokens beyond the first block, so requests that differ only in a short suffix group by
    prefix and then by size. Ties go to the earlier arrival. Not circular: every decision starts
    again at the smallest job. Keeps no state, so one instance can serve several gateways.

    Args:
        default_output: Output tokens assumed for a request without ``max_tokens``.
    """

    circular = False

    def __init__(self, default_output: int = 256) -> None:
        if default_output < 1:
            raise ValueError(f"default_output must be >= 1, got {default_output}")
        self.default_output = default_output

    def sort_key(self, ticket: Ticket) -> Any:
        output = ticket.max_tokens if ticket.max_tokens is not None else self.default_output
        work = len(ticket.prompt_token_ids) + output
        first = ticket.block_hashes[0] if ticket.block_hashes else 0
        return (work, first, ticket.seq)


_CHECK: OrderingPolicy = ShortestJobFirst()  # the structural protocol is satisfied
