"""The line rules: the rules for one line (``tab_indent``, ``trailing_whitespace``,
``inner_spaces``, ``tabs``) with the protections that stop them, and ``blank_lines``."""

from __future__ import annotations

from .config import Rule
from .paragraphs import _Paragraphs
from .scanning import (
    _FLOW_PUNCT,
    _MD_LEAD,
    _SPACE_RUN,
    _WS_RUN,
    _YAML_ITEM,
    _YAML_KEY,
    _columns,
    _marker_gap,
    _quote_spans,
)
from .structure import _Structure


class _Doc(_Structure, _Paragraphs):
    """One call's work on one text (see :class:`~.document._DocBase`): its structure scans, the
    paragraph queries and the rules for one line."""

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
            if m is not None and spaced and self.continues(le, _columns(body[:indent], 4)):
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
