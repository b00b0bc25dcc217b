"""Ingress: validate, canonicalize, tokenize and key a request into a :class:`Ticket`.

Split in two so that the expensive part can leave the event loop:

1. :meth:`Ingress.check` (on the loop, microseconds): types, tenant, request id, sampling
   parameters, size limits, UTF-8. A request that fails here raises a typed
   :class:`~prefixgate.errors.Rejected` error at the call, and nothing of it is queued.
2. :func:`prepare` (pure, anywhere): canonicalize, tokenize with the engine's tokenizer, pack the
   token ids and hash their blocks. The gateway runs it inline for small or pre-tokenized
   prompts and on a virtual clock, else in an :mod:`~prefixgate.ingress_pool` worker.
3. :meth:`Ingress.ticket` (on the loop): length checks and the :class:`Ticket`; the prompt's key
   chain is interned against recent siblings so equal prefixes share one set of key objects.
"""

from __future__ import annotations

import itertools
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import xxhash

from .canonicalize import CanonicalizeConfig, RuleCount, canonicalize_messages, canonicalize_text
from .chat import ChatTemplate, check_template_args, media_of
from .clock import Clock
from .config import GatewayConfig
from .engine import Engine, Media, SamplingCheck
from .errors import InvalidRequest, PromptTooLong
from .keys import (
    BlockHash,
    ChainCache,
    Namespace,
    cacheable_blocks,
    common_prefix,
    media_extras,
    media_positions,
    pack_tokens,
)
from .tickets import Ticket

__all__ = ["Ingress", "IngressRequest", "Prepared", "Prompt", "fast_encoder", "prepare"]

Prompt = str | bytes | Sequence[Mapping[str, Any]] | Mapping[str, Any] | Sequence[int]
"""A plain prompt (``str``, or UTF-8 ``bytes``), a list of chat messages, or token ids (a list of
ints, or vLLM's ``TokensPrompt`` mapping ``{"prompt_token_ids": [...]}``).

A chat message's ``content`` is a string or a list of OpenAI-style parts: text
(``{"type": "text", "text": ...}``) and media, by URL (``{"type": "image_url", "image_url":
{"url": ...}}``, ``audio_url``, ``video_url``; ``http(s)://`` or ``data:``) or as encoded bytes
(``{"type": "image", "image": b"..."}``, ``audio``, ``video``)."""


# A prompt this many characters per allowed token is refused before tokenizing it: no real
# tokenizer averages that many characters per token, and tokenizing megabytes costs seconds.
_MAX_CHARS_PER_TOKEN = 64
_MAX_NAME_CHARS = 256  # a chat message's role or name
# What a prompt may not consist of alone: whitespace and zero-width format characters.
_BLANK = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
          "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"  # str.isspace()
          "\u200b\u200c\u200d\u2060\ufeff")

Encode = Callable[[str, bool], Sequence[int]]
"""``encode(text, add_special_tokens) -> token ids``."""


@dataclass(slots=True)
class IngressRequest:
    """A validated request, not yet tokenized. Exactly one of ``text`` and ``token_ids`` is set.

    Treated as immutable, but not frozen: a frozen dataclass sets each of these fields through
    ``object.__setattr__``, which costs microseconds per request on the event loop.

    Attributes:
        request_id: The engine request id.
        tenant: The tenant, or ``None``.
        namespace: Block-key namespace (model, LoRA, isolated tenant).
        root: The namespace's root key (the first block's parent).
        cache_salt: Passed to the engine, or ``None``.
        sampling_params: The engine's sampling parameters.
        check: What the engine said about them.
        lora_request: Passed to the engine.
        priority: Lower first under the ``priority`` ordering.
        arrival: Gateway clock time of the call.
        text: The prompt text to canonicalize and tokenize (chat messages already rendered).
        add_special_tokens: Whether the tokenizer adds its special tokens (``False`` for text
            rendered by a chat template, which writes its own).
        canonical: ``text`` is canonical already (chat messages are canonicalized before the
            template renders them); the fields below say what that changed.
        token_ids: The prompt's token ids, for pre-tokenized prompts.
        canonicalized: For chat messages: whether canonicalizing their contents changed them.
        chars_removed: For chat messages: characters canonicalization removed.
        rules: For chat messages: what each canonicalization rule changed.
        media: For multimodal chat messages: the media items in prompt order (no positions yet).
        media_chars: Where each media item sits in ``text``, in characters.
    """

    request_id: str
    tenant: str | None
    namespace: Namespace
    root: BlockHash
    cache_salt: str | None
    sampling_params: Any
    check: SamplingCheck
    lora_request: Any
    priority: int
    arrival: float
    text: str | None = None
    add_special_tokens: bool = True
    canonical: bool = False
    token_ids: Sequence[int] | None = None
    canonicalized: bool = False
    chars_removed: int = 0
    rules: Mapping[str, RuleCount] = field(default_factory=dict)
    media: tuple[Media, ...] = ()
    media_chars: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """Characters (text) or tokens (pre-tokenized): what preparing it costs."""
        return len(self.text) if self.text is not None else len(self.token_ids or ())


