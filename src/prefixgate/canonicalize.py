"""Stage 1: canonicalize whitespace so that prompts meant to share a prefix do share one.

One stray space inside a shared system prompt changes every block hash after it and the prefix
cache is worth nothing (measured on an H200 with vLLM 0.26: 95% token hit rate down to 13%).
The rules here only touch whitespace and invisible format characters, each is a switch, and every
call reports per rule what it changed. Lowercasing or any other edit of visible characters is
never done (``unicode_nfc``, in no rule set, is the one exception).

Rule sets (:data:`RULE_SETS`, ``CanonicalizeConfig.named(name)``):

``safe`` (the default)
    Changes nothing a parser reads: every document of the meaning corpus (``tests/corpus``:
    Python, JSON, YAML, CSV, TSV, Markdown rendered to HTML, prose) and generated Markdown, YAML
    and JSON parse the same before and after, whole and fenced inside a message. Rules:
    ``newlines``, ``trailing_whitespace``, ``inner_spaces``, ``blank_lines``. Protections: all.
``prose``
    For natural-language text you wrote yourself (system prompts): also ``tabs``,
    ``unicode_spaces`` and ``zero_width``; only ``protect_code`` stays on.
``aggressive``
    ``prose`` plus ``json`` and ``tab_indent``, with no protection at all: the most sharing, but it
    changes code and data (trailing spaces in a Python string, TSV columns, YAML scalars).
``legacy``
    prefixgate 0.1's default, byte for byte (tested against its regexes): ``tabs`` on, no
    protection, no Unicode rules.
``off``
    The identity.

Rules, in the order they apply; each is a field of :class:`CanonicalizeConfig`:

``newlines``            CRLF and lone CR become LF, everywhere (protected text too: every parser
                        above reads either as one line break).
``zero_width``          U+200B, U+2060, U+FEFF are removed. ZWJ and ZWNJ (emoji, Indic and
                        Persian scripts) and directional marks are never touched.
``unicode_spaces``      Unicode space separators (NBSP, thin, ideographic …) become a space.
``json``                JSON in ```json fences, in a whole message and in blank-line-delimited
                        paragraphs that start with ``{``/``[`` is laid out with indent 2, token by
                        token: only the whitespace between tokens changes; what does not parse stays.
``tab_indent``          Tabs in a line's indentation become spaces (stops of ``tab_size``).
``trailing_whitespace`` Spaces (with ``tabs`` also tabs) at a line's end are removed.
``inner_spaces``        A run of two or more spaces inside a line becomes one; indentation stays
                        unless ``keep_indentation=False`` (which flattens code; in no rule set).
``tabs``                A run holding a tab inside a line becomes one space (merges TSV columns).
``blank_lines``         Two or more consecutive blank lines become one empty line.
``unicode_nfc``         Unicode NFC (changes visible characters).

Protections leave text as it is (apart from ``newlines``):

``protect_code``        Fenced (``` and ~~~, any indentation) and indented code blocks, including
                        indented code after a heading, rule, fence, HTML, quote or table line and
                        inside lists; triple-quoted strings (from quote to quote); YAML ``|`` and
                        ``>`` block scalars; raw HTML ``<pre>``, ``<script>``, ``<style>``,
                        ``<textarea>`` blocks.
``protect_quotes``      Text inside ``"…"`` and backtick spans (which may continue over the lines of
                        a paragraph) and ``'…'`` (on one line; an apostrophe after a letter is no
                        quote).
``protect_data``        Lines holding a tab after their indentation (TSV rows, literal tabs);
                        CSV-like paragraphs (two or more records with the same number of commas,
                        mostly not followed by a space); YAML keys, values, sequence items (under a
                        key) and plain-scalar continuation lines; plain scalars in flow
                        collections.
``protect_markdown``    Two trailing spaces where the paragraph goes on (a hard break; kept as
                        exactly two), the spaces after a line-ending backslash, the spacing after
                        list and quote markers where later lines are read against it, and lines
                        that CommonMark may read as indented code inside or after a list or quote.

Known limits of ``safe``: quote state does not cross a blank line (so that one stray quote cannot
flip the rest of a text), so a quoted YAML or CSV string holding a blank line is protected only up
to it; a CSV paragraph of one record, or one whose commas are mostly followed by spaces, is not
recognised; a YAML document that is one bare plain scalar is read as prose.

The work is a few C-speed scans when nothing is to change, and a visit of only the lines that
can change when something is. Each call is pure (all its state lives in one call), so threads
may share the function.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = [
    "RULE_SETS",
    "CanonicalizeConfig",
    "Canonicalized",
    "Rule",
    "RuleCount",
    "canonicalize_messages",
    "canonicalize_text",
]


class Rule(enum.StrEnum):
    """The rules, by the name under which :class:`Canonicalized` reports them."""

    NEWLINES = "newlines"
    ZERO_WIDTH = "zero_width"
    UNICODE_SPACES = "unicode_spaces"
    JSON = "json"
    TAB_INDENT = "tab_indent"
    TRAILING_WHITESPACE = "trailing_whitespace"
    INNER_SPACES = "inner_spaces"
    TABS = "tabs"
    BLANK_LINES = "blank_lines"
    UNICODE_NFC = "unicode_nfc"


ZERO_WIDTH_CHARS = "\u200b\u2060\ufeff"
"""Removed by ``zero_width``: zero-width space, word joiner, BOM (zero-width no-break space)."""
UNICODE_SPACE_CHARS = "\u00a0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u202f\u205f\u3000"
"""Turned into a space by ``unicode_spaces``: Unicode's space separators (Zs) other than U+0020."""


