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

The package reads in the order of the pass: ``config`` (the switches, the rule sets, what a call
reports), ``scanning`` (patterns, JSON layout, the quote scanner), ``document`` (one call's state),
``structure`` (protected blocks, JSON blocks), ``paragraphs`` (what the line rules ask about a
line's context), ``lines`` (the line rules, blank-line runs) and ``pipeline`` (the pass and the
entry points).
"""

from .config import (
    RULE_SETS,
    CanonicalizeConfig,
    Canonicalized,
    Rule,
    RuleCount,
)
from .config import UNICODE_SPACE_CHARS as UNICODE_SPACE_CHARS
from .config import ZERO_WIDTH_CHARS as ZERO_WIDTH_CHARS
from .config import _config_from_fields as _config_from_fields
from .document import _Counts as _Counts
from .pipeline import _canonical as _canonical
from .pipeline import canonicalize_messages, canonicalize_text

__all__ = [
    "RULE_SETS",
    "CanonicalizeConfig",
    "Canonicalized",
    "Rule",
    "RuleCount",
    "canonicalize_messages",
    "canonicalize_text",
]
