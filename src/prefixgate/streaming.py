"""Stage 6: the stream a caller iterates, one per request.

``Gateway.generate()`` returns a :class:`ResponseStream`. Iterating it prepares the request (if
ingress runs off the loop), queues it and yields the engine's own outputs; closing it or
cancelling the consumer frees everything the request held. The work itself is done by the two
callbacks the stream is given (the dispatcher's ``serve`` and ``forget``); this is the caller's
handle, and it knows nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from .errors import UsageError
from .ingress import IngressRequest
from .tickets import Ticket

__all__ = ["Forget", "ResponseStream", "Serve"]

Serve = Callable[["ResponseStream"], AsyncGenerator[Any, None]]
"""Prepares, queues, dispatches and streams the stream's request; releases all it held on exit."""
Forget = Callable[["ResponseStream"], None]
"""Ends a stream that was never iterated: frees its request id and anything admitted at the call."""


class ResponseStream(AsyncIterator[Any]):
    """The outputs of one request, as the engine produced them (vLLM ``RequestOutput``).

    Iterating it queues the request; closing it (``aclose()``, ``async with``, or leaving an
    ``async for`` early and letting it be collected) or cancelling the consumer task aborts
    the engine request and frees its reservations. A stream that is never iterated queues
    nothing, and its request id is free again once it is closed or collected.

    Args:
        request: The validated request.
        ticket: Its ticket if it was prepared at the call, else ``None``.
        serve: Called once, at the first ``__anext__``, for the generator of outputs.
        forget: Called if the stream ends (closed or collected) without being iterated.
    """

    def __init__(self, request: IngressRequest, ticket: Ticket | None, serve: Serve,
                 forget: Forget) -> None:
        self._serve = serve
        self._forget = forget
        self._request = request
        self._ticket = ticket
        self._agen: AsyncGenerator[Any, None] | None = None
        self._admitted = False
        self._entered = False
        self._busy = False

    def _dispatched_early(self) -> None:
        self._admitted = True  # try_generate: already holds its slot and reservation
        self._entered = True

    def _prepared(self, ticket: Ticket) -> None:
        self._ticket = ticket  # ingress prepared it off the loop

    def _mark_entered(self) -> None:
        self._entered = True  # prepared and admitted (queued or dispatched)

    def _abandon(self) -> None:
        """A stream whose admission failed: nothing to free later (its id is already free)."""
        self._agen = _closed()

    def __del__(self) -> None:
        if self._agen is None:  # never iterated: free its id (and a try_generate reservation)
            self._forget(self)

    @property
    def request(self) -> IngressRequest:
        """The validated request."""
        return self._request

    @property
    def admitted(self) -> bool:
        """Whether the request was dispatched at the call (``try_generate``)."""
        return self._admitted

    @property
    def entered(self) -> bool:
        """Whether the request was prepared and admitted (queued or dispatched): true once
        :meth:`Gateway.submit` returned it, or after the first output of :meth:`Gateway.generate`."""
        return self._entered

    @property
    def request_id(self) -> str:
        """The engine request id."""
        return self._request.request_id

    @property
    def ticket(self) -> Ticket | None:
        """The request's ticket (token ids, block keys, timings, outcome), or ``None`` while
        ingress prepares it off the event loop (before the first output)."""
        return self._ticket

    @property
    def predicted_hit_tokens(self) -> int | None:
        """Cache-hit tokens the gateway predicted at dispatch, or ``None`` before dispatch."""
        return None if self._ticket is None else self._ticket.predicted_hit_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Cache-hit tokens the engine reported (``num_cached_tokens``), once it did."""
        return None if self._ticket is None else self._ticket.cached_tokens

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> Any:
        if self._busy:
            raise UsageError(f"stream {self._request.request_id!r} is already being iterated by "
                             "another task; iterate a stream from one task at a time")
        if self._agen is None:
            self._agen = self._serve(self)
        self._busy = True
        try:
            return await self._agen.__anext__()
        finally:
            self._busy = False

    async def aclose(self) -> None:
        """Ends the stream: aborts the engine request if running, dequeues it if waiting."""
        if self._agen is not None:
            await self._agen.aclose()
        else:
            self._agen = _closed()
            self._forget(self)

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"ResponseStream({self._ticket or self._request.request_id!r})"


async def _closed() -> AsyncGenerator[Any, None]:
    """The generator of a stream closed before it was iterated: it yields nothing."""
    return
    yield  # pragma: no cover