@dataclass(frozen=True, slots=True)
class CanonicalizeConfig:
    """Which rules apply and what they leave alone. ``CanonicalizeConfig()`` is the ``safe`` set.

    Invariant: with the default protections on, the output parses like the input in every format
    of the meaning corpus (see the module docstring); rules and protections are independent
    switches, so any other combination is the caller's choice.

    Attributes:
        enabled: Master switch; ``False`` makes canonicalization the identity (roles included).
        newlines: CRLF/CR to LF.
        trailing_whitespace: Strip spaces (with ``tabs`` also tabs) at line ends.
        inner_spaces: Collapse runs of two or more spaces inside a line to one.
        keep_indentation: ``False`` also collapses indentation (flattens Python and YAML).
        blank_lines: Collapse runs of blank lines to one.
        tabs: Tabs inside and at the end of lines count as spaces (merges TSV columns).
        unicode_spaces: Unicode space separators to an ASCII space.
        zero_width: Remove U+200B, U+2060, U+FEFF.
        json: Re-lay out JSON blocks (fenced ``json``, whole message, ``{``/``[`` paragraphs).
        tab_indent: Tabs in indentation to spaces, up to the next multiple of ``tab_size``.
        tab_size: Tab stop width for ``tab_indent`` and for measuring indentation.
        unicode_nfc: Unicode NFC (changes non-whitespace characters; in no rule set).
        protect_code: Leave code blocks (fenced, indented), triple-quoted strings, YAML block
            scalars and raw HTML ``<pre>``-like blocks alone (details: module docstring).
        protect_quotes: Leave text inside ``"…"``, ``'…'`` and backtick spans alone.
        protect_data: Leave lines holding a tab, CSV-like paragraphs, YAML keys, values, items,
            continuation lines and flow-collection scalars alone.
        protect_markdown: Keep hard breaks, list-marker spacing that later lines depend on, and
            indented code inside lists.
        roles: Per chat role, the config for that role's messages (names of :data:`RULE_SETS`
            are accepted); other roles use this config.
    """

    enabled: bool = True
    newlines: bool = True
    trailing_whitespace: bool = True
    inner_spaces: bool = True
    keep_indentation: bool = True
    blank_lines: bool = True
    tabs: bool = False
    unicode_spaces: bool = False
    zero_width: bool = False
    json: bool = False
    tab_indent: bool = False
    tab_size: int = 4
    unicode_nfc: bool = False
    protect_code: bool = True
    protect_quotes: bool = True
    protect_data: bool = True
    protect_markdown: bool = True
    roles: Mapping[str, CanonicalizeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tab_size, int) or not 1 <= self.tab_size <= 16:
            raise ValueError(f"CanonicalizeConfig.tab_size must be an int in [1, 16], got {self.tab_size!r}")
        if not isinstance(self.roles, Mapping):
            raise ValueError("CanonicalizeConfig.roles must map role names to configs or rule-set names")
        roles: dict[str, CanonicalizeConfig] = {}
        for role, value in self.roles.items():
            config = CanonicalizeConfig.named(value) if isinstance(value, str) else value
            if not isinstance(role, str) or not isinstance(config, CanonicalizeConfig) or config.roles:
                raise ValueError(f"CanonicalizeConfig.roles[{role!r}] must be a rule-set name or a "
                                 f"CanonicalizeConfig without roles of its own, got {value!r}")
            roles[role] = config
        object.__setattr__(self, "roles", MappingProxyType(roles))

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Picklable (ingress worker processes get it): the read-only roles mapping is not.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["roles"] = dict(self.roles)
        return _config_from_fields, (fields,)

    @classmethod
    def off(cls) -> CanonicalizeConfig:
        """A config that changes nothing."""
        return cls(enabled=False)

    @classmethod
    def named(cls, name: str, **changes: Any) -> CanonicalizeConfig:
        """A rule set of :data:`RULE_SETS` by name, with some fields changed.

        Raises:
            ValueError: For an unknown name (the message lists the known ones).
        """
        try:
            base = RULE_SETS[name]
        except KeyError:
            raise ValueError(f"unknown canonicalization rule set {name!r}; "
                             f"one of {sorted(RULE_SETS)}") from None
        return dataclasses.replace(base, **changes) if changes else base

    def for_role(self, role: object) -> CanonicalizeConfig:
        """The config that applies to a message of ``role``."""
        if not self.enabled:
            return self
        return self.roles.get(role, self) if isinstance(role, str) else self


_SAFE = CanonicalizeConfig()
_PROSE = dataclasses.replace(_SAFE, tabs=True, unicode_spaces=True, zero_width=True, protect_quotes=False,
                             protect_data=False, protect_markdown=False)
def _config_from_fields(fields: dict[str, Any]) -> CanonicalizeConfig:
    return CanonicalizeConfig(**fields)


