"""The engine boundary: the narrow protocol prefixgate consumes, and the values that cross it.

Anything that can generate from token ids, abort, tell its block size, capacity and KV state,
and say what a request's last output means (finished or aborted, cached tokens, output tokens)
fits: :class:`~prefixgate.vllm_engine.VllmEngine` (an in-process ``AsyncLLMEngine``),
:class:`~prefixgate.sim.SimEngine`, or a user's fake. Engines raise prefixgate's own error
types (:class:`~prefixgate.errors.EngineError`, :class:`~prefixgate.errors.InvalidRequest`), so
nothing above this module knows which engine it talks to, and nothing above the adapters parses
an engine's output objects (:meth:`Engine.completion` does).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .errors import InvalidRequest

__all__ = ["Completion", "Engine", "EngineRequest", "KvStats", "Media", "SamplingCheck", "Tokenizer",
           "check_max_tokens", "completion_reader", "engine_slots", "engine_step_tokens", "read_completion"]


@runtime_checkable
class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer that prefixgate uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        tokenize: bool, add_generation_prompt: bool, **kwargs: Any,
    ) -> Any:
        """Renders chat messages (and ``tools``, and the template's own ``kwargs``, such as
        ``enable_thinking``) to the model's prompt text."""
        ...


@dataclass(frozen=True, slots=True)
class Media:
    """One media item of a multimodal chat prompt, as it travels to the engine.

    vLLM keys a multimodal prompt's blocks on their tokens plus, for each block that a media
    item's placeholder tokens fall in, the item's hash; prefixgate mirrors that on the prompt as
    the chat template renders it (before a model's processor expands each placeholder).

    Attributes:
        modality: ``"image"``, ``"audio"`` or ``"video"``: the key of vLLM's ``multi_modal_data``.
        data: What the caller gave: a URL (``http(s)://`` or ``data:``) or the encoded bytes.
        identifier: xxh3-128 hex digest of the modality and ``data``; equal media, equal key.
        position: The index of the prompt token where the item sits (the first token at which a
            prompt with other media there could differ), or ``None`` before tokenization.
    """

    modality: str
    data: str | bytes
    identifier: str
    position: int | None = None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine receives it: already tokenized, never re-tokenized.

    Attributes:
        request_id: Unique among the engine's live requests.
        prompt_token_ids: The canonical prompt's token ids.
        sampling_params: The engine's own sampling parameters object.
        cache_salt: Salts the engine's prefix cache (tenant isolation); ``None`` shares it.
        lora_request: The engine's LoRA request, or ``None``.
        priority: Passed to engines that schedule by priority.
        media: The prompt's media items in prompt order, for multimodal chat prompts; ``None``
            for text. ``VllmEngine`` loads them and passes them as ``multi_modal_data``; engines
            that cannot use media ignore them (the simulator keys its cache on their positions
            and identifiers, as the gateway does).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: Any
    cache_salt: str | None = None
    lora_request: Any = None
    priority: int = 0
    media: tuple[Media, ...] | None = None


@dataclass(frozen=True, slots=True)
class SamplingCheck:
    """What the gateway needs to know about a request's validated sampling parameters.

    Attributes:
        max_tokens: The requested output limit, or ``None`` when the engine decides.
        reads_cache: ``False`` when the engine will not read the prefix cache for this request
            (vLLM skips it when prompt logprobs are asked for).
    """

    max_tokens: int | None
    reads_cache: bool = True


