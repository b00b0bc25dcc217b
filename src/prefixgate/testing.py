"""Fakes for testing code that uses prefixgate: a byte tokenizer, a fake engine, clocks, and
:func:`run_until_idle`.

:class:`FakeEngine` implements :class:`~prefixgate.engine.Engine` with a toy prefix cache (no
eviction, no scheduler) and hooks for fault injection. It is for unit tests of *your* code; the
faithful simulator of vLLM is :class:`prefixgate.sim.SimEngine`.

Tests need no hand-written ``await asyncio.sleep(0)`` spins: ``await run_until_idle()`` returns
once everything started has gone as far as it can, and with an :class:`AutoClock`, ``await
clock.sleep(seconds)`` lets that much virtual time pass, every timer due on the way firing in
order::

    clock = AutoClock()
    engine = FakeEngine(clock=clock, output_time=1.0)      # one output per virtual second
    async with Gateway(engine, GatewayConfig(max_in_flight=1), clock=clock) as gw:
        tasks = [asyncio.create_task(consume(gw.generate(p, FakeSamplingParams(2)))) for p in ps]
        await run_until_idle()                            # all queued, the first dispatched
        assert gw.statistics().running == 1
        await clock.sleep(2.5)                            # the first finished at t=2
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cache_events import BlocksStored, CacheEvent, CacheListeners
from .clock import AutoClock, Clock, FakeClock, run_until_idle
from .engine import EngineRequest, KvStats, SamplingCheck, check_max_tokens, read_completion
from .errors import EngineDead, EngineError, InvalidRequest

__all__ = ["AutoClock", "ByteTokenizer", "FakeClock", "FakeCompletion", "FakeEngine", "FakeOutput",
           "FakeSamplingParams", "NullEngine", "run_until_idle"]


class ByteTokenizer:
    """Token id = UTF-8 byte + 2 (0 is BOS, 1 is EOS). Encodes any text; no BOS is added."""

    bos_token_id = 0
    eos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 2 for i in ids if i >= 2).decode("utf-8", "replace")

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None, tokenize: bool,
                            add_generation_prompt: bool, **kwargs: Any) -> Any:
        """``<tools>[...]`` (JSON) when there are tools, then ``<role>content`` per message
        (content parts: their text, ``<image>`` and the like for media), then ``<assistant>``
        and, per template variable, ``<name=value>`` (JSON)."""
        text = f"<tools>{json.dumps(list(tools))}\n" if tools else ""
        for m in conversation:
            content = m.get("content") or ""
            if not isinstance(content, str):
                content = "".join(p["text"] if p.get("type", "text") == "text" else f"<{p['type']}>"
                                  for p in content)
            text += f"<{m['role']}>{content}\n"
        if add_generation_prompt:
            text += "<assistant>"
            text += "".join(f"<{k}={json.dumps(v)}>" for k, v in kwargs.items())
        return self.encode(text) if tokenize else text


@dataclass(frozen=True, slots=True)
class FakeSamplingParams:
    """Sampling parameters for :class:`FakeEngine`: only ``max_tokens`` matters."""

    max_tokens: int | None = 16


@dataclass(frozen=True, slots=True)
class FakeCompletion:
    """Mirrors vLLM's ``CompletionOutput`` fields that prefixgate and tests read."""

    token_ids: tuple[int, ...]
    text: str = ""
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class FakeOutput:
    """Mirrors vLLM's ``RequestOutput`` fields that prefixgate and tests read."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[FakeCompletion, ...]
    finished: bool
    num_cached_tokens: int = 0


@dataclass(slots=True)
class FakeEngine:
    """An :class:`~prefixgate.engine.Engine` that echoes token ``7`` ``max_tokens`` times.

    Its cache remembers every full block it has seen (by tuple of all tokens up to the block's
    end), never evicts, and reports ``num_cached_tokens`` as vLLM would. Each output waits
    ``output_time`` seconds on ``clock`` if both are set, else for ``step`` (an
    ``asyncio.Event`` tests can hold), else yields to the loop once. ``max_num_seqs`` is only
    reported (the gateway sizes its window and counts the engine's backlog from it); the fake
    runs every request at once. So is ``max_num_batched_tokens`` (it sizes the default dispatch
    pacing; ``None``, the default, leaves a gateway over the fake unpaced). A request's media are
    kept (``requests``) but not keyed: the toy cache sees only tokens (the faithful keying is
    :class:`prefixgate.sim.SimEngine`'s).

    Attributes:
        running: Request ids currently generating.
        aborted: Request ids aborted, in order.
        started: Request ids started, in order.
        fail_after: If set, a request raises ``EngineError`` after this many outputs.
        die_after: If set, the engine dies (``EngineDead``) after this many outputs in total.
        refuse: If set, ``generate`` raises ``InvalidRequest`` with this message.
        healthy: What the engine reports of its own health (:attr:`Gateway.healthy
            <prefixgate.Gateway.healthy>` reads it, as it reads ``VllmEngine.healthy``).
    """

    block_size: int = 4
    num_blocks: int = 1024
    max_model_len: int = 4096
    model_name: str = "fake-model"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    step: asyncio.Event | None = None
    clock: Clock | None = None
    output_time: float = 0.0
    fail_after: int | None = None
    die_after: int | None = None
    refuse: str | None = None
    healthy: bool = True
    running: set[str] = field(default_factory=set)
    aborted: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    requests: list[EngineRequest] = field(default_factory=list)
    _cache: set[tuple[Any, ...]] = field(default_factory=set)
    _outputs: int = 0
    _dead: bool = False
    _stats: KvStats | None = None

    def default_sampling_params(self) -> FakeSamplingParams:
        return FakeSamplingParams()

    def build_sampling_params(self, fields: Mapping[str, Any]) -> FakeSamplingParams:
        """``FakeSamplingParams(**fields)``; an unknown field is ``InvalidRequest``."""
        try:
            return FakeSamplingParams(**fields)
        except TypeError as e:
            raise InvalidRequest(f"invalid sampling parameters: {e}") from None

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        if not isinstance(sampling_params, FakeSamplingParams):
            raise InvalidRequest("FakeEngine takes FakeSamplingParams")
        return SamplingCheck(max_tokens=check_max_tokens(sampling_params.max_tokens))

    def kv_stats(self) -> KvStats | None:
        return self._stats

    completion = staticmethod(read_completion)  # outputs mirror vLLM's; runs for every output

    def set_kv_stats(self, stats: KvStats) -> None:
        """Sets what :meth:`kv_stats` returns."""
        self._stats = stats

    def _hit_tokens(self, ids: tuple[int, ...], salt: str | None) -> int:
        hits = 0
        for end in range(self.block_size, len(ids), self.block_size):  # last token recomputed
            if (salt, ids[:end]) not in self._cache:
                break
            hits = end
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            self._cache.add((salt, ids[:end]))
        return hits

    async def generate(self, request: EngineRequest) -> AsyncIterator[FakeOutput]:
        if self._dead:
            raise EngineDead("fake engine is dead")
        if self.refuse is not None:
            raise InvalidRequest(self.refuse)
        ids = tuple(request.prompt_token_ids)
        self.requests.append(request)
        self.started.append(request.request_id)
        self.running.add(request.request_id)
        hits = self._hit_tokens(ids, request.cache_salt)
        room = max(1, self.max_model_len - len(ids))  # as vLLM: output stops at the context length
        n = min(math.ceil(request.sampling_params.max_tokens or 16), room)
        out: tuple[int, ...] = ()
        try:
            for i in range(n):
                if self.clock is not None and self.output_time > 0:
                    await self.clock.sleep(self.output_time)
                elif self.step is not None:
                    await self.step.wait()
                else:
                    await asyncio.sleep(0)
                if request.request_id not in self.running:  # aborted meanwhile
                    return
                self._outputs += 1
                if self.die_after is not None and self._outputs > self.die_after:
                    self._dead = True
                    raise EngineDead("fake engine died")
                if self.fail_after is not None and i >= self.fail_after:
                    raise EngineError("fake engine failed")
                out += (7,)
                done = i == n - 1
                yield FakeOutput(request.request_id, ids,
                                 (FakeCompletion(out, finish_reason="length" if done else None),),
                                 done, hits)
        finally:
            self.running.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running.discard(request_id)
        self.aborted.append(request_id)


@dataclass(slots=True)
class NullEngine:
    """An :class:`~prefixgate.engine.Engine` that does nothing: each request gets one finished
    output (one token, no cache hits) at once. For measuring the gateway's own cost.

    Attributes:
        started: How many requests it was given.
        on_generate: Called with each request as the engine receives it (instrumentation).
        on_output: Called just before the output is yielded (instrumentation).
        cache_events: Publish, for each request, that every full block of its prompt was stored
            (fresh hashes, as for a prompt never seen: the most a follower has to re-key), to
            listeners added with :meth:`add_cache_listener`. For measuring what following the
            engine's cache events costs the gateway.
    """

    tokenizer: Any = field(default_factory=ByteTokenizer)
    block_size: int = 16
    num_blocks: int = 1 << 20
    max_model_len: int = 1 << 20
    max_num_seqs: int | None = 256
    model_name: str = "null"
    started: int = 0
    on_generate: Any = None
    on_output: Any = None
    cache_events: bool = False
    _listeners: CacheListeners = field(default_factory=lambda: CacheListeners("a NullEngine"))
    _hashes: int = 0

    def default_sampling_params(self) -> FakeSamplingParams:
        return FakeSamplingParams(max_tokens=1)

    def add_cache_listener(self, listener: Callable[[Sequence[CacheEvent]], None]
                           ) -> Callable[[], None] | None:
        """Calls ``listener`` with each request's stored blocks (``cache_events``)."""
        return self._listeners.add(listener) if self.cache_events else None

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        return SamplingCheck(max_tokens=check_max_tokens(getattr(sampling_params, "max_tokens", None)))

    def kv_stats(self) -> KvStats | None:
        return None

    completion = staticmethod(read_completion)  # outputs mirror vLLM's; runs for every output

    async def generate(self, request: EngineRequest) -> AsyncIterator[FakeOutput]:
        self.started += 1
        if self.on_generate is not None:
            self.on_generate(request)
        if self._listeners:
            size = self.block_size
            full = len(request.prompt_token_ids) // size
            first, self._hashes = self._hashes, self._hashes + full
            event = BlocksStored(tuple(range(first, first + full)), None,
                                 tuple(request.prompt_token_ids[: full * size]), request.cache_salt)
            self._listeners.publish([event])
        out = FakeOutput(request.request_id, (), (FakeCompletion((7,), finish_reason="length"),), True)
        if self.on_output is not None:
            self.on_output(out)
        yield out

    async def abort(self, request_id: str) -> None:
        return None