RULE_SETS: Mapping[str, CanonicalizeConfig] = MappingProxyType({
    "safe": _SAFE,
    "prose": _PROSE,
    "aggressive": dataclasses.replace(_PROSE, json=True, tab_indent=True, protect_code=False),
    "legacy": dataclasses.replace(_SAFE, tabs=True, protect_code=False, protect_quotes=False,
                                  protect_data=False, protect_markdown=False),
    "off": CanonicalizeConfig(enabled=False),
})
"""Rule sets by name (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class RuleCount:
    """What one rule changed.

    Attributes:
        edits: Substitutions it made (a run, a line end, a character, a JSON block).
        chars_changed: Input characters it replaced or removed.
        chars_removed: Characters it removed net (negative when it added, as JSON layout may).
    """

    edits: int
    chars_changed: int
    chars_removed: int


@dataclass(frozen=True, slots=True)
class Canonicalized:
    """The result of canonicalizing a prompt or a list of chat messages.

    Attributes:
        value: The canonical text (``str``) or messages (a list of new message dicts).
        changed: Whether anything differs from the input.
        chars_removed: Input length minus output length, in characters (summed over messages).
        edits: How many substitutions each rule made, for rules that made any.
        rules: Per rule that changed anything, its :class:`RuleCount`; their ``chars_removed``
            sum to ``chars_removed``.
    """

    value: Any
    changed: bool
    chars_removed: int
    edits: Mapping[str, int] = field(default_factory=dict)
    rules: Mapping[str, RuleCount] = field(default_factory=dict)


# -- scanning patterns -------------------------------------------------------------------------
# Every site pattern starts with one literal character, so the regex engine skips to it at C speed.

_LINE_END_SITE = re.compile(r"\n(?:(?<=[ \t]\n)|(?=\n\n))")  # after a space or tab; before two more
_DOUBLE_SPACE = re.compile(r"  (?<=[^ \n]  )")  # two spaces after something that is not a space
_INNER_TAB = re.compile(r"\t(?:(?<=[^ \t\n]\t)|(?<=[^ \t\n] \t))")
_LEAD_TAB = re.compile(r"\n *\t")
_LEAD_RUN = re.compile(r"\n(?:[ \t]{2}|\t)")
_JSON_START = re.compile(r"\n[\[{]")
# A line indented 4 columns after one that no paragraph goes on from: an empty line, a heading, a
# rule, or (conservatively) a quote, HTML or table line, whose content may be a block of its own.
_INDENTED_AFTER_EMPTY = re.compile(r"\n\n(?= {4}| {0,3}\t)(?=[ \t]*[^ \t\n])")
_INDENTED_AFTER_MARK = {  # one scan per character, only if the text holds it; rules fail fast
    ch: re.compile(re.escape(ch) + (r"[^\n]*" if ch in "#<>|" else r"=*[ \t]*" if ch == "=" else
                                    rf"[ \t]*{re.escape(ch)}[ \t]*{re.escape(ch)}[-*_ \t]*")
                   + r"\n(?= {4}| {0,3}\t)(?=[ \t]*[^ \t\n])")
    for ch in "#<>|=-*_"}
_NO_PARAGRAPH = re.compile(r" {0,3}(?:[#<>|].*|(?:[-*_][ \t]*){3,}|=+[ \t]*)")
_BLOCK_END = re.compile(r"\n(?![ \t]*(?:\n|\Z)| {4}| {0,3}\t)")  # next line neither blank nor indented
_YAML_PIPE = re.compile(r"\|[1-9+-]{0,2}[ \t]*(?:#[^\n]*)?(?=\n|\Z)")
_YAML_GT = re.compile(r">[1-9+-]{0,2}[ \t]*(?:#[^\n]*)?(?=\n|\Z)")
_YAML_HEADER_HEAD = re.compile(r"[ \t]*(?:(?:[^\n]*?[^ \t\n])?:|-|\?|---)(?:[ \t]+[!&][^ \t\n]*)*[ \t]+")
_HTML_OPEN = re.compile(r"<(pre|script|style|textarea)(?=[\s>])", re.IGNORECASE)
# A line that starts a new Markdown block even right after a paragraph line (so the line before
# it ends its paragraph, and two trailing spaces there are no hard break).
_BLOCK_START = re.compile(r" {0,3}(?:[-*+][ \t]+[^ \t\r]|1[.)][ \t]+[^ \t\r]|#{1,6}(?:[ \t]|\r?$)|```[^`]*$"
                         r"|~~~|(?:[-*_][ \t]*){3,}\r?$|=+[ \t]*\r?$)")
_HEADING = re.compile(r" {0,3}#{1,6}(?:[ \t]|\r?$)")
_SPACE_RUN = re.compile(r" {2,}")
_WS_RUN = re.compile(r"[ \t]{2,}|\t")
_MD_LEAD = re.compile(r"(?:>[ \t]*|(?:[-*+]|\d{1,9}[.)])(?:[ \t]+|$))+")  # quote and list markers
_QUOTE = re.compile(r"\\.|\"|`+|'")
_YAML_KEY = re.compile(r"[ \t]*(?:-[ \t]+)*([A-Za-z_](?:[\w.-]| +(?=[\w.-]))*)[ \t]*:"
                       r"(?:[ \t]+(?=[^ \t#])|[ \t]*\r?$)")  # group 1 the key; ends where a value starts
_YAML_ITEM = re.compile(r"[ \t]*-[ \t]+(?=[^ \t])")
_YAML_PARENT = re.compile(r"[ \t]*[^ \t#-][^\n]*:[ \t]*(?:#[^\n]*)?")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')
_CSV_MARKS = re.compile(r"[\",]")
_BRACKETS = re.compile(r"[\[\]{}]")
_FLOW_PUNCT = frozenset("{}[],: \t")  # in JSON every run of spaces touches one of these
_NOT_PLAIN = ('"', "'", "|", ">", "[", "{")  # what starts a YAML value that is not a plain scalar


def _json_layout(src: str) -> str | None:
    """``src`` re-laid out with indent 2 if it is a JSON object or array, else ``None``. Only the
    whitespace between tokens changes (tokens are copied, never re-serialized)."""
    try:
        value = json.loads(src)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict | list):
        return None
    tokens = _JSON_TOKEN.findall(src)
    out: list[str] = []
    depth = 0
    skip = False
    for i, tok in enumerate(tokens):
        if skip:
            skip = False
        elif tok in "{[":
            if i + 1 < len(tokens) and tokens[i + 1] == ("}" if tok == "{" else "]"):
                out.append(tok + tokens[i + 1])
                skip = True
            else:
                depth += 1
                out.append(tok + "\n" + "  " * depth)
        elif tok in "}]":
            depth -= 1
            out.append("\n" + "  " * depth + tok)
        elif tok == ",":
            out.append(",\n" + "  " * depth)
        elif tok == ":":
            out.append(": ")
        else:
            out.append(tok)
    return "".join(out)


def _marker_gap(line: str, m: re.Match[str]) -> int:
    """Columns of white space after the last list or quote marker ``m`` matched in ``line``."""
    end = len(line[:m.end()].rstrip(" \t"))
    return _columns(line[:m.end()], 4) - _columns(line[:end], 4)


def _columns(indent: str, tab_size: int) -> int:
    col = 0
    for ch in indent:
        col = (col // tab_size + 1) * tab_size if ch == "\t" else col + 1
    return col


class _Counts:
    """Per-rule tallies of one call (never shared between calls)."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: dict[str, list[int]] = {}

    def add(self, rule: Rule, edits: int, changed: int, removed: int) -> None:
        if edits:
            row = self.data.setdefault(rule.value, [0, 0, 0])
            row[0] += edits
            row[1] += changed
            row[2] += removed

    def result(self) -> tuple[dict[str, int], dict[str, RuleCount]]:
        return ({k: v[0] for k, v in self.data.items()},
                {k: RuleCount(*v) for k, v in self.data.items()})


class _Fence(NamedTuple):
    """A fenced code block: its lines ``[start, end]``, the first body line and the closing
    fence line (both ``len(text)`` when it does not close), and the info string."""

    start: int
    end: int
    body: int
    close: int
    info: str