def check_max_tokens(value: Any) -> int | None:
    """A request's ``max_tokens`` as an int (``None`` stays ``None``), or ``InvalidRequest``.

    vLLM's ``SamplingParams`` accepts any number, NaN and infinity included; a number vLLM would
    serve (finite, at least 1) is accepted and rounded up, anything else is refused here.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"max_tokens must be a number or None, got {value!r}")
    if not math.isfinite(value) or value < 1:
        raise InvalidRequest(f"max_tokens must be a finite number >= 1, got {value!r}")
    return math.ceil(value)


@dataclass(frozen=True, slots=True)
class KvStats:
    """The engine's KV state after one scheduler step.

    ``free_blocks`` counts blocks no running request holds; cached-but-unreferenced blocks are
    free (evictable), as in vLLM's ``kv_cache_usage = 1 - free / total``. Counters are
    cumulative since the engine started.

    Attributes:
        time: When the step was recorded, on the gateway's clock.
        total_blocks: KV capacity in blocks that requests can use.
        free_blocks: Blocks not held by a running request.
        running: Requests the engine is running.
        waiting: Requests waiting inside the engine.
        prefix_queries: Prompt tokens looked up in the prefix cache so far.
        prefix_hits: Of those, tokens served from cache.
        preemptions: Requests preempted so far.
        steps: Scheduler steps recorded so far.
    """

    time: float
    total_blocks: int
    free_blocks: int
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    steps: int = 0

    @property
    def usage(self) -> float:
        """Share of blocks held by running requests, in [0, 1]."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0


class Completion(NamedTuple):
    """What a request's last output says, as :meth:`Engine.completion` reads it.

    A named tuple, not a frozen dataclass: one is made per request on the event loop, where a
    frozen dataclass's ``object.__setattr__`` per field costs more.

    Attributes:
        aborted: The engine aborted the request (vLLM: ``finish_reason == "abort"``) instead of
            finishing it.
        cached_tokens: Prompt tokens served from the prefix cache (vLLM ``num_cached_tokens``),
            or ``None`` if the engine does not say.
        token_ids: Every output token id of the request, or ``None`` when the last output does
            not hold them all (vLLM ``RequestOutputKind.DELTA``, or ``n > 1`` completions).
    """

    aborted: bool
    cached_tokens: int | None
    token_ids: Sequence[int] | None


def read_completion(output: Any, sampling_params: Any) -> Completion | None:
    """Reads a vLLM ``RequestOutput``-shaped output: ``None`` unless ``output.finished``; else
    its :class:`Completion` (``outputs[0].finish_reason``, ``num_cached_tokens``, and
    ``outputs[0].token_ids`` when there is one completion and ``sampling_params`` does not ask
    for ``DELTA`` outputs). The default of engines without :meth:`Engine.completion`."""
    if not getattr(output, "finished", False):
        return None
    completions: Sequence[Any] = getattr(output, "outputs", None) or ()
    aborted = bool(completions) and getattr(completions[0], "finish_reason", None) == "abort"
    token_ids = None
    if len(completions) == 1:
        kind = getattr(sampling_params, "output_kind", None)
        if getattr(kind, "name", None) != "DELTA":
            token_ids = completions[0].token_ids
    # tuple.__new__ itself: a NamedTuple's own __new__ is a Python function, called per request.
    return tuple.__new__(Completion, (aborted, getattr(output, "num_cached_tokens", None), token_ids))


