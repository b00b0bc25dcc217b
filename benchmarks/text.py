"""Workload text: canonical prose, code and JSON of a given token length, and whitespace noise.

Text comes from a fixed word list in prose, code and JSON shapes and is canonical (prefixgate's
default whitespace rules leave it unchanged), so W3's noise (:func:`apply_whitespace_edits`) is the
only whitespace the canonicalizer has to undo. Lengths are measured with the engine's tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any, Protocol

__all__ = ["EDIT_KINDS", "EXTRA_EDIT_KINDS", "TextMaker", "TextTokenizer", "apply_whitespace_edits"]

EDIT_KINDS = ("crlf", "trailing_spaces", "double_space", "tab", "blank_line")

# Words that the tiny Llama tokenizer (tests/fixtures/make_tiny_model.py) encodes as one token each.
_WORD_TEXT = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will can more
about out up them some could what into than its time only other new two may first any like now
my such make over our even most me state after also made many did must before back see through
way where get much go well your know should down work year because come people just say each
those take day good how long use very own between both life being under three never same last
another while us off might great old since against came right used system user assistant
question answer document context retrieval cache prefix token block model server request response
latency throughput memory queue engine tenant policy schedule batch stream output input prompt
value error result function class return import def self none true false null list dict string
number object array key data file path name type config
"""
_WORDS = tuple(_WORD_TEXT.split())

# Code shapes: four-space indentation, single inner spaces, no blank-line runs (canonical).
_CODE = (
    "def {a}({b}, {c}):\n    if {b} is None:\n        return {c}\n    return {b} + {c}",
    "class {A}:\n    def __init__(self, {b}):\n        self.{b} = {b}\n        self.{c} = []",
    "for {a} in range({n}):\n    if {a} % 2 == 0:\n        {b}.append({a})",
    "import {a}\nfrom {b} import {c}\n{d} = {a}.{c}(\"{b}\")",
    "if ({a} != null) {{\n    return {b}.{c}({d});\n}}",
)