class _Doc:
    """One call's work on one text: the view the rules read, its block structure, the edits.

    ``view`` is the text after the character rules (zero-width removed, Unicode spaces as
    spaces). Structure and sites are found in the view, so they come out the same when the output
    is canonicalized again (idempotence); protected lines are copied from ``text``.
    """

    def __init__(self, text: str, view: str, removed_at: list[int], config: CanonicalizeConfig,
                 counts: _Counts) -> None:
        self.text = text
        self.v = view
        self.gaps = [pos - i for i, pos in enumerate(removed_at)]  # view position of each removal
        self.c = config
        self.counts = counts
        self.cr = not config.newlines and "\r" in view
        self.blank_chars = (" \t" if config.tabs else " ") + ("\r" if self.cr else "")
        self.prot: list[tuple[int, int]] = []  # protected line ranges, [start, end] of the view
        self.prot_starts: list[int] = []
        self.skip: list[tuple[int, int]] = []  # protected or laid out as JSON: no line rule applies
        self.skip_starts: list[int] = []
        self.edits: dict[int, tuple[int, str]] = {}  # view start -> (view end, replacement)
        self.breaks: list[int] = []  # line ends after a space or tab, or before two empty lines
        self.csv: dict[int, bool] = {}  # paragraph start -> CSV-like
        self.partial: dict[int, list[tuple[int, int]]] = {}  # line start -> protected spans in it

    # -- lines ---------------------------------------------------------------------------------

    def line_end(self, ls: int) -> int:
        le = self.v.find("\n", ls)
        return len(self.v) if le < 0 else le

    def line_start(self, pos: int) -> int:
        return self.v.rfind("\n", 0, pos) + 1

    def blank(self, ls: int, le: int) -> bool:
        return not self.v[ls:le].strip(self.blank_chars)

    def protected(self, pos: int) -> bool:
        return _inside(self.prot, self.prot_starts, pos)

    def skipped(self, pos: int) -> bool:
        return _inside(self.skip, self.skip_starts, pos)

    def source(self, start: int, end: int) -> str:
        """The original text of view positions ``[start, end)``."""
        if not self.gaps:
            return self.text[start:end]
        gaps = self.gaps
        return self.text[start + bisect.bisect_left(gaps, start):end + bisect.bisect_right(gaps, end)]

    def edit(self, rule: Rule, start: int, end: int, old: str, new: str) -> None:
        self.edits[start] = (end, new)
        self.counts.add(rule, 1, len(old), len(old) - len(new))

    # -- structure -----------------------------------------------------------------------------

    def structure(self) -> None:
        """Finds the protected line ranges (code blocks, strings, YAML block scalars) and lays out
        JSON blocks. Each finder is a C-speed scan unless the text holds the marker it looks for."""
        c, v = self.c, self.v
        if c.json and self._json_whole():
            return
        fences = self._fences() if (c.protect_code or c.json) and ("`" in v or "~" in v) else []
        found: list[tuple[int, int]] = []
        if c.protect_code:
            found += [(f.start, f.end) for f in fences]
            found += self._triple_quotes(fences)
            html = self._html_blocks() if "<" in v else []
            found += html
            found += self._indented_code([f.end for f in fences] + [e for _, e in html])
            if "|" in v or ">" in v:
                found += self._yaml_blocks()
        self.prot = _merge(found)
        self.prot_starts = [s for s, _ in self.prot]
        self.skip, self.skip_starts = self.prot, self.prot_starts
        if c.json:
            done = self._json_blocks(fences)
            if done:
                self.skip = _merge(self.prot + done)
                self.skip_starts = [s for s, _ in self.skip]

    def _fences(self) -> list[_Fence]:
        """Each fenced block, fence lines included: CommonMark's rules, except that an opening
        fence may be indented any amount (nested lists indent them)."""
        v, n = self.v, len(self.v)
        out: list[_Fence] = []
        nxt = {m: v.find(m) for m in ("```", "~~~") if m[0] in v}
        pos = 0
        while True:
            for m in nxt:
                if 0 <= nxt[m] < pos:
                    nxt[m] = v.find(m, pos)
            hits = [p for p in nxt.values() if p >= 0]
            if not hits:
                return out
            p = min(hits)
            ls, le = self.line_start(p), self.line_end(p)
            indent = v[ls:p]
            ch = v[p]
            rest = v[p:le]
            run = len(rest) - len(rest.lstrip(ch))
            info = rest[run:].strip()
            if indent.strip(" \t") or (ch == "`" and "`" in info):
                pos = le + 1
                continue
            end, close = n, n
            look = le
            while True:  # the closing fence: same character, at least as long, nothing after it
                q = v.find(ch * run, look)
                if q < 0:
                    break
                qs, qe = self.line_start(q), self.line_end(q)
                if (qs > le and not v[qs:q].strip(" \t") and q - qs <= len(indent) + 3
                        and not v[q:qe].strip(ch + " \t\r")):
                    end, close = qe, qs
                    break
                look = qe
            out.append(_Fence(ls, end, le + 1, close, info))
            pos = end + 1
            if pos >= n:
                return out

    def _triple_quotes(self, fences: list[_Fence]) -> list[tuple[int, int]]:
        """Triple-quoted strings (outside fences): the lines between the quotes whole, and on the
        lines that open and close one, the characters from quote to quote (``self.partial``)."""
        v = self.v
        kinds = [q for q in ('"""', "'''") if q[0] in v and q in v]
        out: list[tuple[int, int]] = []
        pos = 0
        while kinds:
            hits = [p for p in (v.find(q, pos) for q in kinds) if p >= 0]
            if not hits:
                break
            p = min(hits)
            if any(f.start <= p <= f.end for f in fences):
                pos = p + 3
                continue
            close = v.find(v[p:p + 3], p + 3)
            if close < 0:  # never closed: the rest of the text
                first = self.line_start(p)
                self.partial.setdefault(first, []).append((p - first, self.line_end(p) - first))
                if self.line_end(p) < len(v):
                    out.append((self.line_end(p) + 1, len(v)))
                break
            end = close + 3
            first, last = self.line_start(p), self.line_start(end - 1)
            if first == last:
                self.partial.setdefault(first, []).append((p - first, end - first))
            else:
                self.partial.setdefault(first, []).append((p - first, self.line_end(p) - first))
                self.partial.setdefault(last, []).append((0, end - last))
                if self.line_end(p) + 1 < last:
                    out.append((self.line_end(p) + 1, last - 1))
            pos = end
        return out

    def _indented_code(self, block_ends: list[int]) -> list[tuple[int, int]]:
        """Lines indented four columns where no paragraph goes on (after a blank line, a heading,
        a rule, a fence or an HTML block: CommonMark's indented code, and what an unfenced code
        file often looks like), with the blank and indented lines that follow."""
        v = self.v
        # After an empty line or a line of spaces or tabs (the site scan found both), a heading,
        # rule, quote, HTML or table line, a fence or an HTML block.
        starts = [m.end() for m in _INDENTED_AFTER_EMPTY.finditer(v)]
        for p in self.breaks:
            if _code_indented(v[p + 1:p + 5]) and not v[self.line_start(p):p].strip(" \t\r"):
                starts.append(p + 1)
            elif v.startswith("\n", p + 1) and _code_indented(v[p + 2:p + 6]):
                starts.append(p + 2)
        if "\t" in v or "\n    " in v:
            for ch, pattern in _INDENTED_AFTER_MARK.items():
                if ch in v:
                    starts += [m.end() for m in pattern.finditer(v)
                               if _NO_PARAGRAPH.fullmatch(v[self.line_start(m.start()):m.end() - 1])]
        if v[:1] == "\n" and _code_indented(v[1:5]):
            starts.append(1)
        starts += [e + 1 for e in block_ends if _code_indented(v[e + 1:e + 5])]
        if _code_indented(v[:4]):
            starts.append(0)
        out: list[tuple[int, int]] = []
        for start in sorted(set(starts)):
            le = self.line_end(start)
            if start >= len(v) or not v[start:le].strip(" \t\r"):
                continue
            m = _BLOCK_END.search(v, le)
            end = len(v) if m is None else m.start()
            end = start + len(v[start:end].rstrip(" \t\n\r"))
            out.append((start, self.line_end(end - 1)))
        return out

    def _yaml_blocks(self) -> list[tuple[int, int]]:
        """YAML ``|`` and ``>`` block scalars: the lines after the header that are blank or
        indented deeper than it (trailing blank lines too: ``|+`` keeps them)."""
        v, size = self.v, self.c.tab_size
        out: list[tuple[int, int]] = []
        for pattern in (_YAML_PIPE, _YAML_GT):
            for m in pattern.finditer(v):
                ls = self.line_start(m.start())
                head = v[ls:m.start()]
                if not _YAML_HEADER_HEAD.fullmatch(head):
                    continue
                depth = _columns(head[:len(head) - len(head.lstrip(" \t"))], size)
                last = pos = m.end()
                while pos < len(v):
                    ce = self.line_end(pos + 1)
                    line = v[pos + 1:ce]
                    body = line.lstrip(" \t")
                    if body.strip(" \t\r") and _columns(line[:len(line) - len(body)], size) <= depth:
                        break
                    last = pos = ce
                if last > m.end():
                    out.append((m.end() + 1, last))
        return out

    def _html_blocks(self) -> list[tuple[int, int]]:
        """HTML ``<pre>``, ``<script>``, ``<style>`` and ``<textarea>`` blocks that start a line
        (CommonMark passes them through raw, and browsers keep their whitespace)."""
        v = self.v
        out: list[tuple[int, int]] = []
        pos = 0
        while (m := _HTML_OPEN.search(v, pos)) is not None:
            pos = m.end()
            ls = self.line_start(m.start())
            if v[ls:m.start()].strip(" \t"):
                continue
            close = re.compile(f"</{m.group(1)}>", re.IGNORECASE).search(v, m.end())
            end = len(v) if close is None else self.line_end(close.start())
            out.append((ls, end))
            pos = end
        return out

    def _json_whole(self) -> bool:
        """Lays out a text that is one JSON object or array; ``True`` if it is one."""
        v = self.v
        body = v.strip(" \t\n\r")
        if body[:1] not in ("{", "[") or body[-1:] not in ("}", "]"):
            return False
        laid = _json_layout(body)
        if laid is None:
            return False
        if laid != v:
            self.edit(Rule.JSON, 0, len(v), v, laid)
        self.skip = [(0, len(v))]
        self.skip_starts = [0]
        return True

    def _json_blocks(self, fences: list[_Fence]) -> list[tuple[int, int]]:
        """Lays out ```json fences and ``{``/``[`` paragraphs (after a blank line, not protected)."""
        v = self.v
        done: list[tuple[int, int]] = []
        for fence in fences:
            if fence.info.split(" ", 1)[0].lower() != "json" or fence.close >= len(v):
                continue
            first, last = fence.body, fence.close - 1
            if first >= last:
                continue
            old = self.source(first, last) if self.c.protect_code else v[first:last]
            laid = _json_layout(old)
            if laid is not None:
                if laid != old:
                    self.edit(Rule.JSON, first, last, old, laid)
                done.append((first, last))
        starts = [m.start() + 1 for m in _JSON_START.finditer(v)] + ([0] if v[:1] in ("{", "[") else [])
        for ls in starts:
            if self.protected(ls) or any(f.start <= ls <= f.end for f in fences) or (
                    ls > 0 and not self.blank(self.line_start(ls - 1), ls - 1)):
                continue
            end = ls
            while end < len(v) and not self.blank(end, self.line_end(end)) and not self.protected(end):
                end = self.line_end(end) + 1
            src = v[ls:end].rstrip(" \t\n\r")
            if src[-1:] not in ("}", "]"):
                continue
            laid = _json_layout(src)
            if laid is not None:
                stop = self.line_end(ls + len(src) - 1)  # with the last line's trailing spaces
                if laid != v[ls:stop]:
                    self.edit(Rule.JSON, ls, stop, v[ls:stop], laid)
                done.append((ls, stop))
        return done

    # -- paragraphs ----------------------------------------------------------------------------

    def para_start(self, ls: int) -> int:
        """Start of the paragraph (run of non-blank, unskipped lines) holding the line at ``ls``,
        found with C-speed searches for what ends a paragraph rather than line by line."""
        v = self.v
        start = v.rfind("\n\n", 0, ls) + 2 if ls else 0
        if start == 1:  # no empty line before ls
            start = 0
        i = bisect.bisect_right(self.skip_starts, ls) - 1
        if i >= 0 and self.skip[i][1] < ls:
            start = max(start, self.skip[i][1] + 1)
        if start == 0 and ls and self.blank(0, self.line_end(0)):
            start = self.line_end(0) + 1
        for ch in self.blank_chars:  # lines of spaces (or tabs, CRs) end in one of these
            q = v.rfind(ch + "\n", start, ls)
            while q >= 0:
                qs = self.line_start(q)
                if self.blank(qs, q + 1):
                    start = q + 2
                    break
                q = v.rfind(ch + "\n", start, qs)
        return start

    def para_lines(self, start: int) -> list[tuple[int, int]]:
        """The lines ``(start, end)`` of the paragraph that starts at ``start``."""
        v = self.v
        lines: list[tuple[int, int]] = []
        pos = start
        while pos <= len(v):
            le = self.line_end(pos)
            if lines and (self.blank(pos, le) or self.skipped(pos)):
                break
            lines.append((pos, le))
            pos = le + 1
        return lines

    def open_quotes(self, ls: int, start: int) -> tuple[bool, int]:
        """The ``"`` and backtick quotes still open where the line ``ls`` begins."""
        v = self.v
        if v.find("`", start, ls) < 0:
            if v.find('"', start, ls) < 0:
                return False, 0
            if (v.find("\\", start, ls) < 0 and v.find("'", start, ls) < 0
                    and not any(start <= k < ls for k in self.partial)):
                return v.count('"', start, ls) % 2 == 1, 0  # no escapes, no other quotes: parity
        dq, bt = False, 0
        pos = start
        while pos < ls:
            le = self.line_end(pos)
            _, dq, bt = _quote_spans(self.masked(pos, v[pos:le]), dq, bt)
            pos = le + 1
        return dq, bt

    def masked(self, ls: int, line: str) -> str:
        """``line`` with its triple-quoted parts blanked out, for scanning quotes."""
        for a, b in self.partial.get(ls, ()):
            line = line[:a] + "\0" * (min(b, len(line)) - a) + line[b:]
        return line

    def csv_like(self, start: int) -> bool:
        """Whether the paragraph at ``start`` is CSV-like: two or more records, each with the same
        number (one or more) of commas outside quotes, most of them not followed by a space
        (prose puts one after every comma), and no indented line."""
        cached = self.csv.get(start)
        if cached is not None:
            return cached
        v = self.v
        lines = self.para_lines(start)
        counts: list[int] = []
        in_field, record, spaced = False, 0, 0
        for a, b in lines:
            for m in _CSV_MARKS.finditer(v, a, b):
                if m.group() == '"':
                    in_field = not in_field
                elif not in_field:
                    record += 1
                    spaced += v.startswith(" ", m.end())
            if not in_field:
                counts.append(record)
                record = 0
        result = (len(counts) > 1 and counts[0] > 0 and len(set(counts)) == 1 and 2 * spaced < sum(counts)
                  and not any(v[a:a + 1] in (" ", "\t") for a, _ in lines))
        self.csv[start] = result
        return result

    def yaml_sequence(self, ls: int, column: int) -> bool:
        """Whether the ``- item`` line at ``ls`` is in YAML rather than a Markdown list: walking up
        over blank lines, items and what is indented deeper than the item's dash (its siblings'
        content), the first other line is a ``key:`` or ``key: value`` line right above an item."""
        pos, below_is_item = ls, True
        while pos > 0:
            ps = self.line_start(pos - 1)
            line = self.v[ps:pos - 1].rstrip("\r")
            pos = ps
            if self.skipped(ps):
                return False
            if not line.strip(" \t"):
                below_is_item = False
                continue
            indent = len(line) - len(line.lstrip(" \t"))
            item = _YAML_ITEM.match(line) is not None
            if indent > column or item:
                below_is_item = item
                continue
            return below_is_item and (_YAML_PARENT.fullmatch(line) or _YAML_KEY.match(line)) is not None
        return False

    def nested_block(self, le: int, indent: int) -> bool:
        """Whether the next non-blank line after ``le`` is a YAML key or ``- item`` line indented
        deeper than ``indent``, or an item at that indentation: what a YAML ``key:`` with no value
        on its line holds (a Python ``if x:`` holds statements)."""
        v = self.v
        while le < len(v):
            ns, le = le + 1, self.line_end(le + 1)
            line = v[ns:le]
            body = line.lstrip(" \t")
            if body.strip(" \t\r"):
                depth = len(line) - len(body)
                item = _YAML_ITEM.match(line) is not None
                return (depth > indent and (item or _YAML_KEY.match(line) is not None)) or (
                    depth == indent and item)
        return False

    def in_flow(self, ls: int, start: int) -> bool:
        """Whether the line at ``ls`` is inside a JSON/YAML flow collection that its paragraph
        (from ``start``) opens on its first line, as the line or as a ``key:`` value."""
        v = self.v
        if ls == start or (v.find("[", start, ls) < 0 and v.find("{", start, ls) < 0):
            return False
        first = v[start:self.line_end(start)]
        key = _YAML_KEY.match(first)
        opener = first[key.end():key.end() + 1] if key is not None else first.lstrip(" \t")[:1]
        if opener not in ("{", "["):
            return False
        depth, dq, bt, pos = 0, False, 0, start
        while pos < ls:
            le = self.line_end(pos)
            line = self.masked(pos, v[pos:le])
            spans, dq, bt = _quote_spans(line, dq, bt)
            for m in _BRACKETS.finditer(line):
                if not any(a <= m.start() < b for a, b in spans):
                    depth += 1 if m.group() in "[{" else -1
            pos = le + 1
        return depth > 0

    def paragraph_goes_on(self, line: str, nxt: str) -> bool:
        """Whether Markdown reads ``nxt`` as more of the paragraph ``line`` is in (so two spaces
        ending ``line`` are a hard break): ``line`` is no heading and ``nxt`` neither blank nor a
        new block, once the blockquote markers both lines share are peeled off."""
        while True:
            a, b = line.lstrip(" "), nxt.lstrip(" ")
            if not (a.startswith(">") and b.startswith(">") and len(line) - len(a) < 4 > len(nxt) - len(b)):
                break
            line, nxt = a[1:], b[1:]
        if _HEADING.match(line):
            return False  # an ATX heading is one line
        return bool(nxt.strip(self.blank_chars)) and _BLOCK_START.match(nxt) is None

    def continues(self, le: int, indent: int) -> bool:
        """Whether the list item or quote whose first line ends at ``le`` has a later line
        indented deeper than ``indent`` (whose reading depends on the marker's spacing). The item
        ends at a line no deeper than ``indent`` that follows a blank line or starts a block."""
        v = self.v
        after_blank = False
        while le < len(v):
            ns, le = le + 1, self.line_end(le + 1)
            line = v[ns:le]
            body = line.lstrip(" \t")
            if not body.strip(" \t\r"):
                after_blank = True
                continue
            if _columns(line[:len(line) - len(body)], 4) > indent:
                return True
            if after_blank or _BLOCK_START.match(line):
                return False
        return False

    def in_item_code(self, ls: int, indent: int) -> bool:
        """Whether the indented line at ``ls`` may be code in a list: it belongs to an item or
        quote that starts with indented code (five or more spaces after its marker), or it is
        indented four columns or more in a paragraph with a list item or quote line above it
        (where those end, CommonMark may read such a line as indented code)."""
        v, depth, pos = self.v, _columns(self.v[ls:ls + indent], 4), ls
        if depth >= 4:
            above = ls
            while above > 0:
                ps = self.line_start(above - 1)
                line = v[ps:above - 1]
                above = ps
                body = line.lstrip(" \t")
                if not body.strip(" \t\r"):
                    break
                if _MD_LEAD.match(line, len(line) - len(body)) is not None:
                    return True
        while pos > 0:
            ps = self.line_start(pos - 1)
            line = v[ps:pos - 1]
            pos = ps
            body = line.lstrip(" \t")
            if self.skipped(ps) or not body.strip(" \t\r"):
                continue
            cols = _columns(line[:len(line) - len(body)], 4)
            if cols >= depth:
                continue
            depth = cols
            m = _MD_LEAD.match(line, len(line) - len(body))
            if m is not None:  # a marker: it starts code, or is inside code itself, or neither
                return _marker_gap(line, m) >= 5 or (
                    depth > 0 and self.in_item_code(ps, len(line) - len(body)))
            if depth == 0:
                return False
        return False

    def yaml_continuation(self, ls: int, body: str) -> bool:
        """Whether the indented line at ``ls`` continues a YAML plain scalar (``key: some text``
        or a sequence item, then lines indented deeper): walks up over deeper lines."""
        depth = len(body) - len(body.lstrip(" \t"))
        pos = ls
        while pos > 0:
            ps = self.line_start(pos - 1)
            line = self.v[ps:pos - 1].rstrip("\r")
            pos = ps
            if self.skipped(ps):
                return False
            if not line.strip(" \t"):
                continue
            indent = len(line) - len(line.lstrip(" \t"))
            key = _YAML_KEY.match(line)
            if key is not None:
                return indent < depth and line[key.end():key.end() + 1] not in ("", *_NOT_PLAIN)
            item = _YAML_ITEM.match(line)
            if item is not None:
                return (indent < depth and line[item.end():item.end() + 1] not in _NOT_PLAIN
                        and self.yaml_sequence(ps, line.index("-")))
            if indent == 0:
                return False
        return False

    # -- one line ------------------------------------------------------------------------------

    def line(self, ls: int, le: int) -> None:
        """Applies the line rules to the unprotected line ``[ls, le)`` of the view."""
        c, v = self.c, self.v
        body = v[ls:le]
        if c.protect_data and not c.tabs and "\t" in body:
            rest = body.lstrip(" \t")
            if "\t" in rest or not rest:
                return  # a TSV row (empty cells too), or a literal tab
        content_end = len(body.rstrip(self.blank_chars))  # CRs (``newlines`` off) stay, at the end
        crs = "\r" * body.count("\r", content_end) if self.cr else ""
        if content_end == 0:
            if c.trailing_whitespace and body != crs:
                self.edit(Rule.TRAILING_WHITESPACE, ls, le, body, crs)
            return
        indent = len(body) - len(body.lstrip(" \t"))
        bare = indent >= content_end  # nothing but spaces and tabs (tabs kept as content)
        indent = min(indent, content_end)
        partial = self.partial.get(ls, ())
        if partial and min(a for a, _ in partial) < indent:
            indent = 0  # the line starts inside a string: its indentation is content
        new_indent = body[:indent]
        tab_indent = c.tab_indent and not bare and "\t" in new_indent
        if tab_indent:
            new_indent = " " * _columns(new_indent, c.tab_size)
        flatten = not c.keep_indentation and not bare and (
            len(new_indent) >= 2 or (c.tabs and "\t" in new_indent))
        lead = indent
        if c.protect_markdown and c.keep_indentation and indent < content_end:
            m = _MD_LEAD.match(body, indent, content_end)
            gap = _marker_gap(body, m) if m else 0
            if gap >= 5:
                return  # the item starts with indented code
            spaced = m is not None and ("  " in m.group() or "\t" in m.group())
            if spaced and self.continues(le, _columns(body[:indent], 4)):
                lead = m.end()  # the markers' spacing sets where the item's content starts
        runs = [m for m in (_WS_RUN if c.tabs else _SPACE_RUN).finditer(body, lead, content_end)
                ] if c.inner_spaces or c.tabs else []
        trailing = body[content_end:]
        trim = c.trailing_whitespace and trailing != crs
        if not (runs or trim or tab_indent or flatten):
            return
        if c.protect_markdown and indent and self.in_item_code(ls, indent):
            return  # inside a list item's indented code
        spans: list[tuple[int, int]] = list(partial)
        open_end = any(b >= len(body) for _, b in partial)
        if c.protect_quotes or c.protect_data:
            found = self._spans(ls, body, content_end)
            if found is None:
                return  # a CSV-like paragraph
            spans += found[0]
            open_end = open_end or found[1]
        if tab_indent:
            self.counts.add(Rule.TAB_INDENT, 1, indent, indent - len(new_indent))
        if flatten:
            self.counts.add(Rule.INNER_SPACES, 1, len(new_indent), len(new_indent) - 1)
            new_indent = " "
        parts = [new_indent, body[indent:lead]]
        pos = lead
        for m in runs:
            a, b = m.span()
            if spans and any(s <= a < e for s, e in spans):
                continue
            run = m.group()
            rule = Rule.TABS if "\t" in run else Rule.INNER_SPACES
            if not (c.tabs if rule is Rule.TABS else c.inner_spaces):
                continue
            self.counts.add(rule, 1, len(run), len(run) - 1)
            parts += (body[pos:a], " ")
            pos = b
        parts.append(body[pos:content_end])
        if trim and not open_end:
            keep = crs
            if (c.protect_markdown and trailing.replace("\r", "").endswith("  ") and le < len(v)
                    and self.paragraph_goes_on(body, v[le + 1:self.line_end(le + 1)])):
                keep = "  " + crs  # a Markdown hard line break
            if c.protect_markdown and body.endswith("\\", 0, content_end):
                keep = trailing  # after a backslash, how Markdown reads the spaces varies
            if trailing != keep:
                self.counts.add(Rule.TRAILING_WHITESPACE, 1, len(trailing), len(trailing) - len(keep))
            trailing = keep
        parts.append(trailing)
        new = "".join(parts)
        if new != body:
            self.edits[ls] = (le, new)

    def _spans(self, ls: int, body: str, content_end: int) -> tuple[list[tuple[int, int]], bool] | None:
        """Protected character ranges of a line and whether one reaches its end; ``None`` when
        the line belongs to a CSV-like paragraph."""
        c = self.c
        spans: list[tuple[int, int]] = []
        open_end = False
        start = self.para_start(ls)
        if c.protect_data and "," in body and body[:1] not in (" ", "\t") and self.csv_like(start):
            return None
        if c.protect_quotes:
            dq, bt = self.open_quotes(ls, start)
            if dq or bt or '"' in body or "'" in body or "`" in body:
                spans, dq, bt = _quote_spans(self.masked(ls, body), dq, bt)
                open_end = dq or bt > 0 or (bool(spans) and spans[-1][1] >= len(body))
        if c.protect_data:
            m = _YAML_KEY.match(body, 0, content_end) if ":" in body else None
            if m is not None:
                if m.end() < content_end:
                    spans += (m.span(1), (m.end(), content_end))  # key and value
                elif " " in m.group(1) and self.nested_block(ls + len(body), m.start(1) - m.start()):
                    spans.append(m.span(1))  # a key with a space over a nested block (not prose + ":")
            else:
                m = _YAML_ITEM.match(body, 0, content_end)
                if m is not None and self.yaml_sequence(ls, body.index("-")):
                    spans.append((m.end(), content_end))
                elif m is None and body[:1] in (" ", "\t") and self.yaml_continuation(ls, body):
                    spans.append((0, content_end))
            lead = body.lstrip(" \t")
            between_words = [r.span() for r in _SPACE_RUN.finditer(body, len(body) - len(lead), content_end)
                             if body[r.start() - 1] not in _FLOW_PUNCT and body[r.end()] not in _FLOW_PUNCT]
            if between_words and (lead[:1] in ("{", "[") or self.in_flow(ls, start)):
                spans += between_words  # in a flow collection such a run is inside a plain scalar
        return spans, open_end


