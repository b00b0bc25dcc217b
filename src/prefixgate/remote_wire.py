"""The wire side of :class:`~prefixgate.remote.RemoteVllm`: what a vLLM OpenAI-compatible server
sends and takes.

Its streamed outputs as vLLM-shaped values (:class:`RemoteOutput`), the few ``/metrics``
samples prefixgate reads (:func:`parse_metrics`: a line filter, not a full Prometheus parser,
because a vLLM server's exposition is ~60 KB of histograms scraped several times a second on the
gateway's event loop), tokenization over ``/tokenize``, and the error an HTTP refusal maps to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .cache_events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent
from .engine import Tokenizer
from .errors import EngineError, InvalidRequest, Overloaded, PrefixgateError, Reason

__all__ = ["SAMPLING_FIELDS", "RemoteCompletion", "RemoteOutput", "RemoteTokenizer", "http_error",
           "kv_events", "load_tokenizer", "parse_metrics"]

SAMPLING_FIELDS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words", "n",
    "structured_outputs", "response_format", "user",
})
"""The ``/v1/completions`` body fields a request's sampling parameters may set."""

class RemoteCompletion:
    """One completion of a :class:`RemoteOutput`, shaped like vLLM's ``CompletionOutput``.

    Cumulative, as vLLM's default outputs are, but without copying per output: each one is a
    view of how far the request's growing token and text lists had got, made into a tuple or a
    string only when read (a 2,000-token stream would otherwise copy a million ids).

    Attributes:
        token_ids: Every output token id so far.
        text: Every output character so far.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ... on the last output, else ``None``.
    """

    __slots__ = ("_ids", "_k", "_n", "_parts", "finish_reason")

    def __init__(self, ids: list[int], parts: list[str], finish_reason: str | None = None) -> None:
        self._ids, self._n = ids, len(ids)
        self._parts, self._k = parts, len(parts)
        self.finish_reason = finish_reason

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids[: self._n])

    @property
    def text(self) -> str:
        return "".join(self._parts[: self._k])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemoteCompletion):
            return NotImplemented
        return (self.token_ids, self.text, self.finish_reason) == (other.token_ids, other.text,
                                                                    other.finish_reason)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"RemoteCompletion(token_ids=<{self._n} ids>, text={self.text[:40]!r}, "
                f"finish_reason={self.finish_reason!r})")


