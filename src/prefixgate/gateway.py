"""The gateway: the async shell around the pure stages, and the only place that awaits.

``generate()`` runs ingress synchronously (a bad request raises at the call, before anything is
queued) and returns a :class:`ResponseStream`. Iterating the stream queues the ticket; the
scheduler decides when it is dispatched; the engine's outputs are passed through unchanged.
Whatever way the stream ends (completion, error, the consumer cancelled or closed it), the
ticket's reservations are released and, if the engine had it, the engine request is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from .clock import Clock, MonotonicClock
from .config import GatewayConfig
from .engine import Engine, EngineRequest
from .errors import (
    EngineDead,
    EngineError,
    Outcome,
    PrefixgateError,
    QueueTimeout,
    Rejected,
    ShuttingDown,
)
from .ingress import Ingress, Prompt
from .keys import block_hashes
from .mirror import PrefixMirror
from .queueing import ORDERING_POLICIES, Scheduler, WaitingQueue
from .statistics import GatewayStatistics, StatsRecorder
from .tickets import Ticket

__all__ = ["Gateway", "ResponseStream"]


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
            self._agen = self._gateway._serve(self._ticket)
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        """Ends the stream: aborts the engine request if running, dequeues it if waiting."""
        if self._agen is not None:
            await self._agen.aclose()

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"ResponseStream({self._ticket!r})"


class Gateway:
    """prefixgate's front door for one engine.

    Use as an async context manager; on exit it stops accepting requests, ends queued ones with
    :class:`~prefixgate.errors.ShuttingDown` and waits for running ones to finish.

    Args:
        engine: Any :class:`~prefixgate.engine.Engine` (see :meth:`for_vllm` for vLLM).
        config: The gateway's configuration; defaults when ``None``.
        clock: Time source; the monotonic clock when ``None``.
    """

    def __init__(self, engine: Engine, config: GatewayConfig | None = None, *,
                 clock: Clock | None = None) -> None:
        self.engine = engine
        self.config = config or GatewayConfig()
        self.clock = clock or MonotonicClock()
        self._ingress = Ingress(engine, self.config, self.clock)
        policy = ORDERING_POLICIES[self.config.ordering]()
        self._scheduler = Scheduler(WaitingQueue(policy, self.config.max_queue_len),
                                    self.config.max_in_flight)
        self._mirror = PrefixMirror(engine.num_blocks)
        self._stats = StatsRecorder()
        self._live: dict[str, Ticket] = {}
        self._closing = False
        self._dead: EngineDead | None = None
        self._idle = asyncio.Event()
        self._idle.set()

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

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- public API -------------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
                 request_id: str | None = None, lora_request: Any = None,
                 priority: int = 0) -> ResponseStream:
        """Validates, canonicalizes and keys a request; iterate the result for its outputs.

        Args:
            prompt: A ``str``, UTF-8 ``bytes``, or a list of chat messages (rendered with the
                engine tokenizer's chat template).
            sampling_params: The engine's sampling parameters; engine defaults when ``None``.
            tenant: Namespaces the prefix cache (see ``GatewayConfig.isolate_tenants``).
            request_id: The engine request id; a fresh UUID when ``None``.
            lora_request: Passed to the engine; part of the block-key namespace.
            priority: Used by the ``priority`` ordering (lower first).

        Returns:
            A :class:`ResponseStream` of the engine's outputs.

        Raises:
            InvalidRequest: Malformed prompt or parameters, unknown tenant, duplicate id.
            PromptTooLong: The prompt exceeds the model's (or the configured) limit.
            ShuttingDown: The gateway is closing.
            EngineDead: The engine has died.
        """
        try:
            if self._closing:
                raise ShuttingDown("gateway is shutting down")
            if self._dead is not None:
                raise EngineDead("the engine has died") from self._dead.__cause__
            ticket = self._ingress.make_ticket(
                prompt, sampling_params, tenant=tenant, request_id=request_id,
                lora_request=lora_request, priority=priority)
            self._check_unique(ticket.request_id)
        except PrefixgateError as e:
            self._stats.refuse(e.outcome)
            raise
        return ResponseStream(self, ticket)

    def statistics(self) -> GatewayStatistics:
        """A frozen snapshot of the gateway's counters and the engine's latest KV state."""
        return self._stats.snapshot(queued=len(self._scheduler.queue),
                                    running=len(self._scheduler.running),
                                    kv=self.engine.kv_stats())

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Stops accepting requests, ends queued ones with ``ShuttingDown``, and waits up to
        ``timeout`` seconds (forever when ``None``) for running ones, then aborts what is left.
        """
        self._closing = True
        while (ticket := self._scheduler.queue.pop()) is not None:
            if ticket.granted is not None and not ticket.granted.done():
                ticket.granted.set_exception(ShuttingDown("gateway is shutting down"))
        if self._scheduler.running:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                for ticket in list(self._scheduler.running):
                    await self.engine.abort(ticket.request_id)

    # -- the async shell --------------------------------------------------------------------

    def _check_unique(self, request_id: str) -> None:
        if request_id in self._live:
            from .errors import InvalidRequest

            raise InvalidRequest(f"request_id {request_id!r} is already in use")

    def _pump(self) -> None:
        """Carries out the scheduler's decisions: grants the tickets it releases."""
        for ticket in self._scheduler.next_batch():
            if ticket.granted is not None and not ticket.granted.done():
                ticket.granted.set_result(None)

    async def _wait_for_grant(self, ticket: Ticket) -> None:
        assert ticket.granted is not None
        if ticket.granted.done() or self.config.queue_timeout is None:
            await ticket.granted
            return
        deadline = ticket.arrival + self.config.queue_timeout
        expiry = asyncio.ensure_future(self.clock.sleep(deadline - self.clock.now()))
        try:
            await asyncio.wait({ticket.granted, expiry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            expiry.cancel()
        if not ticket.granted.done():
            raise QueueTimeout(f"{ticket.request_id} waited over {self.config.queue_timeout} s")
        ticket.granted.result()

    async def _serve(self, ticket: Ticket) -> AsyncGenerator[Any, None]:
        """Queues, dispatches and streams one ticket; releases everything it held on exit."""
        try:
            if self._closing:
                raise ShuttingDown("gateway is shutting down")
            self._check_unique(ticket.request_id)
            ticket.granted = asyncio.get_running_loop().create_future()
            self._scheduler.enqueue(ticket)
        except (Rejected, ShuttingDown) as e:
            self._stats.refuse(e.outcome)
            raise
        self._live[ticket.request_id] = ticket
        self._stats.accept(ticket)
        dispatched = False
        try:
            self._pump()
            await self._wait_for_grant(ticket)
            if self._dead is not None:
                raise EngineDead("the engine has died") from self._dead.__cause__
            dispatched = True
            self._on_dispatch(ticket)
            request = EngineRequest(ticket.request_id, ticket.prompt_token_ids,
                                    ticket.sampling_params, ticket.cache_salt,
                                    ticket.lora_request, ticket.priority)
            async with contextlib.aclosing(self.engine.generate(request)) as outputs:
                async for out in outputs:
                    if ticket.first_output_at is None:
                        ticket.first_output_at = self.clock.now()
                    if getattr(out, "finished", False):
                        self._on_complete(ticket, out)  # before the yield: callers may stop here
                    yield out
            if ticket.outcome is not Outcome.COMPLETED:
                raise EngineError(f"engine ended {ticket.request_id} without a finished output")
        except (asyncio.CancelledError, GeneratorExit):
            if ticket.outcome is not Outcome.COMPLETED:
                ticket.outcome = Outcome.CANCELLED
            raise
        except EngineDead as e:
            self._dead = e
            ticket.outcome = e.outcome
            raise
        except PrefixgateError as e:
            ticket.outcome = e.outcome
            raise
        except Exception as e:
            ticket.outcome = Outcome.ENGINE_ERROR
            raise EngineError(f"engine failed on {ticket.request_id}: {e}") from e
        finally:
            ticket.finished_at = self.clock.now()
            self._scheduler.finish(ticket)
            self._live.pop(ticket.request_id, None)
            if ticket.outcome is None:  # pragma: no cover - every path above sets it
                ticket.outcome = Outcome.ENGINE_ERROR
            self._stats.end(ticket)
            if not self._scheduler.running:
                self._idle.set()
            self._pump()
            if dispatched and ticket.outcome is not Outcome.COMPLETED and self._dead is None:
                with contextlib.suppress(Exception):
                    await self.engine.abort(ticket.request_id)

    def _on_dispatch(self, ticket: Ticket) -> None:
        ticket.dispatched_at = self.clock.now()
        hit_blocks = self._mirror.match(ticket.block_hashes, ticket.cacheable_blocks)
        ticket.predicted_hit_tokens = hit_blocks * self.engine.block_size
        self._mirror.insert(ticket.block_hashes)

    def _on_complete(self, ticket: Ticket, last: Any) -> None:
        ticket.outcome = Outcome.COMPLETED
        ticket.cached_tokens = getattr(last, "num_cached_tokens", None)
        completions = getattr(last, "outputs", None) or ()
        if len(completions) == 1 and not _is_delta(ticket.sampling_params):
            ticket.output_token_ids = tuple(completions[0].token_ids)
            # The engine also caches full blocks of the output (all but the last token's KV
            # is computed): a follow-up turn that repeats them hits.
            computed = ticket.prompt_token_ids + ticket.output_token_ids[:-1]
            chain = block_hashes(computed, self.engine.block_size, ticket.namespace,
                                 seed=self.config.key_seed, known=ticket.block_hashes)
            self._mirror.insert(chain)

    def __repr__(self) -> str:
        return (f"Gateway(engine={self.engine!r}, queued={len(self._scheduler.queue)}, "
                f"running={len(self._scheduler.running)}, closing={self._closing})")


def _is_delta(sampling_params: Any) -> bool:
    kind = getattr(sampling_params, "output_kind", None)
    return getattr(kind, "name", None) == "DELTA"
