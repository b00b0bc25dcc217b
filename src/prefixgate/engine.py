"""The engine boundary: the narrow protocol prefixgate consumes, and the values that cross it.

Anything that can generate from token ids, abort, and tell its block size, capacity and KV
state fits: :class:`~prefixgate.vllm_engine.VllmEngine` (an in-process ``AsyncLLMEngine``),
:class:`~prefixgate.sim.SimEngine`, or a user's fake. Engines raise prefixgate's own error
types (:class:`~prefixgate.errors.EngineError`, :class:`~prefixgate.errors.InvalidRequest`), so
nothing above this module knows which engine it talks to.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .errors import InvalidRequest

__all__ = ["Engine", "EngineRequest", "KvStats", "Media", "SamplingCheck", "Tokenizer", "check_max_tokens"]


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


@runtime_checkable
class Engine(Protocol):
    """What prefixgate needs from an inference engine.

    Outputs are the engine's own objects (vLLM ``RequestOutput`` for vLLM); prefixgate reads
    ``finished`` and ``num_cached_tokens`` from them and passes them through unchanged.
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

    def default_sampling_params(self) -> Any:
        """Sampling parameters used when a caller gives none."""
        ...

    # Optional: ``build_sampling_params(fields: Mapping[str, Any]) -> Any`` builds the engine's
    # sampling parameters from a mapping of their fields (``generate(prompt, {"max_tokens": 64})``)
    # and raises ``InvalidRequest`` for what its constructor refuses. Engines without it take
    # only their own parameters object.

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
            Overloaded: With reason ``"engine_busy"``, if the engine's own admission limit
                refuses it (vLLM's ``max_num_queued_reqs``); the gateway fills in
                ``retry_after`` from its drain rate.
            EngineError: If the engine fails; ``EngineDead`` if it died.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stops ``request_id`` and frees its KV blocks; a no-op for unknown or finished ids."""
        ...

    def kv_stats(self) -> KvStats | None:
        """The latest KV state, or ``None`` if the engine has reported none yet."""
        ...
