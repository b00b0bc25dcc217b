"""One call's state: the per-rule tallies and the document the later stages build on."""

from __future__ import annotations

import bisect

from .config import CanonicalizeConfig, Rule, RuleCount


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


class _DocBase:
    """One call's work on one text: the view the rules read, its block structure, the edits.

    ``view`` is the text after the character rules (zero-width removed, Unicode spaces as
    spaces). Structure and sites are found in the view, so they come out the same when the output
    is canonicalized again (idempotence); protected lines are copied from ``text``.

    The structure scans (``structure.py``), the paragraph queries (``paragraphs.py``) and the line
    rules (``lines.py``) are its subclasses; ``lines._Doc`` puts them together.
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


def _inside(ranges: list[tuple[int, int]], starts: list[int], pos: int) -> bool:
    i = bisect.bisect_right(starts, pos) - 1
    return i >= 0 and pos <= ranges[i][1]
