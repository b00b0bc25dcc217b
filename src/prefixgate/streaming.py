"""Stage 6: the stream a caller iterates, one per request.

``Gateway.generate()`` returns a :class:`ResponseStream`. Iterating it queues the request and
yields the engine's own outputs; closing it or cancelling the consumer frees everything the
request held. The work itself is done by the gateway's ``_serve``; this is the caller's handle.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from .tickets import Ticket, TicketState

if TYPE_CHECKING:  # pragma: no cover
    from .gateway import Gateway

__all__ = ["ResponseStream"]


class ResponseStream(AsyncIterator[Any]):
    """The outputs of one request, as the engine produced them (vLLM ``RequestOutput``).

    Iterating it queues the request; closing it (``aclose()``, ``async with``, or leaving an
    ``async for`` early and letting it be collected) or cancelling the consuming task aborts
    the engine request and frees its reservations. A stream that is never iterated queues
    nothing.
    """

    def __init__(self, gateway: Gateway, ticket: Ticket) -> None:
        self._gateway = gateway
        self._ticket = ticket
        self._agen: AsyncGenerator[Any, None] | None = None
        self._admitted = False

    def _dispatched_early(self) -> None:
        self._admitted = True  # try_generate: already holds its slot and reservation

    def __del__(self) -> None:
        # A try_generate stream dropped without being iterated must not keep its reservation.
        if self._admitted and self._agen is None and self._ticket.state is TicketState.RUNNING:
            self._gateway._abandon(self._ticket)

    @property
    def request_id(self) -> str:
        """The engine request id."""
        return self._ticket.request_id

    @property
    def ticket(self) -> Ticket:
        """The request's ticket (token ids, block keys, timings, outcome)."""
        return self._ticket

    @property
    def predicted_hit_tokens(self) -> int | None:
        """Cache-hit tokens the gateway predicted at dispatch, or ``None`` before dispatch."""
        return self._ticket.predicted_hit_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Cache-hit tokens the engine reported (``num_cached_tokens``), once it did."""
        return self._ticket.cached_tokens

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> Any:
        if self._agen is None:
            self._agen = self._gateway._serve(self._ticket, admitted=self._admitted)
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        """Ends the stream: aborts the engine request if running, dequeues it if waiting."""
        if self._agen is not None:
            await self._agen.aclose()
        elif self._admitted and self._ticket.state is TicketState.RUNNING:
            self._gateway._abandon(self._ticket)

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"ResponseStream({self._ticket!r})"