@dataclass(frozen=True, slots=True)
class Prepared:
    """What preparing a request produced: canonical token ids and their block keys.

    Attributes:
        token_ids: The canonical prompt's token ids.
        chain: One key per full block.
        canonicalized: Whether canonicalization changed the prompt.
        chars_removed: Characters canonicalization removed.
        rules: What each canonicalization rule changed (rules that changed nothing absent).
        media_positions: The token position of each of the request's media items.
    """

    token_ids: Sequence[int]
    chain: tuple[BlockHash, ...]
    canonicalized: bool = False
    chars_removed: int = 0
    rules: Mapping[str, RuleCount] = field(default_factory=dict)
    media_positions: tuple[int, ...] = ()


def prepare(request: IngressRequest, *, encode: Encode, chains: ChainCache,
            canonicalize: CanonicalizeConfig) -> Prepared:
    """Canonicalizes, tokenizes, packs and keys one request. Pure apart from ``chains``.

    Raises:
        InvalidRequest: If the tokenizer fails on the prompt or returns invalid token ids.
    """
    if request.token_ids is not None:
        ids: Sequence[int] = request.token_ids
        canon_changed, removed, rules = request.canonicalized, request.chars_removed, request.rules
    else:
        assert request.text is not None
        if not request.canonical:
            canon = canonicalize_text(request.text, canonicalize)
            text, canon_changed, removed, rules = canon.value, canon.changed, canon.chars_removed, canon.rules
        else:
            text = request.text
            canon_changed, removed, rules = request.canonicalized, request.chars_removed, request.rules
        try:
            ids = encode(text, request.add_special_tokens)
        except Exception as e:  # tokenizers raise anything from ValueError to Rust panics
            raise InvalidRequest(f"could not tokenize the prompt: {type(e).__name__}: {e}") from e
    try:
        data = pack_tokens(ids)
    except ValueError as e:
        raise InvalidRequest(f"invalid token ids: {e}") from None
    if not request.media:
        return Prepared(ids, chains.chain(data, request.root), canon_changed, removed, rules)
    assert request.text is not None
    try:
        positions = media_positions(request.text, ids, request.media_chars, encode,
                                    request.add_special_tokens)
    except Exception as e:
        raise InvalidRequest(f"could not tokenize the prompt: {type(e).__name__}: {e}") from e
    extras = media_extras([(p, m.identifier) for p, m in zip(positions, request.media, strict=True)],
                          chains.block_size)
    return Prepared(ids, chains.chain(data, request.root, extras), canon_changed, removed, rules,
                    positions)


