"""The OpenAI-compatible HTTP front: :func:`create_app` builds a FastAPI app around a gateway.

Every refusal is decided before the response starts. A request is submitted
(:meth:`Gateway.submit` raises every refusal before any engine call) and its first output is
awaited before the status line is written, so a queue timeout or an engine failure before the
first token is an HTTP status too: ``Rejected`` for load → 429 with ``Retry-After`` and
``retry-after-ms``, invalid input → 400, shutting down / evicted / engine dead → 503, other
engine failures → 500, all in OpenAI's error shape. A client that goes away while its request
is admitted, queued or streaming cancels it: the gateway stream is closed, which aborts the
engine request and frees its place.

The engine's outputs are read by one task per request (:class:`_Feed`), which keeps only the
latest (outputs are cumulative, as vLLM's are by default): a slow client never holds the engine
back and never makes the server buffer more than one output per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from ..errors import (
    AdmissionRefused,
    EngineDead,
    Evicted,
    InvalidRequest,
    PrefixgateError,
    PromptTooLong,
    RateLimited,
    Rejected,
    RetryableRejection,
)
from ..gateway import Gateway
from ..streaming import ResponseStream
from .metrics import ServeMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    sampling_fields,
    usage,
)

__all__ = ["ClientDisconnected", "RetrySpread", "create_app", "error_response"]

T = TypeVar("T")

TENANT_HEADER = "x-prefixgate-tenant"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response started; its request was cancelled."""


def error_response(error: PrefixgateError, *, min_retry_after: float = 0.1,
                   retry_after: float | None = None) -> JSONResponse:
    """The HTTP response for a prefixgate error, in OpenAI's error shape.

    Args:
        error: What the gateway raised.
        min_retry_after: The least ``Retry-After`` sent with a 429, in seconds (the gateway may
            predict 0 s, which would make clients retry at once).
        retry_after: The wait to send with a 429 instead of the error's own (see
            :class:`RetrySpread`).

    Returns:
        429 (``RetryableRejection``: ``Retry-After`` in whole seconds, at least 1, and
        ``retry-after-ms`` exactly), 400 (``InvalidRequest``), 503 (``Evicted`` and
        ``EngineDead``), else 500.
    """
    code = error.outcome.value
    headers: dict[str, str] = {}
    if isinstance(error, RetryableRejection):
        wait = max(error.retry_after if retry_after is None else retry_after, min_retry_after)
        headers = {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(round(wait * 1000))}
        status, kind, code = 429, "rate_limit_error", str(error.reason)
    elif isinstance(error, InvalidRequest):
        status, kind = 400, "invalid_request_error"
        if isinstance(error, PromptTooLong):
            code = "context_length_exceeded"
    elif isinstance(error, Evicted | EngineDead):
        status, kind = 503, "service_unavailable"
    else:  # EngineError, AdmissionPolicyFailed, UsageError: ours or the engine's fault
        status, kind = 500, "server_error" if not isinstance(error, Rejected) else "policy_error"
    return JSONResponse(error_body(str(error), kind, code), status_code=status, headers=headers)


