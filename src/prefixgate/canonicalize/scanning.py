"""Scanning patterns and the string helpers the stages of a pass share.

The regexes that find the sites a rule may change and the structure the protections read, JSON
layout token by token, indentation columns, and the quote scanner. Other modules import these by
name, so a hot loop reads a module global.
"""

from __future__ import annotations

import json
import re

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
        end = _backtick_run(line, bt, 0)
        if end < 0:
            return [(0, n)], False, bt
        spans.append((0, end))
        pos = end
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
