"""Canonicalization keeps meaning: each corpus document parses the same before and after.

``tests/corpus`` holds one document per format, each with whitespace noise of the kinds the rules
remove, placed both where it is harmless and where it is meaning (trailing spaces in a Python
string or a YAML block scalar, an empty TSV cell, a Markdown hard break, doubled spaces in a CSV
field or a YAML plain scalar). Each is checked by its own parser:

* ``.py``: ``ast.dump`` of the module.
* ``.json``: ``json.loads``.
* ``.yaml``: ``yaml.safe_load``.
* ``.tsv``/``.csv``: the ``csv`` module's rows. Blank lines are dropped (``csv.DictReader`` and
  pandas skip them: a blank line is not a record), and a line break inside a quoted field is
  compared as ``\\n`` whether the file spelled it CRLF or LF.
* ``.md``: the HTML markdown-it-py renders (CommonMark plus tables, raw HTML on), with runs of
  ASCII whitespace outside ``<pre>`` collapsed to one space, because HTML itself treats those
  runs as one space (CSS ``white-space: normal``). Nothing else is normalized: an NBSP or a
  zero-width space in the HTML counts.
* ``.txt``: the words (``str.split``).

Documents are checked as chat messages carry them: whole (LF and CRLF line ends), and fenced
inside a prose user message (a system message in the same request uses the ``prose`` rules).
Hypothesis then does the same for generated Markdown, YAML and JSON.

Known limit (documented in ``canonicalize/__init__.py``): quote state does not cross a blank
line, so a double-quoted YAML or CSV string that holds a blank line is protected only up to it;
the generated YAML puts its blank lines between top-level entries.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from prefixgate import CanonicalizeConfig, canonicalize_messages, canonicalize_text

CORPUS = Path(__file__).parent / "corpus"
DOCS = sorted(p for p in CORPUS.iterdir() if p.suffix != ".txt" or p.stem == "prose_noisy")
LANG = {".py": "python", ".json": "json", ".yaml": "yaml", ".tsv": "tsv", ".csv": "csv", ".md": "markdown",
        ".txt": "text"}
_MD = MarkdownIt("commonmark", {"html": True}).enable("table")
# A block-level tag (or <br>) and the collapsed space beside it: CSS drops spaces at line ends.
_AT_BLOCK_EDGE = re.compile(r" ?(</?(?:p|li|ul|ol|blockquote|h[1-6]|div|table|thead|tbody|tr|th|td|hr|br)\b"
                            r"[^>]*>) ?")


def rendered(text: str) -> str:
    """Markdown as HTML, with what HTML ignores (ASCII whitespace runs outside <pre>) collapsed."""
    parts = re.split(r"(<pre[ >].*?</pre>)", _MD.render(text), flags=re.S)
    return "".join(p if p.startswith("<pre") else
                   _AT_BLOCK_EDGE.sub(r"\1", re.sub(r"[ \t\n\r\f]+", " ", p)).strip() for p in parts)


def rows(delimiter: str) -> Callable[[str], list[list[str]]]:
    def parse(text: str) -> list[list[str]]:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
        return [[cell.replace("\r\n", "\n") for cell in row] for row in reader if row]
    return parse


PARSE: dict[str, Callable[[str], Any]] = {
    ".py": lambda t: ast.dump(ast.parse(t)),
    ".json": json.loads,
    ".yaml": yaml.safe_load,
    ".tsv": rows("\t"),
    ".csv": rows(","),
    ".md": rendered,
    ".txt": str.split,
}


def read(path: Path, newline: str = "\n") -> str:
    return path.read_text(encoding="utf-8").replace("\n", newline)


def fenced(path: Path, text: str) -> tuple[str, str, str]:
    """A user message carrying ``text`` in a fence, and the lines that open and close it."""
    fence = "````" if path.suffix == ".md" else "```"  # the Markdown document holds ``` fences
    opening, closing = f"{fence}{LANG[path.suffix]}", fence
    message = (f"Please  review this {LANG[path.suffix]} file.  \n\n\n{opening}\n{text}\n{closing}\n\n\n"
               "Thanks,   the team.  ")
    return message, opening, closing


def unfence(message: str, opening: str, closing: str) -> str:
    _, sep, rest = message.partition(f"\n{opening}\n")
    assert sep, "the opening fence is gone"
    body, sep, _ = rest.rpartition(f"\n{closing}\n")
    assert sep, "the closing fence is gone"
    return body


def test_the_corpus_parses():
    assert {p.suffix for p in DOCS} == set(PARSE)
    for path in DOCS:
        assert PARSE[path.suffix](read(path))


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_safe_keeps_the_meaning_of_a_whole_document(path, newline):
    text = read(path, newline)
    result = canonicalize_text(text)
    assert PARSE[path.suffix](result.value) == PARSE[path.suffix](text)
    assert result.changed  # every document holds noise safe removes (not only CRLF)
    assert set(result.edits) - {"newlines"}
    assert canonicalize_text(result.value).value == result.value


@pytest.mark.parametrize("as_parts", [False, True], ids=["string", "parts"])
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_safe_keeps_the_meaning_of_a_fenced_document_in_a_message(path, as_parts):
    text = read(path)
    message, opening, closing = fenced(path, text)
    system = "You are  a careful\u00a0reviewer.\t Answer briefly.  "
    content: Any = [{"type": "text", "text": message}] if as_parts else message
    config = CanonicalizeConfig(roles={"system": "prose"})
    result = canonicalize_messages([{"role": "system", "content": system},
                                    {"role": "user", "content": content}], config)
    out = result.value[1]["content"]
    out = out[0]["text"] if as_parts else out
    assert PARSE[path.suffix](unfence(out, opening, closing)) == PARSE[path.suffix](text)
    assert out.startswith(f"Please review this {LANG[path.suffix]} file.\n\n{opening}\n")
    assert out.endswith(f"\n{closing}\n\nThanks, the team.")
    assert result.value[0]["content"] == "You are a careful reviewer. Answer briefly."


def test_inside_a_fence_safe_changes_nothing_but_line_ends():
    for path in DOCS:
        text = read(path)
        message, opening, closing = fenced(path, text.replace("\n", "\r\n"))
        assert unfence(canonicalize_text(message).value, opening, closing) == text


def test_safe_removes_the_noise_of_prose():
    clean = read(CORPUS / "prose.txt")
    noisy = read(CORPUS / "prose_noisy.txt")
    assert canonicalize_text(clean).value == clean
    for newline in ("\n", "\r\n"):
        assert canonicalize_text(noisy.replace("\n", newline)).value == clean


def test_prose_rules_also_remove_unicode_noise_from_prose():
    clean = read(CORPUS / "prose.txt")
    noisy = read(CORPUS / "prose_noisy.txt").replace("helpful", "help\u200bful").replace(
        "Acme support", "Acme\u00a0support").replace("30-day", "30-day\u2009").replace("You", "\ufeffYou")
    assert canonicalize_text(noisy, CanonicalizeConfig.named("prose")).value == clean


@pytest.mark.parametrize("path", [p for p in DOCS if p.suffix != ".txt"], ids=lambda p: p.name)
def test_the_old_default_changes_the_meaning_of_every_structured_document(path):
    """Why safe protects what it protects: without protections the corpus breaks."""
    text = read(path)
    legacy = canonicalize_text(text, CanonicalizeConfig.named("legacy")).value
    assert PARSE[path.suffix](legacy) != PARSE[path.suffix](text)


@pytest.mark.parametrize(("snippet", "suffix"), [
    ("a\u00a0b and\u2009c, zero\u200bwidth\n", ".md"),
    ('{"name": "a\u00a0b\u200bc"}', ".json"),
    ('s = "a\u3000b"\n', ".py"),
])
def test_unicode_space_and_zero_width_rules_change_meaning_so_safe_leaves_them_off(snippet, suffix):
    changed = canonicalize_text(snippet, CanonicalizeConfig(unicode_spaces=True, zero_width=True,
                                                            protect_quotes=False)).value
    assert PARSE[suffix](changed) != PARSE[suffix](snippet)
    assert canonicalize_text(snippet).value == snippet


def test_opt_in_json_layout_keeps_json_values():
    text = read(CORPUS / "config.json")
    config = CanonicalizeConfig(json=True)
    whole = canonicalize_text(text, config)
    assert json.loads(whole.value) == json.loads(text) and whole.edits == {"json": 1}
    message, opening, closing = fenced(CORPUS / "config.json", text)
    inside = unfence(canonicalize_text(message, config).value, opening, closing)
    assert inside == whole.value
    four = whole.value.replace("\n  ", "\n    ")  # the same JSON indented by 4, 8, 12
    assert canonicalize_text(four, config).value == whole.value  # any indentation, one form


def test_opt_in_tab_indent_keeps_python_meaning():
    text = read(CORPUS / "tabs.py")
    result = canonicalize_text(text, CanonicalizeConfig(tab_indent=True))
    assert ast.dump(ast.parse(result.value)) == ast.dump(ast.parse(text))
    assert result.edits["tab_indent"] == 5  # the line inside the triple-quoted string keeps its tab
    assert "\ttab  here" in result.value


# -- generated documents ------------------------------------------------------------------------

_WORD = st.sampled_from(["a", "bb", "c", "`x  y`", '"q  r"', "*e*", "1,2", "k:", "'s  t'", "<b>", "\\",
                        "_u_"])
_SPACE = st.sampled_from([" ", "  ", "   ", "\t"])
_MD_TEXT = st.lists(st.tuples(_WORD, _SPACE), min_size=1, max_size=5).map(
    lambda ws: "".join(w + s for w, s in ws).rstrip(" \t"))
_MD_LINE = st.tuples(
    st.sampled_from(["", " ", "  ", "    ", "      ", "\t", "        "]),
    st.sampled_from(["", "- ", "-  ", "-     ", "* ", "+   ", "1. ", "1)  ", "2.  ", "> ", ">  ", ">> ",
                     "> - ", "# ", "#", "| ", "|---|---|", "```", "~~~", "````", "```python", "---", "===",
                     "***", "<pre>", "</pre>", "<div>", "key: ", "\\"]),
    _MD_TEXT, st.sampled_from(["", " ", "  ", "   ", "\t", "  \t"]),
).map("".join)
markdown_docs = st.lists(st.one_of(_MD_LINE, _MD_LINE, _MD_LINE, st.sampled_from(["", " ", "  ", "\t"])),
                         min_size=1, max_size=14).map("\n".join)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(markdown_docs)
def test_safe_keeps_the_rendering_of_generated_markdown(text):
    assert rendered(canonicalize_text(text).value) == rendered(text)


_SCALAR = st.one_of(st.sampled_from(["a  b", "x", "two  spaces ", " lead", "t\tab", "multi\nline  \n\nend",
                                     "key: v", "- item", "#c", "a ' b", 'q "x"', "1", "yes", "", "é  ü"]),
                    st.integers(-5, 5), st.booleans(), st.none())
_VALUES = st.recursive(_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["a", "b", "key", "name", "x y"]), inner, max_size=4)), max_leaves=12)


def _noisy(text: str, rng: random.Random) -> str:
    """Whitespace noise the rules remove: trailing spaces, spaces after a colon or between two
    characters, blank lines before top-level lines."""
    out = []
    for line in text.split("\n"):
        r = rng.random()
        if r < 0.2:
            line += rng.choice([" ", "  ", "   "])
        elif r < 0.35:
            line = line.replace(": ", ":   ", 1)
        elif r < 0.45:
            line = re.sub(r"(\S) (\S)", r"\1  \2", line, count=1)
        if rng.random() < 0.1 and line[:1] not in (" ", "\t"):
            out += ["", ""]
        out.append(line)
    return "\n".join(out)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(_VALUES, st.sampled_from([None, "|", ">", '"', "'"]), st.sampled_from([None, False, True]),
       st.integers(0, 2**32), st.sampled_from([None, 2, 4]))
def test_safe_keeps_the_values_of_generated_yaml_and_json(value, style, flow, seed, indent):
    rng = random.Random(seed)
    text = _noisy(yaml.safe_dump({"root": value}, default_style=style, default_flow_style=flow,
                                 allow_unicode=True), rng)
    try:
        meant = yaml.safe_load(text)
    except Exception:  # noise can break YAML (and PyYAML raises more than YAMLError)
        meant = None
    assume(meant is not None)
    assert yaml.safe_load(canonicalize_text(text).value) == meant
    text = _noisy(json.dumps(value, indent=indent, ensure_ascii=False), rng)
    assert json.loads(canonicalize_text(text).value) == json.loads(text)


@pytest.mark.parametrize("text", ["root:\n\n\n- [a  b]\n", "root:\n\n- - a  b\n", "k:\n\n  - x  y\n"])
def test_blank_lines_between_a_yaml_key_and_its_items_keep_them_yaml(text):
    # Found by the property above (value [["a  b"]], blank lines from the noise): the items were
    # taken for a Markdown list and "a  b" became "a b".
    assert yaml.safe_load(canonicalize_text(text).value) == yaml.safe_load(text)