class RetrySpread:
    """Spreads the ``Retry-After`` of refusals for shared capacity over time, so that a burst
    of refused clients does not come back as one burst.

    The gateway's ``retry_after`` for a full queue (or a full engine) is the predicted time until
    the queue ahead drains, the same for every request refused in that moment; clients that
    honour it would all retry at once and, but for a handful, be refused again. Here the k-th
    refusal since the horizon was last reached is told to come back one queue-place later than
    the one before (``retry_after / max_queue_len`` apart: the predicted drain rate). Refusals
    that are one tenant's own (``RateLimited``, ``AdmissionRefused``) keep their exact wait.

    Invariant: the horizon (the latest retry time handed out) never moves back while ahead of
    now; it holds one float, whatever the load.

    Args:
        places: Queue places that free as the queue ahead drains (``max_queue_len``).
        max_delay: The longest wait told (the openai client does not retry past 60 s).
        now: The clock (monotonic seconds).
    """

    def __init__(self, places: int, *, max_delay: float = 60.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.places = max(1, places)
        self.max_delay = max_delay
        self._now = now
        self._horizon = 0.0

    def delay(self, error: RetryableRejection) -> float:
        """The wait to tell the client refused with ``error``."""
        if isinstance(error, RateLimited | AdmissionRefused):
            return error.retry_after
        now = self._now()
        wait = error.retry_after
        at = min(max(now + wait, self._horizon + wait / self.places), now + self.max_delay)
        self._horizon = at
        return at - now

    def __repr__(self) -> str:
        return f"RetrySpread(places={self.places}, horizon={self._horizon:.3f})"


def _bad_request(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    return JSONResponse(error_body(message, kind, status, param), status_code=status)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the server's ``receive``
    then waits for the disconnect, or for the response to complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _or_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work`` unless the client disconnects first: then cancels it and raises
    :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


class _Feed:
    """Reads one gateway stream in a task of its own and keeps its latest output.

    Invariant: at most one output is held (the newest; outputs are cumulative), and once the
    stream ends, :meth:`next` returns what is left, then its error or ``None``. The pump is
    a plain asyncio task, so cancelling it is edge-triggered: the gateway's abort in its
    ``finally`` runs to the end even when the HTTP response is cancelled by the client leaving.
    """

    def __init__(self, stream: ResponseStream, on_first: Callable[[], None]) -> None:
        self._stream = stream
        self._on_first = on_first
        self._latest: Any = None
        self._error: BaseException | None = None
        self._done = False
        self._event = asyncio.Event()
        self.cut: bool | None = None  # at the first aclose: whether the stream had not ended
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        first = True
        try:
            async for out in self._stream:
                if first:
                    first = False
                    self._on_first()
                self._latest = out
                self._event.set()
        except Exception as e:
            self._error = e
        finally:
            self._done = True
            self._event.set()

    async def next(self) -> Any:
        """The newest output not yet returned; ``None`` once the stream ended.

        Raises:
            PrefixgateError: How the stream ended, if not with its last output.
        """
        await self._event.wait()
        if not self._done:
            self._event.clear()
        out, self._latest = self._latest, None
        if out is not None:
            return out
        if self._error is not None:
            raise self._error
        return None

    async def aclose(self) -> None:
        """Cancels the pump (aborting the engine request, dequeuing a queued one) and waits.
        The first call notes whether the stream was cut short (:attr:`cut`)."""
        if self.cut is None:
            self.cut = not self._done
        with anyio.CancelScope(shield=True):
            if not self._task.done():
                self._task.cancel()
                await asyncio.wait((self._task,))
            await self._stream.aclose()


class _ClosingEventSource(EventSourceResponse):
    """An SSE response that closes its request's feed however the response ends: done, the
    client gone before the events' generator first ran (its own ``finally`` then never runs),
    or the server's ``send`` failing (a connection reset while the headers go out), which
    raises out of the response before Starlette would run a background task. A request cut
    short by any of these counts as a client that left while ``streaming``."""

    def __init__(self, *args: Any, feed: _Feed, meter: ServeMetrics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._feed = feed
        self._meter = meter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._feed.aclose()  # shielded; closing twice is harmless
            if self._feed.cut:
                self._meter.disconnected("streaming")


@dataclass(slots=True)
class _State:
    """What the app knows of its own life: ``closing`` once its server shuts down."""

    closing: bool = False


@dataclass(slots=True)
class _Delta:
    """What of a cumulative output a client has been sent."""

    chars: int = 0

    def take(self, text: str) -> str:
        new = text[self.chars:]
        self.chars = len(text)
        return new


def _completion(out: Any) -> Any:
    return out.outputs[0]


def _usage(out: Any) -> dict[str, Any]:
    return usage(len(out.prompt_token_ids), len(_completion(out).token_ids),
                 getattr(out, "num_cached_tokens", None))


def create_app(gateway: Gateway, *, model_name: str | None = None,
               sampling_params: Callable[[Mapping[str, Any]], Any] | None = None,
               metrics: ServeMetrics | None = None, tenant_header: str = TENANT_HEADER,
               min_retry_after: float = 0.1, ping_seconds: float = 15.0) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``gateway``.

    The app does not own the gateway: enter and close it yourself (``prefixgate serve`` does,
    around the server), so the app can be mounted in an existing service
    (``app.mount("/llm", create_app(gw))``).

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true: SSE, with
    ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health`` (200 while the
    gateway accepts requests), ``GET /ready`` (200 while :attr:`Gateway.healthy
    <prefixgate.Gateway.healthy>`: it accepts requests and an engine can serve them),
    ``GET /metrics`` (Prometheus text; ``metrics`` given or a new
    :class:`~prefixgate.serve.metrics.ServeMetrics`).

    Args:
        gateway: The gateway to serve (entered or not yet).
        model_name: The model name clients send and ``/v1/models`` lists; the engine's when
            ``None``. A request naming another model is a 404.
        sampling_params: Builds the engine's sampling parameters from the request's fields
            (:data:`~prefixgate.serve.protocol.SAMPLING_KEYS` that were set); ``None`` hands the
            gateway the mapping, which ``VllmEngine`` and ``RemoteVllm`` build themselves.
            Keep the output kind cumulative (vLLM's default).
        metrics: Where to count; a new registry's when ``None``.
        tenant_header: The request header naming the tenant (``None`` tenant when absent).
        min_retry_after: The least ``Retry-After`` of a 429, in seconds.
        ping_seconds: SSE keep-alive comment interval.

    Returns:
        The app.
    """
    served = model_name or gateway.engine.model_name
    build = sampling_params or dict
    meter = metrics if metrics is not None else ServeMetrics(gateway)
    spread = RetrySpread(gateway.config.max_queue_len)

    def refusal(e: PrefixgateError) -> JSONResponse:
        wait = spread.delay(e) if isinstance(e, RetryableRejection) else None
        return error_response(e, min_retry_after=min_retry_after, retry_after=wait)
    state = _State()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.closing = True  # the server stops: not healthy, not ready

    app = FastAPI(title="prefixgate", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    app.state.serve = state
    app.state.metrics = meter

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}"
                            for e in errors)
        meter.http_refused("invalid")
        return _bad_request(message or "invalid request body", param)

    @app.get("/health")
    async def health() -> Response:
        if state.closing:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.closing or not gateway.healthy:
            return JSONResponse({"status": "not_ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        body, content_type = meter.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": served, "object": "model", "created": int(time.time()), "owned_by": "prefixgate",
            "root": served, "max_model_len": gateway.engine.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                meter.http_refused("invalid")
                return _bad_request("prompt: batches are not supported; send one prompt per request",
                                    "prompt")
            prompt = prompt[0]
        return await _serve(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        return await _serve(request, body, messages, chat=True, tools=body.tools,
                            chat_template_kwargs=body.chat_template_kwargs)

    async def _serve(request: Request, body: CompletionRequest | ChatCompletionRequest, prompt: Any, *,
                     chat: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> Response:
        if body.model is not None and body.model != served:
            meter.http_refused("invalid")
            return _bad_request(f"The model `{body.model}` does not exist; this server serves "
                                f"`{served}`.", "model", status=404)
        tenant = request.headers.get(tenant_header)
        endpoint = "chat" if chat else "completions"
        started = time.monotonic()
        try:
            params = build(sampling_fields(body))
            stream = await _or_disconnect(request, gateway.submit(
                prompt, params, tenant=tenant, priority=body.priority, tools=tools,
                chat_template_kwargs=chat_template_kwargs))
        except PrefixgateError as e:
            meter.http_refused(e.outcome.value)
            return refusal(e)
        except ClientDisconnected:
            meter.disconnected("before_admission")
            return Response(status_code=499)
        with meter.in_flight(tenant):
            def on_first() -> None:
                ticket = stream.ticket
                wait = (None if ticket is None or ticket.dispatched_at is None
                        else ticket.dispatched_at - ticket.arrival)
                meter.first_token(endpoint, time.monotonic() - started, wait)

            feed = _Feed(stream, on_first)

            async def until(work: Awaitable[Any], phase: str) -> tuple[Any, Response | None]:
                """``work``'s result, or the response that ends the request (the client
                left during ``phase``: 499; a refusal or an engine error) with its feed closed."""
                try:
                    return await _or_disconnect(request, work), None
                except ClientDisconnected:
                    meter.disconnected(phase)
                    ended: Response = Response(status_code=499)
                except PrefixgateError as e:
                    ended = refusal(e)
                await feed.aclose()
                return None, ended

            first, ended = await until(feed.next(), "queued")
            if ended is not None:
                return ended
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}"
            created = int(time.time())
            if not body.stream:
                last, ended = await until(_last(feed, first), "running")
                if ended is not None:
                    return ended
                await feed.aclose()
                done, use = _completion(last), _usage(last)
                make = chat_response if chat else completion_response
                return JSONResponse(make(rid, served, created, done.text, done.finish_reason, use))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(feed, first, rid, served, created, chat, include_usage, meter, tenant)
        return _ClosingEventSource(events, sep="\n", ping=int(max(1, ping_seconds)), feed=feed, meter=meter)

    return app


async def _last(feed: _Feed, out: Any) -> Any:
    """The stream's final output (``out`` and what follows it)."""
    while not out.finished:
        nxt = await feed.next()
        if nxt is None:
            break
        out = nxt
    return out


async def _events(feed: _Feed, first: Any, rid: str, model: str, created: int, chat: bool,
                  include_usage: bool, meter: ServeMetrics, tenant: str | None
                  ) -> AsyncIterator[dict[str, str]]:
    """The SSE events of one streamed response: a chunk per output (with the new text), the
    usage chunk if asked, then ``[DONE]``. An error after the first output is an ``error`` chunk
    (OpenAI's shape) before ``[DONE]``; a client that leaves cancels the request."""
    delta = _Delta()
    out: Any = first
    with meter.in_flight(tenant):
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                yield {"data": json.dumps(chat_chunk(rid, model, created, role, None))}
            while out is not None:
                done = _completion(out)
                text = delta.take(done.text)
                reason = done.finish_reason if out.finished else None
                if text or reason is not None:
                    chunk = (completion_chunk(rid, model, created, text, reason) if not chat
                             else chat_chunk(rid, model, created, {"content": text} if text else {}, reason))
                    yield {"data": json.dumps(chunk)}
                if out.finished:
                    if include_usage:
                        yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk" if chat
                                                   else "text_completion", "created": created,
                                                   "model": model, "choices": [], "usage": _usage(out)})}
                    break
                out = await feed.next()
        except PrefixgateError as e:
            yield {"data": json.dumps(json.loads(bytes(error_response(e).body)))}
        finally:
            await feed.aclose()  # a client that left is counted by the response (_ClosingEventSource)
    yield {"data": "[DONE]"}