def _inside(ranges: list[tuple[int, int]], starts: list[int], pos: int) -> bool:
    i = bisect.bisect_right(starts, pos) - 1
    return i >= 0 and pos <= ranges[i][1]


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _code_indented(head: str) -> bool:
    """Whether a line starting with ``head`` (its first four characters) is indented 4 columns."""
    return head.startswith("    ") or ("\t" in head and not head[:head.index("\t")].strip(" "))


def _quote_spans(line: str, dq: bool, bt: int) -> tuple[list[tuple[int, int]], bool, int]:
    """Ranges of ``line`` inside quotes. ``"…"`` and backtick spans may continue from the line
    before (``dq``; ``bt`` is the open backtick run's length); ``'…'`` opens only where an
    apostrophe cannot be (not after a letter or digit, except a string prefix) and ends with the
    line. Returns the ranges and the quotes still open at the line's end."""
    spans: list[tuple[int, int]] = []
    n = len(line)
    pos = 0
    if dq:
        close = _close_double(line, 0)
        if close < 0:
            return [(0, n)], True, 0
        spans.append((0, close + 1))
        pos = close + 1
    elif bt:
        m = _backtick_run(line, bt, 0)
        if m < 0:
            return [(0, n)], False, bt
        spans.append((0, m))
        pos = m
    while True:
        m = _QUOTE.search(line, pos)
        if m is None:
            return spans, False, 0
        tok, a = m.group(), m.start()
        if tok[0] == "\\":
            pos = m.end()
        elif tok == '"':
            close = _close_double(line, a + 1)
            if close < 0:
                spans.append((a, n))
                return spans, True, 0
            spans.append((a, close + 1))
            pos = close + 1
        elif tok[0] == "`":
            close = _backtick_run(line, len(tok), m.end())
            if close < 0:
                spans.append((a, n))
                return spans, False, len(tok)
            spans.append((a, close))
            pos = close
        else:
            before = line[:a]
            word = before.rstrip("rRbBfFuU")
            prev = before[-1:] if len(before) - len(word) > 2 or not before else (word[-1:] or " ")
            if prev.isalnum() or prev == "_":
                pos = m.end()
                continue
            close = a + 1
            while True:
                close = line.find("'", close)
                if close < 0 or _escaped(line, close) is False:
                    break
                close += 1
            if close < 0:
                spans.append((a, n))
                return spans, False, 0
            spans.append((a, close + 1))
            pos = close + 1


