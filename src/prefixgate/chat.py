"""Render chat messages to prompt text as vLLM's chat path renders them, and place their media.

Ingress canonicalizes a chat's message text, then :class:`ChatTemplate` renders it with the
engine tokenizer's template exactly as vLLM's chat path calls it:
``apply_chat_template(messages, tools=tools, **chat_template_kwargs, add_generation_prompt=True,
tokenize=False)``. Content parts reach the template in the form vLLM gives them: a template that
iterates parts (vLLM's "openai" content format) gets the list, each media part as
``{"type": modality}``; one that prints ``m['content']`` ("string") gets the text parts joined by
newlines (vLLM would also insert a multimodal model's placeholder text there, which only the
model knows).

Media parts (``image_url``/``audio_url``/``video_url`` by URL, or ``image``/``audio``/``video``
as encoded bytes) become :class:`~prefixgate.engine.Media` items with an xxh3-128 identifier of
what was given (for a URL, the URL: a URL whose content changes keys as the same item). Each
item's place in the rendered text is where that text stops agreeing with the chat rendered up to
just before the item; :func:`~prefixgate.keys.media_positions` turns it into a token position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from .engine import Media, Tokenizer
from .errors import InvalidRequest, PromptTooLong

__all__ = ["MAX_MEDIA", "ChatTemplate", "RenderedChat", "check_template_args", "media_of"]

MEDIA_KINDS = ("image", "audio", "video")
MAX_MEDIA = 256
"""Media items per request: each costs one more template rendering at the call."""
# What the gateway itself passes to apply_chat_template: not the caller's to set. vLLM refuses
# chat_template and tokenize among chat_template_kwargs; the others would change what we render.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "chat_template", "tokenize",
                              "add_generation_prompt", "return_dict"})


def check_template_args(
    tools: Any, kwargs: Any,
) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
    """``tools`` as a list of dicts and ``kwargs`` as a dict (shallow copies).

    Raises:
        InvalidRequest: ``tools`` is not a list of mappings, ``kwargs`` not a mapping with
            non-empty string keys, or ``kwargs`` sets what the gateway sets itself.
    """
    if tools is not None:
        if not isinstance(tools, Sequence) or isinstance(tools, str | bytes | bytearray):
            raise InvalidRequest(f"tools must be a list of mappings, got {type(tools).__name__}")
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise InvalidRequest(f"tool {i} must be a mapping, got {type(tool).__name__}")
        tools = [dict(tool) for tool in tools]
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise InvalidRequest("chat_template_kwargs must be a mapping, got "
                                 f"{type(kwargs).__name__}")
        for key in kwargs:
            if not isinstance(key, str) or not key:
                raise InvalidRequest(f"chat_template_kwargs keys must be non-empty strings, got {key!r}")
            if key in _RESERVED_KWARGS:
                what = "pass tools=" if key == "tools" else "the gateway sets it"
                raise InvalidRequest(f"chat_template_kwargs may not set {key!r} ({what})")
        kwargs = dict(kwargs)
    return tools, kwargs


def media_of(part: Mapping[str, Any], what: str) -> tuple[str, str | bytes] | None:
    """``(modality, URL or bytes)`` of a media content part, ``None`` for a text part.

    Raises:
        InvalidRequest: A media part without its URL or bytes, or a part of an unknown type.
    """
    kind = part.get("type")
    if kind is None or kind == "text":
        return None
    if not isinstance(kind, str):
        raise InvalidRequest(f"{what}: 'type' must be a string")
    if kind.endswith("_url") and kind[:-4] in MEDIA_KINDS:
        value = part.get(kind)
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{what}: {kind!r} needs a non-empty 'url'")
        return kind[:-4], url
    if kind in MEDIA_KINDS:
        data = part.get(kind)
        if not isinstance(data, bytes | bytearray | memoryview) or not len(data):
            raise InvalidRequest(f"{what}: {kind!r} needs the encoded {kind} as non-empty bytes")
        return kind, bytes(data)
    raise InvalidRequest(f"{what}: unsupported content part type {kind!r} (text, "
                         f"{', '.join(m + '_url' for m in MEDIA_KINDS)}, {', '.join(MEDIA_KINDS)})")


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A chat rendered to prompt text.

    Attributes:
        text: The prompt text.
        media: The media items in prompt order (no token positions yet).
        media_chars: Where each media item sits in ``text``, in characters.
    """

    text: str
    media: tuple[Media, ...] = ()
    media_chars: tuple[int, ...] = ()


