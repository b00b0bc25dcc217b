"""The pass over one text and the entry points.

In order: CRLF and CR to LF, the character view (zero-width and Unicode spaces), the sites where
a rule may apply, the structure scans, blank-line runs, the line rules, the assembly from the
edits, and NFC. :func:`canonicalize_text` and :func:`canonicalize_messages` run it.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from .config import _SAFE, UNICODE_SPACE_CHARS, ZERO_WIDTH_CHARS, CanonicalizeConfig, Canonicalized, Rule
from .document import _Counts
from .lines import _blank_runs, _Doc
from .scanning import _DOUBLE_SPACE, _INNER_TAB, _LEAD_RUN, _LEAD_TAB, _LINE_END_SITE


def _char_view(text: str, config: CanonicalizeConfig) -> tuple[str, list[int]]:
    """The text with zero-width characters removed and Unicode spaces as spaces (per
    ``config``), and the positions (in ``text``) of what was removed."""
    view = text
    if config.unicode_spaces:
        for ch in UNICODE_SPACE_CHARS:
            if ch in view:
                view = view.replace(ch, " ")
    removed: list[int] = []
    if config.zero_width:
        found = [ch for ch in ZERO_WIDTH_CHARS if ch in view]
        if found:
            removed = [m.start() for m in re.finditer("[" + "".join(found) + "]", view)]
            for ch in found:
                view = view.replace(ch, "")
    return view, removed


def _lf(text: str) -> tuple[str, int]:
    """CRLF and lone CR to LF, and how many line breaks that was. A few CRs are found with
    ``find`` (memchr speed), many with ``replace``."""
    parts: list[str] = []
    pos = 0
    i = text.find("\r")
    while i >= 0:
        if len(parts) > 64:
            return "".join(parts) + text[pos:].replace("\r\n", "\n").replace("\r", "\n"), text.count("\r")
        parts += (text[pos:i], "\n")
        pos = i + 2 if text.startswith("\n", i + 1) else i + 1
        i = text.find("\r", pos)
    parts.append(text[pos:])
    return "".join(parts), len(parts) // 2


def _sites(doc: _Doc, every_line: bool) -> tuple[list[int], list[int]]:
    """Starts of the lines that line rules may change, and line breaks next to which a run of
    blank lines may start. ``every_line`` lists all of them (the reference the tests compare to)."""
    c, v = doc.c, doc.v
    if every_line:
        breaks = [m.start() for m in re.finditer("\n", v)]
        return [0] + [b + 1 for b in breaks], breaks
    lines: list[int] = []
    blanks: list[int] = []
    for m in _LINE_END_SITE.finditer(v):  # also what ends a paragraph or starts indented code
        blanks.append(m.start())
        lines.append(doc.line_start(m.start()))
    if doc.cr:  # ``newlines`` off: every line holding a CR (rare; no fast path)
        for m in re.finditer("\r", v):
            lines.append(doc.line_start(m.start()))
            blanks.append(doc.line_end(m.start()))
    if v.endswith((" ", "\t")):
        lines.append(doc.line_start(len(v)))
    if c.inner_spaces or c.tabs:
        lines += [doc.line_start(m.start()) for m in _DOUBLE_SPACE.finditer(v)]
    if "\t" in v:
        if c.tabs:
            lines += [doc.line_start(m.start()) for m in _INNER_TAB.finditer(v)]
        if c.tab_indent:
            lines += [m.start() + 1 for m in _LEAD_TAB.finditer(v)] + ([0] if v[:1] in (" ", "\t") else [])
    if not c.keep_indentation:
        lines += [m.start() + 1 for m in _LEAD_RUN.finditer(v)] + ([0] if v[:1] in (" ", "\t") else [])
    return lines, blanks


def _canonical(text: str, config: CanonicalizeConfig, counts: _Counts, every_line: bool = False) -> str:
    if config.newlines and "\r" in text:
        lf, n_breaks = _lf(text)
        n_crlf = len(text) - len(lf)
        counts.add(Rule.NEWLINES, n_breaks, n_breaks + n_crlf, n_crlf)
        text = lf
    view, removed = text, list[int]()
    if (config.unicode_spaces or config.zero_width) and not text.isascii():
        view, removed = _char_view(text, config)
    doc = _Doc(text, view, removed, config, counts)
    lines, breaks = _sites(doc, every_line)
    doc.breaks = breaks
    if not config.blank_lines:
        breaks = []
    if not lines and not breaks and view is text and not (config.json and ("{" in view or "[" in view)):
        return _nfc(text, config, counts)
    doc.structure()
    consumed = _blank_runs(doc, breaks) if config.blank_lines and breaks else set()
    for ls in sorted(set(lines)):
        if ls not in consumed and ls not in doc.edits and not doc.skipped(ls):
            doc.line(ls, doc.line_end(ls))
    return _nfc(_assemble(doc), config, counts)


def _assemble(doc: _Doc) -> str:
    """The output: the edits; protected lines from the original text; the rest from the view."""
    v = doc.v
    keep_text = v is not doc.text
    if keep_text:
        _count_char_rules(doc)
    parts: list[str] = []
    pos = 0

    def copy(a: int, b: int) -> None:
        if not keep_text:
            parts.append(v[a:b])
            return
        for s, e in doc.prot:  # protected lines keep their zero-width and Unicode spaces
            if e < a or s >= b:
                continue
            s, e = max(s, a), min(e, b)
            parts.append(v[a:s])
            parts.append(doc.source(s, e))
            a = e
        parts.append(v[a:b])

    for start in sorted(doc.edits):
        end, new = doc.edits[start]
        copy(pos, start)
        parts.append(new)
        pos = end
    copy(pos, len(v))
    return "".join(parts)


def _count_char_rules(doc: _Doc) -> None:
    """Counts the character rules' changes outside the protected lines (those keep the original)."""
    text, gaps = doc.text, doc.gaps
    ranges = [(s + bisect.bisect_left(gaps, s), e + bisect.bisect_right(gaps, e)) for s, e in doc.prot]
    for rule, chars, on in ((Rule.ZERO_WIDTH, ZERO_WIDTH_CHARS, doc.c.zero_width),
                            (Rule.UNICODE_SPACES, UNICODE_SPACE_CHARS, doc.c.unicode_spaces)):
        if not on:
            continue
        n = sum(text.count(ch) - sum(text.count(ch, a, b) for a, b in ranges) for ch in chars if ch in text)
        doc.counts.add(rule, n, n, n if rule is Rule.ZERO_WIDTH else 0)