@runtime_checkable
class Engine(Protocol):
    """What prefixgate needs from an inference engine: every member the gateway uses.

    Outputs are the engine's own objects (vLLM ``RequestOutput`` for vLLM), passed through
    unchanged; only the engine reads them (:meth:`completion`).

    Two members are optional at run time, for engines written before they were part of the
    protocol: without ``max_num_seqs`` the engine is taken to have no concurrency limit of its
    own (``None``), and without ``completion`` outputs are read as vLLM ``RequestOutput`` objects by
    :func:`read_completion`. :func:`engine_slots` and :func:`completion_reader` apply these
    defaults; ``isinstance(engine, Engine)`` is true only for engines that have both.

    One more attribute is read if present, and is not part of the protocol:
    ``max_num_batched_tokens``, the most tokens one engine step schedules (vLLM's chunked-prefill
    budget), or ``None``; :func:`engine_step_tokens` reads it. It sizes the default dispatch
    pacing (``GatewayConfig.prefill_backlog_steps``); without it the gateway does not pace.
    """

    @property
    def model_name(self) -> str:
        """The served model's name; part of every block key's namespace."""
        ...

    @property
    def block_size(self) -> int:
        """The KV block size in tokens, as configured at runtime."""
        ...

    @property
    def num_blocks(self) -> int:
        """KV capacity in blocks that requests can use (vLLM: ``num_gpu_blocks`` less its
        null block)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the engine accepts."""
        ...

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's own tokenizer."""
        ...

    @property
    def max_num_seqs(self) -> int | None:
        """The most requests the engine runs at once (vLLM ``max_num_seqs``), or ``None`` if it
        has no such limit. Sizes the gateway's in-flight window, tenants' in-flight shares, and
        the engine's own backlog in queue-wait estimates. Optional (see the class)."""
        ...

    def default_sampling_params(self) -> Any:
        """Sampling parameters used when a caller gives none."""
        ...

    # Optional: ``build_sampling_params(fields: Mapping[str, Any]) -> Any`` builds the engine's
    # sampling parameters from a mapping of their fields (``generate(prompt, {"max_tokens": 64})``)
    # and raises ``InvalidRequest`` for what its constructor refuses. Engines without it take
    # only their own parameters object.

    # Optional: ``watch_health(listener: Callable[[bool], None]) -> None``: the engine checks its
    # own health (a remote server: ``RemoteVllm``) and calls ``listener`` with each verdict; the
    # gateway takes the replica out while it fails and back once it passes.

    # Optional: ``add_cache_listener(listener: Callable[[Sequence[CacheEvent]], None]) ->
    # Callable[[], None] | None``: the engine reports what its prefix cache stores and evicts
    # (:mod:`prefixgate.cache_events`; vLLM's KV cache events) by calling ``listener`` with each
    # batch, and returns what removes the listener (``None``: it reports nothing). The gateway's
    # mirror of the engine then follows every request's blocks, other gateways' included.

    # Optional: ``stats_max_age: float``: how old this engine's :meth:`kv_stats` may be before it
    # counts as silent, when that is more than ``GatewayConfig.stats_max_age`` (stats pulled over
    # HTTP are as fresh as the pull's timeout guarantees, not one scheduler step).

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        """Validates ``sampling_params`` for this engine.

        Returns:
            The facts about them that admission and cache prediction need.

        Raises:
            InvalidRequest: If the parameters are of the wrong type or out of range.
        """
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Starts ``request`` and streams its outputs; the last one has ``finished`` set.

        Raises:
            InvalidRequest: If the engine refuses the request as malformed.
            Overloaded: With reason :attr:`~prefixgate.errors.Reason.ENGINE_BUSY`, if the
                engine's own admission limit refuses it (vLLM's ``max_num_queued_reqs``); the gateway fills in
                ``retry_after`` from its drain rate.
            EngineError: If the engine fails; ``EngineDead`` if it died.
        """
        ...

    def completion(self, output: Any, sampling_params: Any) -> Completion | None:
        """Reads one of :meth:`generate`'s outputs: ``None`` while the request goes on, its
        :class:`Completion` for the last one (finished or aborted). Called for every output:
        keep it cheap. Optional (see the class).

        Args:
            output: An output of the request.
            sampling_params: The request's sampling parameters (they say whether outputs are
                deltas or cumulative).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stops ``request_id`` and frees its KV blocks; a no-op for unknown or finished ids."""
        ...

    def kv_stats(self) -> KvStats | None:
        """The latest KV state, or ``None`` if the engine has reported none yet."""
        ...


def engine_slots(engine: Engine) -> int | None:
    """``engine.max_num_seqs``, or ``None`` for an engine without it."""
    return getattr(engine, "max_num_seqs", None)


def engine_step_tokens(engine: Engine) -> int | None:
    """``engine.max_num_batched_tokens`` (tokens one step schedules), or ``None`` for an engine
    without it."""
    value = getattr(engine, "max_num_batched_tokens", None)
    return int(value) if value else None


def completion_reader(engine: Engine) -> Callable[[Any, Any], Completion | None]:
    """``engine.completion``, or :func:`read_completion` for an engine without it."""
    return getattr(engine, "completion", read_completion)