class ChatTemplate:
    """The engine tokenizer's chat template, called as vLLM's chat path calls it.

    Args:
        tokenizer: The engine's tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._string_content: bool | None = None

    def takes_strings(self) -> bool:
        """Whether the template reads a message's content as one string (vLLM's "string"
        content format) rather than iterating its parts ("openai"). vLLM reads the template's
        syntax tree; here the template is asked once: a list of one text part that renders as
        the plain string does, or renders the text without a dict's repr, is read as parts."""
        if self._string_content is None:
            probe = "\ue000prefixgate probe\ue001"
            renders: list[str | None] = []
            for content in (probe, [{"type": "text", "text": probe}]):
                try:
                    renders.append(self.tokenizer.apply_chat_template(
                        [{"role": "user", "content": content}], add_generation_prompt=False,
                        tokenize=False))
                except Exception:
                    renders.append(None)
            plain, parts = renders
            self._string_content = not (parts is not None and (
                parts == plain or (probe in parts and "'text'" not in parts and '"text"' not in parts)))
        return self._string_content

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               kwargs: Mapping[str, Any] | None = None, *, add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (media parts already ``{"type": modality}``).

        Raises:
            InvalidRequest: If the template fails or renders no text.
        """
        if self.takes_strings():  # as vLLM: the text parts joined by newlines
            messages = [_joined(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, **(kwargs or {}), add_generation_prompt=add_generation_prompt,
                tokenize=False)
        except Exception as e:  # templates raise anything from ValueError to Jinja's errors
            raise InvalidRequest(f"could not render the chat template: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise InvalidRequest(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    kwargs: Mapping[str, Any] | None, *, max_chars: int,
                    max_tokens: int) -> RenderedChat:
        """Renders canonical ``messages`` with the generation prompt and places their media.

        Args:
            messages: The canonicalized messages.
            tools: Passed to the template as ``tools``.
            kwargs: Passed to the template as keyword arguments.
            max_chars: Longer rendered text is refused before anything else is rendered.
            max_tokens: The token limit ``max_chars`` stands for (named in the error).

        Raises:
            InvalidRequest: The template fails, or more than :data:`MAX_MEDIA` media items.
            PromptTooLong: The rendered text is longer than ``max_chars``.
        """
        messages, media, where = _media_parts(messages)
        if len(media) > MAX_MEDIA:
            raise InvalidRequest(f"{len(media)} media items; at most {MAX_MEDIA} are accepted")
        text = self.render(messages, tools, kwargs)
        if len(text) > max_chars:  # tools can make the rendered prompt much longer
            raise PromptTooLong(f"the rendered chat has {len(text)} characters, far over the token "
                                "limit", num_tokens=None, limit=max_tokens)
        chars = []
        for i, j in where:  # the chat up to just before the item, without the generation prompt
            cut = [*messages[:i], {**messages[i], "content": messages[i]["content"][:j]}]
            chars.append(_common_chars(text, self.render(cut, tools, kwargs, add_generation_prompt=False)))
        return RenderedChat(text, media, tuple(chars))

    def __repr__(self) -> str:
        form = {None: "unknown", True: "string", False: "openai"}[self._string_content]
        return f"ChatTemplate(content_format={form})"


def _media_parts(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], tuple[Media, ...], list[tuple[int, int]]]:
    """Messages as the template sees them (each media part becomes ``{"type": modality}``, as
    vLLM's chat path hands parts to a template), the media items, and where each was
    (message, part)."""
    media: list[Media] = []
    where: list[tuple[int, int]] = []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list | tuple):
            parts: list[Any] | None = None
            for j, part in enumerate(content):
                found = media_of(part, f"message {i}: content part {j}")
                if found is None:
                    continue
                modality, data = found
                raw = data.encode("utf-8") if isinstance(data, str) else data
                identifier = xxhash.xxh3_128_hexdigest(modality.encode() + b"\0" + raw)
                media.append(Media(modality, data, identifier))
                where.append((i, j))
                if parts is None:
                    parts = list(content)
                parts[j] = {"type": modality}
            if parts is not None:
                message = {**message, "content": parts}
        out.append(message)
    return out, tuple(media), where


def _joined(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with list content as one string: its text parts joined by newlines, as vLLM
    gives content to a template that takes strings. Media parts add nothing: vLLM would insert
    the model's own placeholder text, which only the model knows."""
    content = message.get("content")
    if not isinstance(content, list | tuple):
        return message
    texts = [p["text"] for p in content if p.get("type", "text") == "text" and isinstance(p.get("text"), str)]
    return {**message, "content": "\n".join(texts)}


def _common_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, by binary search over slices."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
