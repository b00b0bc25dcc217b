"""The OpenAI request bodies ``prefixgate serve`` accepts, and the responses it writes.

Requests are pydantic models that refuse unknown fields (``extra="forbid"``): a field this
front does not implement (``tools`` parsing, ``logprobs``, ``n`` > 1, ...) is a 400 naming it,
never silently ignored. :func:`sampling_fields` turns a body into the mapping of vLLM
``SamplingParams`` fields that the gateway hands to its engine's ``build_sampling_params``
(``VllmEngine``: ``vllm.SamplingParams(**fields)``; ``RemoteVllm``: the ``/v1/completions``
fields). Responses are plain dicts in OpenAI's shape, built per output.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SAMPLING_KEYS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error_body",
    "sampling_fields",
    "usage",
]

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "skip_special_tokens")
"""Body fields passed through to the engine's sampling parameters (when set)."""


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, plus vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    skip_special_tokens: bool | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    logprobs: Literal[False] | None = None  # sent as null by some clients; logprobs are not implemented


class CompletionRequest(_Sampling):
    """A ``/v1/completions`` body: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    """One chat message: a role and its content (text, or OpenAI content parts)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """A ``/v1/chat/completions`` body. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; ``tools`` and ``chat_template_kwargs`` reach the chat template (tool calls
    in the output are not parsed: the text comes back as the message's content)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def sampling_fields(body: _Sampling) -> dict[str, Any]:
    """The body's sampling fields that were set, as vLLM ``SamplingParams`` keyword arguments."""
    fields = {k: v for k in SAMPLING_KEYS if (v := getattr(body, k)) is not None}
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        fields.setdefault("max_tokens", body.max_completion_tokens)
    return fields


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens`` (what the engine served
    from its prefix cache; 0 when it did not say)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens or 0}}


def _head(rid: str, obj: str, model: str, created: int | None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None
                     ) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return {**_head(rid, "text_completion", model, created),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                        use: dict[str, Any]) -> dict[str, Any]:
    """A whole (not streamed) ``text_completion``."""
    return {**completion_chunk(rid, model, created, text, finish_reason), "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None
               ) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``."""
    return {**_head(rid, "chat.completion.chunk", model, created),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                  use: dict[str, Any]) -> dict[str, Any]:
    """A whole (not streamed) ``chat.completion``."""
    return {**_head(rid, "chat.completion", model, created),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def error_body(message: str, kind: str, code: str | int | None, param: str | None = None
               ) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
