"""What the line rules ask about a line's context.

Where its paragraph starts, which quotes are open, whether the paragraph is CSV-like, whether the
line is YAML (a sequence item, a key over a nested block, a plain-scalar continuation, inside a
flow collection), and how Markdown reads it (a hard break, a list item's continuation, indented
code in a list).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from .document import _DocBase
from .scanning import (
    _BLOCK_START,
    _BRACKETS,
    _CSV_MARKS,
    _HEADING,
    _MD_LEAD,
    _NOT_PLAIN,
    _YAML_ITEM,
    _YAML_KEY,
    _YAML_PARENT,
    _columns,
    _marker_gap,
    _quote_spans,
)


class _Paragraphs(_DocBase):
    """The paragraph and context queries of a document; they read the skipped ranges that the
    structure scans set."""

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

    def _above(self, ls: int) -> Iterator[tuple[int, str, int] | None]:
        """The non-blank lines above ``ls``, nearest first, as (start, line, indent); ``None``,
        and nothing after it, at a line another scan has already claimed."""
        pos = ls
        while pos > 0:
            ps = self.line_start(pos - 1)
            line = self.v[ps:pos - 1].rstrip("\r")
            pos = ps
            if self.skipped(ps):
                yield None
                return
            if line.strip(" \t"):
                yield ps, line, len(line) - len(line.lstrip(" \t"))

    def yaml_sequence(self, ls: int, column: int) -> bool:
        """Whether the ``- item`` line at ``ls`` is in YAML rather than a Markdown list: walking up
        over blank lines, items and what is indented deeper than the item's dash (its siblings'
        content), the first other line is a ``key:`` or ``key: value`` line right above an item
        (blank lines between them allowed: YAML allows them, and a Markdown list after an
        "Intro:" line that is taken for YAML only keeps its whitespace)."""
        below_is_item = True
        for found in self._above(ls):
            if found is None:
                return False
            _, line, indent = found
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
        for found in self._above(ls):
            if found is None:
                return False
            ps, line, indent = found
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