@dataclass(frozen=True, slots=True)
class RemoteOutput:
    """One streamed output of a request to a vLLM server, shaped like vLLM's ``RequestOutput``
    with the default (cumulative) output kind.

    Attributes:
        request_id: The gateway's request id.
        prompt_token_ids: The prompt as sent.
        outputs: The completion so far (one: ``n`` must be 1).
        finished: Whether this is the request's last output.
        num_cached_tokens: Prompt tokens the server served from its prefix cache, on the last
            output, when the server reports them (``--enable-prompt-tokens-details``).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    outputs: tuple[RemoteCompletion, ...]
    finished: bool
    num_cached_tokens: int | None = None


# -- /metrics ------------------------------------------------------------------------------

_WANTED = {
    "vllm:kv_cache_usage_perc": "usage", "vllm:gpu_cache_usage_perc": "usage",
    "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "queries", "vllm:gpu_prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits", "vllm:gpu_prefix_cache_hits_total": "hits",
    "vllm:num_preemptions_total": "preemptions", "vllm:iteration_tokens_total_count": "steps",
    "process_start_time_seconds": "started",
}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, Any]:
    """The samples prefixgate reads from a vLLM server's Prometheus text exposition.

    Returns:
        ``usage`` (mean over engines), ``running``, ``waiting``, ``queries``, ``hits``,
        ``preemptions`` and ``steps`` (sums over engines), ``started`` (the server process's
        start time), and ``cache_config`` (the labels of ``vllm:cache_config_info``), each
        present only if the exposition has it.
    """
    sums: dict[str, float] = {}
    usage: list[float] = []
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        if name == "vllm:cache_config_info":
            end = line.rfind("}")
            out["cache_config"] = dict(_LABEL.findall(line[brace + 1:end]))
            continue
        key = _WANTED.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if key == "usage":
            usage.append(value)
        else:
            sums[key] = sums.get(key, 0.0) + value
    out.update(sums)
    if usage:
        out["usage"] = sum(usage) / len(usage)
    return out


# -- the tokenizer over HTTP ----------------------------------------------------------------

class RemoteTokenizer:
    """Tokenizes with the server's ``/tokenize`` (a blocking HTTP call per prompt, on the
    calling thread): for when no local copy of the model's tokenizer is at hand. A local copy
    (``RemoteVllm.connect(url, tokenizer=path)``) is far faster. Chat templates are not
    rendered over HTTP: chat prompts need a local tokenizer.

    Args:
        url: The server's base URL.
        model: The served model's name.
        timeout: Seconds a call may take.
    """

    def __init__(self, url: str, model: str, *, timeout: float = 10.0,
                 headers: Mapping[str, str] | None = None) -> None:
        import httpx

        self._client = httpx.Client(base_url=url, timeout=timeout, headers=dict(headers or {}))
        self._model = model

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            reply = self._client.post("/tokenize", json={
                "model": self._model, "prompt": text, "add_special_tokens": add_special_tokens})
        except Exception as e:
            raise EngineError(f"/tokenize failed: {e}") from e
        if reply.status_code != 200:
            raise InvalidRequest(f"/tokenize refused the prompt ({reply.status_code}): {reply.text[:200]}")
        return list(reply.json()["tokens"])

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None, tokenize: bool,
                            add_generation_prompt: bool, **kwargs: Any) -> Any:
        raise InvalidRequest("chat prompts need the model's tokenizer at hand: pass "
                             "RemoteVllm.connect(url, tokenizer=<local path>)")

    def close(self) -> None:
        """Closes its HTTP connections."""
        self._client.close()


def load_tokenizer(source: Any) -> Tokenizer:
    """The Hugging Face tokenizer at ``source`` (a local path or a name ``transformers`` finds)."""
    from transformers import AutoTokenizer

    return cast(Tokenizer, AutoTokenizer.from_pretrained(str(source)))



def http_error(request_id: str, status: int, body: str, retry_after: str | None) -> PrefixgateError:
    """prefixgate's error for a refused completions call."""
    try:
        message = json.loads(body).get("error", {}).get("message") or body
    except (ValueError, AttributeError):
        message = body
    message = str(message)[:500]
    if status in (429, 503):
        try:
            wait = float(retry_after) if retry_after is not None else 1.0
        except ValueError:
            wait = 1.0
        return Overloaded(f"the server refused {request_id} ({status}): {message}", retry_after=wait,
                          reason=Reason.ENGINE_BUSY)
    if 400 <= status < 500:
        return InvalidRequest(f"the server refused {request_id} ({status}): {message}")
    return EngineError(f"the server failed on {request_id} ({status}): {message}")


def kv_events(batch: Any) -> list[CacheEvent]:
    """The cache events of one decoded vLLM ``KVEventBatch`` (``[ts, events, dp_rank]``, as
    ``--kv-events-config`` publishes them over ZMQ, msgpack-encoded), as
    :mod:`~prefixgate.cache_events` values.

    Only the engine's own KV counts (``medium`` ``GPU``, the main cache group): blocks in an
    offloading tier are not what a request hits first. A stored run whose extra keys hold more
    than a cache salt and the LoRA name (media, prompt embeddings) is marked ``media`` (the
    gateway keys those on what it was sent, not on what the event says); one without extra keys
    at all (a vLLM older than the salt in its events) has ``salt_known`` false.

    Raises:
        ValueError: ``batch`` is not shaped like a ``KVEventBatch``.
    """
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise ValueError(f"not a KVEventBatch: {type(batch).__name__}")
    out: list[CacheEvent] = []
    for event in batch[1]:
        if not isinstance(event, Mapping):
            raise ValueError(f"not a KV cache event: {type(event).__name__}")
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            out.append(CacheCleared())
            continue
        if event.get("medium") not in (None, "GPU") or event.get("group_idx") not in (None, 0):
            continue
        hashes = tuple(event.get("block_hashes") or ())
        if kind == "BlockRemoved":
            out.append(BlocksRemoved(hashes))
        elif kind == "BlockStored":
            lora = event.get("lora_name")
            extra = event.get("extra_keys") or []
            salt, media = None, False
            for i, keys in enumerate(extra):
                values = list(keys or ())
                if lora is not None and values[:1] == [lora]:
                    values = values[1:]
                strings = [v for v in values if isinstance(v, str)]
                media = media or len(strings) < len(values) or (i > 0 and bool(strings))
                if i == 0 and strings:
                    salt, media = strings[-1], media or len(strings) > 1
            tokens = tuple(event.get("token_ids") or ())
            out.append(BlocksStored(hashes, event.get("parent_block_hash"), tokens, salt, lora, media=media,
                                    salt_known="extra_keys" in event))
    return out