def _nfc(text: str, config: CanonicalizeConfig, counts: _Counts) -> str:
    if config.unicode_nfc and not text.isascii():
        normal = unicodedata.normalize("NFC", text)
        if normal != text:
            counts.add(Rule.UNICODE_NFC, 1, len(text), len(text) - len(normal))
            return normal
    return text


def canonicalize_text(text: str, config: CanonicalizeConfig | None = None) -> Canonicalized:
    """Canonicalizes the whitespace of one prompt.

    Args:
        text: The prompt.
        config: Which rules apply; the ``safe`` defaults when ``None``. Per-role configs do not
            apply to a plain prompt.

    Returns:
        A :class:`Canonicalized` whose ``value`` is the canonical string.

    Raises:
        TypeError: If ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"prompt must be str, not {type(text).__name__}")
    config = config or _SAFE
    if not config.enabled:
        return Canonicalized(text, False, 0)
    counts = _Counts()
    out = _canonical(text, config, counts)
    edits, rules = counts.result()
    return Canonicalized(out, out != text, len(text) - len(out), edits, rules)


def canonicalize_messages(
    messages: Sequence[Mapping[str, Any]], config: CanonicalizeConfig | None = None
) -> Canonicalized:
    """Canonicalizes the content of every chat message; roles and other keys are untouched.

    A message's ``content`` may be a string or a list of OpenAI-style parts; text parts
    (``{"type": "text", "text": ...}``) are canonicalized, other parts are kept as they are.
    Each message uses ``config.for_role(message["role"])``.

    Args:
        messages: Chat messages (mappings with ``role`` and ``content``).
        config: Which rules apply; the ``safe`` defaults when ``None``.

    Returns:
        A :class:`Canonicalized` whose ``value`` is a new list of new message dicts.
    """
    config = config or _SAFE
    counts = _Counts()
    removed = 0
    out: list[dict[str, Any]] = []
    for message in messages:
        new = dict(message)
        content = message.get("content")
        rules = config.for_role(message.get("role"))
        if rules.enabled and isinstance(content, str):
            new["content"] = _canonical(content, rules, counts)
            removed += len(content) - len(new["content"])
        elif rules.enabled and isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    text = _canonical(part["text"], rules, counts)
                    removed += len(part["text"]) - len(text)
                    part = {**part, "text": text}
                parts.append(part)
            new["content"] = parts
        out.append(new)
    changed = any(a != b for a, b in zip(messages, out, strict=True))
    edits, per_rule = counts.result()
    return Canonicalized(out, changed, removed, edits, per_rule)