def fast_encoder(tokenizer: Any) -> Encode | None:
    """An encoder calling a Hugging Face fast tokenizer's Rust core directly, or ``None``.

    ``encode_batch_fast`` releases the GIL (the plain ``encode`` does not) and skips offsets, so
    a worker thread tokenizes while the event loop runs. Used only if it gives the same ids as
    ``tokenizer.encode`` on probe texts; ``None`` when the tokenizer is not such a tokenizer.
    """
    core = getattr(tokenizer, "_tokenizer", None)
    batch = getattr(core, "encode_batch_fast", None) or getattr(core, "encode_batch", None)
    if batch is None or not hasattr(tokenizer, "encode"):
        return None

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = batch([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    probes = ("Hello world", "  two  spaces\tand a tab\n\nnew paragraph", "déjà vu — ünïcode ✓ 中文",
              "def f(x):\n    return x  # code", '{"key": [1, 2.5, null]}', " ", "a")
    try:
        for text in probes:
            for special in (True, False):
                if list(tokenizer.encode(text, add_special_tokens=special)) != encode(text, special):
                    return None
    except Exception:
        return None
    return encode


def _plain_encoder(tokenizer: Any) -> Encode:
    def encode(text: str, add_special_tokens: bool) -> Sequence[int]:
        ids: Sequence[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    return encode


def _check_utf8(text: str, what: str) -> None:
    if text.isascii():  # O(1): no surrogates possible
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} is not valid Unicode text (lone surrogate at {e.start})") from None


def _check_name(value: Any, what: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{what} must be a non-empty string{' or None' if optional else ''}, "
                             f"got {value!r}")
    _check_utf8(value, what)


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
        self._rules = cast(CanonicalizeConfig, config.canonicalize)  # a name is resolved by config
        self.clock = clock
        self.model = config.model_name or engine.model_name
        self.block_size = engine.block_size
        self.max_model_len = engine.max_model_len
        limit = self.max_model_len - 1
        if config.max_prompt_tokens is not None:
            limit = min(limit, config.max_prompt_tokens)
        self.max_prompt_tokens = limit
        self.max_chars = limit * _MAX_CHARS_PER_TOKEN
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._id_prefix = f"pg-{os.urandom(6).hex()}-"
        fast = fast_encoder(engine.tokenizer)
        self.fast = fast is not None
        """Whether ``encode`` calls a Hugging Face fast tokenizer's Rust core directly."""
        self.encode: Encode = fast or _plain_encoder(engine.tokenizer)
        self.chains = ChainCache(self.block_size)
        self._roots: dict[tuple[str, str | None, str | None], tuple[Namespace, BlockHash]] = {}
        self._salts: dict[str, str] = {}
        self._salted: dict[str, str] = {}  # salt -> tenant, of the salts in _salts
        self.salt_listeners: list[Callable[[str], None]] = []
        """Called with each cache salt as this ingress starts giving it (a tenant's first request
        lately), on the loop: cache followers learn what they kept aside for it."""
        self._interned: OrderedDict[BlockHash, tuple[BlockHash, ...]] = OrderedDict()
        self.chat = ChatTemplate(engine.tokenizer)

    # -- 1. on the loop: validate --------------------------------------------------------------

    def check(
        self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
        request_id: str | None = None, lora_request: Any = None, priority: int = 0,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> IngressRequest:
        """Validates one request without tokenizing it.

        Chat messages are canonicalized (their text only) and rendered here, on the loop, with
        the engine tokenizer's chat template, as vLLM's chat path renders them:
        ``apply_chat_template(messages, tools=tools, **chat_template_kwargs,
        add_generation_prompt=True, tokenize=False)``. Every ingress mode then tokenizes the same
        text, so tools and template arguments reach the key through the prompt's tokens. A
        template that iterates content parts gets each media part as ``{"type": modality}``; one
        that prints content as a string gets the text parts joined by newlines (vLLM's two
        content formats; vLLM would add a multimodal model's placeholder text, unknown here).

        Args:
            tools: For chat messages: tool definitions (mappings, e.g. OpenAI's ``{"type":
                "function", "function": {...}}``) the template renders. Never canonicalized.
            chat_template_kwargs: For chat messages: more variables for the template (e.g.
                ``{"enable_thinking": False}``); string keys, none of the arguments the gateway
                sets itself (``tools``, ``tokenize``, ``add_generation_prompt``, ``chat_template``,
                ``conversation``, ``messages``, ``return_dict``).

        Raises:
            InvalidRequest: Malformed prompt, tenant, request id, sampling parameters, tools or
                template arguments; tools or template arguments with a prompt that is not chat
                messages; a template that fails to render.
            PromptTooLong: Far more characters (or tokens) than the model allows.
        """
        tools, chat_template_kwargs = check_template_args(tools, chat_template_kwargs)
        tenant = self._check_tenant(tenant)
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids)}"
        else:
            _check_name(request_id, "request_id", optional=False)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an int, got {priority!r}")
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()
        elif isinstance(sampling_params, Mapping):  # fields, as a JSON request body carries them
            build = getattr(self.engine, "build_sampling_params", None)
            if build is None:
                raise InvalidRequest(f"{type(self.engine).__name__} takes its own sampling "
                                     "parameters object, not a mapping")
            sampling_params = build(sampling_params)
        check = self.engine.check_sampling_params(sampling_params)
        lora_name = getattr(lora_request, "lora_name", None) if lora_request is not None else None
        isolated = tenant if self.config.isolate_tenants else None
        namespace, root = self._namespace(lora_name, isolated)
        salt = self._salt(isolated) if isolated is not None else None
        fields = dict(request_id=request_id, tenant=tenant, namespace=namespace, root=root,
                      cache_salt=salt, sampling_params=sampling_params, check=check,
                      lora_request=lora_request, priority=priority, arrival=self.clock.now())
        if isinstance(prompt, bytes | bytearray | memoryview):
            try:
                prompt = bytes(prompt).decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidRequest(f"prompt bytes are not valid UTF-8 (at byte {e.start})") from None
        chat = (isinstance(prompt, Sequence) and not isinstance(prompt, str | bytes) and bool(prompt)
                and not isinstance(prompt[0], int))
        if not chat and (tools is not None or chat_template_kwargs is not None):
            raise InvalidRequest("tools and chat_template_kwargs apply to chat messages only")
        if isinstance(prompt, str):
            self._check_text(prompt)
            return IngressRequest(**fields, text=prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" not in prompt:
                raise InvalidRequest("a mapping prompt must be a TokensPrompt with 'prompt_token_ids'")
            return IngressRequest(**fields, token_ids=self._check_ids(prompt["prompt_token_ids"]))
        if not isinstance(prompt, Sequence) or not prompt:
            raise InvalidRequest("prompt must be a non-empty str, UTF-8 bytes, token ids or a "
                                 f"non-empty list of chat messages; got {type(prompt).__name__}")
        if isinstance(prompt[0], int):
            return IngressRequest(**fields, token_ids=self._check_ids(prompt))
        canon = canonicalize_messages(self._check_messages(prompt), self._rules)
        rendered = self.chat.render_chat(canon.value, tools, chat_template_kwargs,
                                         max_chars=self.max_chars, max_tokens=self.max_prompt_tokens)
        return IngressRequest(**fields, text=rendered.text, add_special_tokens=False, canonical=True,
                              canonicalized=canon.changed, chars_removed=canon.chars_removed,
                              rules=canon.rules, media=rendered.media, media_chars=rendered.media_chars)

    def _check_tenant(self, tenant: str | None) -> str | None:
        _check_name(tenant, "tenant", optional=True)
        known = self.config.known_tenants
        if tenant is not None and known is not None and tenant not in known:
            raise InvalidRequest(f"unknown tenant {tenant!r}")
        return tenant

    def _salt(self, tenant: str) -> str:
        salt = self._salts.get(tenant)
        if salt is None:
            digest = xxhash.xxh3_128_hexdigest(tenant.encode(), self.config.key_seed)
            salt = f"prefixgate-{digest}"
            if len(self._salts) >= 4096:
                self._salts.clear()
                self._salted.clear()
            self._salts[tenant] = salt
            self._salted[salt] = tenant
            for listener in self.salt_listeners:
                listener(salt)
        return salt

    def root_for(self, cache_salt: str | None, lora: str | None) -> BlockHash | None:
        """The namespace root of this gateway's keys for blocks an engine cached under
        ``cache_salt`` and ``lora`` (:mod:`prefixgate.cache_events`), or ``None`` for a salt this
        gateway has not given lately (another gateway's tenant it has not served: none of its
        requests could match those blocks yet)."""
        if cache_salt is None:
            tenant = None
        elif (tenant := self._salted.get(cache_salt)) is None:
            return None
        return self._namespace(lora, tenant)[1]

    def _namespace(self, lora: str | None, tenant: str | None) -> tuple[Namespace, BlockHash]:
        """The namespace of this model, ``lora`` and ``tenant`` (``None``: shared), and its root."""
        root_key = (self.model, lora, tenant)
        found = self._roots.get(root_key)
        if found is None:
            namespace = Namespace(*root_key)
            found = (namespace, namespace.root(self.config.key_seed))
            if len(self._roots) >= 4096:  # bounded: tenants come and go
                self._roots.clear()
            self._roots[root_key] = found
        return found

    def _check_text(self, text: str) -> None:
        if not text:
            raise InvalidRequest("prompt is empty")
        if not text.strip(_BLANK):  # stops at the first other character: O(1) for real prompts
            raise InvalidRequest("prompt is blank: only whitespace or zero-width characters")
        if len(text) > self.max_chars:
            raise PromptTooLong(f"prompt has {len(text)} characters, far over the token limit",
                                num_tokens=None, limit=self.max_prompt_tokens)
        _check_utf8(text, "prompt")

    def _check_ids(self, ids: Any) -> Sequence[int]:
        if not isinstance(ids, Sequence | array) or isinstance(ids, str | bytes) or not ids:
            raise InvalidRequest("token ids must be a non-empty list of ints")
        n = len(ids)
        if n > self.max_prompt_tokens:
            raise PromptTooLong(f"prompt has {n} tokens; at most {self.max_prompt_tokens} are accepted",
                                num_tokens=n, limit=self.max_prompt_tokens)
        return ids

    def _check_messages(self, messages: Sequence[Any]) -> Sequence[Mapping[str, Any]]:
        total = 0
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidRequest(f"message {i} must be a mapping with a string 'role'")
            for key in ("role", "name"):
                value = message.get(key)
                if value is None and key == "name":
                    continue
                if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME_CHARS:
                    raise InvalidRequest(f"message {i}: {key!r} must be a string of 1 to "
                                         f"{_MAX_NAME_CHARS} characters")
                _check_utf8(value, f"message {i} {key}")
            content = message.get("content")
            if content is None or isinstance(content, str):
                texts = [content] if content else []
            elif isinstance(content, list | tuple):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, Mapping):
                        raise InvalidRequest(f"message {i}: content part {j} must be a mapping")
                    found = media_of(part, f"message {i}: content part {j}")
                    if found is not None:
                        if isinstance(found[1], str):
                            _check_utf8(found[1], f"message {i}: content part {j}")
                        continue
                    text = part.get("text")
                    if text is not None and not isinstance(text, str):
                        raise InvalidRequest(f"message {i}: content part {j} text must be a string")
                    if text:
                        texts.append(text)
            else:
                raise InvalidRequest(f"message {i}: content must be a string, a list of parts or "
                                     f"None, not {type(content).__name__}")
            for text in texts:
                _check_utf8(text, f"message {i}")
                total += len(text)
        if total > self.max_chars:
            raise PromptTooLong(f"messages have {total} characters, far over the token limit",
                                num_tokens=None, limit=self.max_prompt_tokens)
        return messages

    # -- 2. anywhere: prepare -----------------------------------------------------------------

    def prepare(self, request: IngressRequest) -> Prepared:
        """:func:`prepare` with this gateway's tokenizer and chain cache (inline)."""
        return prepare(request, encode=self.encode, chains=self.chains, canonicalize=self._rules)

    # -- 3. on the loop: the ticket -----------------------------------------------------------

    def ticket(self, request: IngressRequest, prepared: Prepared) -> Ticket:
        """The ticket of a prepared request.

        Raises:
            InvalidRequest: The prompt is empty after canonicalization and tokenization.
            PromptTooLong: More prompt tokens than the model (or ``max_prompt_tokens``) allows.
        """
        n = len(prepared.token_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty after canonicalization and tokenization")
        if n > self.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt has {n} tokens; at most {self.max_prompt_tokens} are accepted "
                f"(max_model_len {self.max_model_len} leaves room for one output token)",
                num_tokens=n, limit=self.max_prompt_tokens)
        check = request.check
        return Ticket(
            request_id=request.request_id, tenant=request.tenant, namespace=request.namespace,
            prompt_token_ids=prepared.token_ids, block_hashes=self._intern(prepared.chain),
            cacheable_blocks=cacheable_blocks(n, self.block_size) if check.reads_cache else 0,
            sampling_params=request.sampling_params, max_tokens=check.max_tokens,
            cache_salt=request.cache_salt, lora_request=request.lora_request,
            priority=request.priority, arrival=request.arrival,
            canonicalized=prepared.canonicalized, chars_removed=prepared.chars_removed,
            seq=next(self._seq), canonical_rules=prepared.rules,
            media=tuple(replace(m, position=p) for m, p in
                        zip(request.media, prepared.media_positions, strict=True)) or None,
        )

    def make_ticket(self, prompt: Prompt, sampling_params: Any = None, *, tenant: str | None = None,
                    request_id: str | None = None, lora_request: Any = None,
                    priority: int = 0, tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> Ticket:
        """Validates, prepares (inline) and tickets one request. See :meth:`check`."""
        request = self.check(prompt, sampling_params, tenant=tenant, request_id=request_id,
                             lora_request=lora_request, priority=priority, tools=tools,
                             chat_template_kwargs=chat_template_kwargs)
        return self.ticket(request, self.prepare(request))

    def _intern(self, chain: tuple[BlockHash, ...]) -> tuple[BlockHash, ...]:
        """``chain`` with its prefix shared with the last chain of the same first block replaced
        by that chain's key objects: sorting and comparing siblings then compares pointers."""
        if not chain:
            return chain
        interned = self._interned
        last = interned.get(chain[0])
        if last is not None and last is not chain:
            shared = common_prefix(chain, last)
            if shared == len(chain) and len(last) == shared:
                chain = last
            elif shared:
                chain = (*last[:shared], *chain[shared:])
        interned[chain[0]] = chain
        interned.move_to_end(chain[0])
        if len(interned) > 4096:
            interned.popitem(last=False)
        return chain

    def __repr__(self) -> str:
        return (f"Ingress(model={self.model!r}, block_size={self.block_size}, "
                f"max_prompt_tokens={self.max_prompt_tokens})")


def ids_from_bytes(data: bytes) -> array[int]:
    """Token ids packed by :func:`~prefixgate.keys.pack_tokens`, as an ``array('I')``."""
    ids = array("I")
    ids.frombytes(data)
    return ids