class TextTokenizer(Protocol):
    """What a workload needs of the engine's tokenizer: token counts, and cutting to a length."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...



class TextMaker:
    """Random canonical text of a given token length, measured with ``tokenizer``."""

    def __init__(self, rng: random.Random, tokenizer: TextTokenizer | None) -> None:
        self.rng = rng
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def _prose(self) -> str:
        sentences = [self.words(self.rng.randint(6, 18)) + "." for _ in range(self.rng.randint(2, 4))]
        return " ".join(s[0].upper() + s[1:] for s in sentences)

    def _code(self) -> str:
        w = [self.rng.choice(_WORDS) for _ in range(4)]
        return self.rng.choice(_CODE).format(a=w[0], b=w[1], c=w[2], d=w[3], A=w[0].title(),
                                             n=self.rng.randint(1, 999))

    def _json(self) -> str:
        obj: dict[str, Any] = {}
        for _ in range(self.rng.randint(2, 6)):
            key = self.rng.choice(_WORDS)
            obj[key] = self.rng.choice([self.rng.choice(_WORDS), self.rng.randint(0, 9999), True, None,
                                        [self.rng.choice(_WORDS) for _ in range(3)]])
        return json.dumps(obj, indent=self.rng.choice([None, 2, 4]))

    def _list(self) -> str:
        return "\n".join("- " + self.words(self.rng.randint(3, 9)) for _ in range(self.rng.randint(2, 5)))

    def paragraph(self, style: str) -> str:
        if style == "prose":
            return self._prose()
        return self.rng.choice((self._prose, self._prose, self._code, self._json, self._list))()

    def text(self, tokens: int, style: str) -> str:
        """About ``tokens`` tokens of paragraphs separated by blank lines (exact when the
        tokenizer can decode); always starts with prose, never ends in whitespace."""
        parts = [self._prose()]
        total = self.count(parts[0])
        while total < tokens:
            part = self.paragraph(style)
            parts.append(part)
            total += self.count("\n\n" + part)
        text = "\n\n".join(parts)
        decode = getattr(self.tokenizer, "decode", None)
        if self.tokenizer is not None and decode is not None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > tokens:
                text = decode(ids[:tokens])
        elif self.tokenizer is None:
            text = _cut_words(text, tokens)
        return text.rstrip()

    def question(self, tokens: int) -> str:
        """A unique-looking question; with the blank line before it, about ``tokens`` tokens."""
        frame = self.count("\n\nQuestion: ?") if self.tokenizer is not None else 1
        body = self.text(max(1, tokens - frame), "prose")
        return "Question: " + body.rstrip(".") + "?"


def _cut_words(text: str, n: int) -> str:
    """The first ``n`` whitespace-separated words of ``text``, with their original spacing."""
    count = 0
    in_word = False
    for i, ch in enumerate(text):
        if ch.isspace():
            if in_word:
                count += 1
                if count == n:
                    return text[:i]
            in_word = False
        else:
            in_word = True
    return text


# -- whitespace noise (W3) ---------------------------------------------------------------------

EXTRA_EDIT_KINDS = ("unicode_space", "zero_width", "json_indent")
"""Noise kinds beyond W3's (:data:`EDIT_KINDS`, whose traces they leave as they were): a space
between words becomes a Unicode space (NBSP, thin, narrow NBSP, en or ideographic space); a
zero-width character (ZWSP, word joiner, BOM) goes between two visible characters; a JSON
paragraph is re-indented (compact, 2 or 4 spaces, whichever it was not)."""
_UNICODE_SPACES = ("\u00a0", "\u2009", "\u202f", "\u2002", "\u3000")
_ZERO_WIDTH = ("\u200b", "\u2060", "\ufeff")


def apply_whitespace_edits(text: str, rng: random.Random, n: int, kinds: tuple[str, ...] = EDIT_KINDS) -> str:
    """Applies ``n`` random whitespace edits of ``kinds``.

    Edit kinds (:data:`EDIT_KINDS`, W3's, all of which the ``prose`` and ``legacy`` canonicalization
    rule sets undo): an LF becomes CRLF; spaces or a tab are added at a line's end; a space between
    words is doubled; a space between words becomes a tab; a blank line is doubled. Only
    whitespace is inserted or replaced, never indentation, so the non-whitespace characters and
    the canonical form are unchanged. :data:`EXTRA_EDIT_KINDS` add Unicode spaces, zero-width
    characters and JSON re-indentation; pass ``kinds=("zero_width",)`` to apply only one kind.

    Args:
        text: Canonical text (LF newlines, no trailing or doubled spaces, single blank lines).
        rng: The source of randomness.
        n: How many edits.
        kinds: The kinds to draw from (each edit picks one, falling back to the others in order
            when the text has no place for it).

    Returns:
        The edited text (``text`` itself when it has no place for any edit).
    """
    for _ in range(n):
        chosen = rng.choice(kinds)
        for kind in (chosen, *(k for k in kinds if k != chosen)):  # fall back if no spot
            edited = _edit_once(text, rng, kind)
            if edited is not None:
                text = edited
                break
    return text


def _edit_once(text: str, rng: random.Random, kind: str) -> str | None:
    if kind in ("double_space", "tab", "unicode_space"):
        spots = [i for i in range(1, len(text) - 1) if text[i] == " "
                 and text[i - 1] not in " \t\r\n" and text[i + 1] not in " \t\r\n"]
        if not spots:
            return None
        i = rng.choice(spots)
        new = {"double_space": "  ", "tab": "\t"}.get(kind) or rng.choice(_UNICODE_SPACES)
        return text[:i] + new + text[i + 1:]
    if kind == "zero_width":
        spots = [i for i in range(1, len(text)) if not text[i - 1].isspace() and not text[i].isspace()]
        if not spots:
            return None
        i = rng.choice(spots)
        return text[:i] + rng.choice(_ZERO_WIDTH) + text[i:]
    if kind == "json_indent":
        return _reindent_json(text, rng)
    if kind == "crlf":
        spots = [i for i in range(len(text)) if text[i] == "\n" and (i == 0 or text[i - 1] != "\r")]
        if not spots:
            return None
        i = rng.choice(spots)
        return text[:i] + "\r\n" + text[i + 1:]
    if kind == "trailing_spaces":
        spots = [i - 1 if i and text[i - 1] == "\r" else i for i in range(len(text)) if text[i] == "\n"]
        if not spots:
            return None
        i = rng.choice(spots)
        return text[:i] + rng.choice((" ", "  ", "   ", "\t")) + text[i:]
    if kind == "blank_line":
        spots = [i for i in range(len(text) - 1) if text[i] == "\n" and text[i + 1] == "\n"]
        if not spots:
            return None
        i = rng.choice(spots)
        return text[:i] + "\n" + text[i:]
    raise ValueError(f"unknown edit kind {kind!r}")


def _reindent_json(text: str, rng: random.Random) -> str | None:
    """``text`` with one of its JSON paragraphs (an object or array between blank lines) dumped
    with another indentation, or ``None`` if it has none."""
    paragraphs = text.split("\n\n")
    spots = []
    for i, para in enumerate(paragraphs):
        if para[:1] in ("{", "[") and para[-1:] in ("}", "]"):
            with contextlib.suppress(ValueError):
                spots.append((i, json.loads(para)))
    if not spots:
        return None
    i, value = rng.choice(spots)
    others = [d for d in (json.dumps(value, indent=k) for k in (None, 2, 4)) if d != paragraphs[i]]
    paragraphs[i] = rng.choice(others)
    return "\n\n".join(paragraphs)