def _escaped(line: str, pos: int) -> bool:
    back = 0
    while pos - back - 1 >= 0 and line[pos - back - 1] == "\\":
        back += 1
    return back % 2 == 1


def _close_double(line: str, pos: int) -> int:
    """Index of the unescaped ``"`` at or after ``pos``, or -1."""
    while True:
        close = line.find('"', pos)
        if close < 0 or not _escaped(line, close):
            return close
        pos = close + 1


def _backtick_run(line: str, length: int, pos: int) -> int:
    """End of the next run of exactly ``length`` backticks at or after ``pos``, or -1."""
    while True:
        q = line.find("`" * length, pos)
        if q < 0:
            return -1
        end = q + length
        while end < len(line) and line[end] == "`":
            end += 1
        if end - q == length and (q == 0 or line[q - 1] != "`"):
            return end
        pos = end


# -- the pass ----------------------------------------------------------------------------------


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


def _blank_runs(doc: _Doc, breaks: list[int]) -> set[int]:
    """Collapses each run of two or more blank lines to one empty line. A run never holds the
    first line, and each of its lines ends in a line break. Returns the line starts consumed."""
    v, c = doc.v, doc.c
    consumed: set[int] = set()

    def free(ls: int, le: int) -> bool:
        return doc.blank(ls, le) and not doc.skipped(ls)

    for p in breaks:
        ls = doc.line_start(p)
        if ls == 0 or not free(ls, p):
            ls = p + 1
        if ls in consumed or ls >= len(v) or not free(ls, doc.line_end(ls)):
            continue
        while True:  # back to the first blank line of the run (never the first line)
            ps = doc.line_start(ls - 1)
            if ps == 0 or not free(ps, ls - 1):
                break
            ls = ps
        if ls in consumed:
            continue
        lines: list[tuple[int, int]] = []
        pos = ls
        while pos < len(v):
            le = v.find("\n", pos)
            if le < 0 or not free(pos, le):
                break
            lines.append((pos, le))
            pos = le + 1
        if len(lines) < 2:
            continue
        nxt = pos
        while nxt < len(v) and not v[nxt:doc.line_end(nxt)].strip(" \t\r"):
            nxt = doc.line_end(nxt) + 1
        after = v[nxt:doc.line_end(nxt)]
        indent = len(after) - len(after.lstrip(" \t"))
        if c.protect_markdown and 0 < indent < len(after) and (doc.in_item_code(nxt, indent) or (
                _columns(after[:indent], 4) >= 4 and _item_code_before(doc, ls))):
            continue  # blank lines inside indented code in a list
        consumed.update(a for a, _ in lines)
        start, end = lines[0][0], lines[-1][1] + 1
        new = "\r" * v.count("\r", start, lines[0][1]) + "\n"  # ``newlines`` off: keep a CRLF a CRLF
        span = end - start
        if c.trailing_whitespace:
            spaces = [b - a - v.count("\r", a, b) for a, b in lines]
            if sum(spaces):
                doc.counts.add(Rule.TRAILING_WHITESPACE, sum(n > 0 for n in spaces), sum(spaces), sum(spaces))
                span -= sum(spaces)
        doc.counts.add(Rule.BLANK_LINES, 1, span, span - len(new))
        doc.edits[start] = (end, new)
    return consumed


def _item_code_before(doc: _Doc, ls: int) -> bool:
    """Whether the last non-blank line before the one at ``ls`` is indented code in a list (see
    ``in_item_code``)."""
    while ls > 0:
        ps = doc.line_start(ls - 1)
        line = doc.v[ps:ls - 1]
        ls = ps
        body = line.lstrip(" \t")
        if body.strip(" \t\r"):
            return len(line) > len(body) and doc.in_item_code(ps, len(line) - len(body))
    return False


def _canonical(text: str, config: CanonicalizeConfig, counts: _Counts, every_line: bool = False) -> str:
    if config.newlines and "\r" in text:
        lf, breaks = _lf(text)
        n_crlf = len(text) - len(lf)
        counts.add(Rule.NEWLINES, breaks, breaks + n_crlf, n_crlf)
        text = lf
    view, removed = text, []
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
