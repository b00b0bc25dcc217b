"""Ingress: validate, canonicalize, tokenize and key a request into a :class:`Ticket`.

Synchronous and side-effect free: a request that fails here raises a typed
:class:`~prefixgate.errors.Rejected` error and nothing of it is queued or reserved.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from .canonicalize import Canonicalized, canonicalize_messages, canonicalize_text
from .clock import Clock
from .config import GatewayConfig
from .engine import Engine
from .errors import InvalidRequest, PromptTooLong
from .keys import Namespace, block_hashes, cacheable_blocks
from .tickets import Ticket

__all__ = ["Ingress", "Prompt"]

Prompt = str | bytes | Sequence[Mapping[str, Any]]
"""A plain prompt (``str``, or UTF-8 ``bytes``) or a list of chat messages."""

# A prompt this many characters per allowed token is refused before tokenizing it: no real
# tokenizer averages that many characters per token, and tokenizing megabytes blocks the loop.
_MAX_CHARS_PER_TOKEN = 64


def _check_utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} is not valid Unicode text (lone surrogate at {e.start})") from None


class Ingress:
    """Turns a caller's request into a ticket, or refuses it.

    Args:
        engine: Supplies the tokenizer, block size, model limits and sampling-parameter checks.
        config: Canonicalization, key seed, tenant and length rules.
        clock: Timestamps arrivals.
    """

    def __init__(self, engine: Engine, config: GatewayConfig, clock: Clock) -> None:
        self.engine = engine
        self.config = config
        self.clock = clock
        self.model = config.model_name or engine.model_name
        self.block_size = engine.block_size
        self.max_model_len = engine.max_model_len
        limit = self.max_model_len - 1
        if config.max_prompt_tokens is not None:
            limit = min(limit, config.max_prompt_tokens)
        self.max_prompt_tokens = limit
        self._seq = itertools.count()

    def make_ticket(
        self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
        request_id: str | None = None, lora_request: Any = None, priority: int = 0,
    ) -> Ticket:
        """Validates and keys one request.

        Raises:
            InvalidRequest: Malformed prompt, tenant, request id or sampling parameters.
            PromptTooLong: More prompt tokens than the model (or ``max_prompt_tokens``) allows.
        """
        tenant = self._check_tenant(tenant)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id must be a non-empty string")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an int, got {priority!r}")
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()
        check = self.engine.check_sampling_params(sampling_params)

        canon = self._canonicalize(prompt)
        token_ids = self._tokenize(canon.value)
        n = len(token_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty after canonicalization and tokenization")
        if n > self.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt has {n} tokens; at most {self.max_prompt_tokens} are accepted "
                f"(max_model_len {self.max_model_len} leaves room for one output token)",
                num_tokens=n, limit=self.max_prompt_tokens)

        lora_name = getattr(lora_request, "lora_name", None) if lora_request is not None else None
        isolated = tenant if self.config.isolate_tenants else None
        namespace = Namespace(self.model, lora_name, isolated)
        try:
            hashes = block_hashes(token_ids, self.block_size, namespace, seed=self.config.key_seed)
        except ValueError as e:
            raise InvalidRequest(f"tokenizer produced invalid token ids: {e}") from None
        salt = None
        if isolated is not None:
            digest = xxhash.xxh3_128_hexdigest(isolated.encode(), self.config.key_seed)
            salt = f"prefixgate-{digest}"
        return Ticket(
            request_id=request_id, tenant=tenant, namespace=namespace,
            prompt_token_ids=tuple(token_ids), block_hashes=hashes,
            cacheable_blocks=cacheable_blocks(n, self.block_size) if check.reads_cache else 0,
            sampling_params=sampling_params, max_tokens=check.max_tokens, cache_salt=salt,
            lora_request=lora_request, priority=priority, arrival=self.clock.now(),
            canonicalized=canon.changed, chars_removed=canon.chars_removed,
            seq=next(self._seq),
        )

    def _check_tenant(self, tenant: str | None) -> str | None:
        if tenant is None:
            return None
        if not isinstance(tenant, str) or not tenant:
            raise InvalidRequest(f"tenant must be a non-empty string or None, got {tenant!r}")
        known = self.config.known_tenants
        if known is not None and tenant not in known:
            raise InvalidRequest(f"unknown tenant {tenant!r}")
        return tenant

    def _canonicalize(self, prompt: Prompt) -> Canonicalized:
        limit_chars = self.max_prompt_tokens * _MAX_CHARS_PER_TOKEN
        if isinstance(prompt, bytes | bytearray | memoryview):
            try:
                prompt = bytes(prompt).decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidRequest(f"prompt bytes are not valid UTF-8 (at byte {e.start})") from None
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty")
            if len(prompt) > limit_chars:
                raise PromptTooLong(f"prompt has {len(prompt)} characters, far over the token limit",
                                    num_tokens=None, limit=self.max_prompt_tokens)
            _check_utf8(prompt, "prompt")
            return canonicalize_text(prompt, self.config.canonicalize)
        if not isinstance(prompt, Sequence) or not prompt:
            raise InvalidRequest("prompt must be a non-empty str, UTF-8 bytes, or a non-empty "
                                 f"list of chat messages; got {type(prompt).__name__}")
        total = 0
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidRequest(f"message {i} must be a mapping with a string 'role'")
            content = message.get("content")
            texts = [content] if isinstance(content, str) else [
                p.get("text") for p in content or () if isinstance(p, Mapping)]
            for text in texts:
                if isinstance(text, str):
                    _check_utf8(text, f"message {i}")
                    total += len(text)
        if total > limit_chars:
            raise PromptTooLong(f"messages have {total} characters, far over the token limit",
                                num_tokens=None, limit=self.max_prompt_tokens)
        return canonicalize_messages(prompt, self.config.canonicalize)

    def _tokenize(self, value: str | list[dict[str, Any]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        try:
            if isinstance(value, str):
                return list(tokenizer.encode(value))
            text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
            # The chat template writes its own special tokens (BOS included).
            return list(tokenizer.encode(text, add_special_tokens=False))
        except InvalidRequest:
            raise
        except Exception as e:  # tokenizers and templates raise anything from ValueError to Jinja's
            raise InvalidRequest(f"could not tokenize the prompt: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return (f"Ingress(model={self.model!r}, block_size={self.block_size}, "
                f"max_prompt_tokens={self.max_prompt_tokens})")
