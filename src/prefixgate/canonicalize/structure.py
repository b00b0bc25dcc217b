"""Structure scans: the protected line ranges of a text and its JSON blocks.

Protected are fenced and indented code, triple-quoted strings, raw HTML ``<pre>``-like blocks and
YAML block scalars (with ``protect_code``); ``json`` lays out ```json fences, a whole message that
is JSON, and paragraphs that start with ``{`` or ``[``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .config import Rule
from .document import _DocBase
from .scanning import (
    _BLOCK_END,
    _HTML_OPEN,
    _INDENTED_AFTER_EMPTY,
    _INDENTED_AFTER_MARK,
    _JSON_START,
    _NO_PARAGRAPH,
    _YAML_GT,
    _YAML_HEADER_HEAD,
    _YAML_PIPE,
    _columns,
    _json_layout,
)


class _Fence(NamedTuple):
    """A fenced code block: its lines ``[start, end]``, the first body line and the closing
    fence line (both ``len(text)`` when it does not close), and the info string."""

    start: int
    end: int
    body: int
    close: int
    info: str


class _Structure(_DocBase):
    """The structure scans of a document: they set its protected and skipped line ranges."""

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
