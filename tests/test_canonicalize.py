"""Canonicalization: exact rule behaviour, rule sets and roles, and Hypothesis properties.

The meaning of whole documents (Python, JSON, YAML, CSV/TSV, Markdown, prose) is checked by their
own parsers in ``test_canonicalize_meaning.py``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixgate import CanonicalizeConfig, canonicalize_messages, canonicalize_text
from prefixgate.canonicalize import RULE_SETS, ZERO_WIDTH_CHARS, Rule, RuleCount, _canonical, _Counts

NAMED = ("safe", "prose", "aggressive", "legacy")
SWITCHES = ("newlines", "trailing_whitespace", "inner_spaces", "keep_indentation", "blank_lines", "tabs",
            "unicode_spaces", "zero_width", "json", "tab_indent", "protect_code", "protect_quotes",
            "protect_data", "protect_markdown")

# Text rich in what the rules and protections care about, plus arbitrary Unicode.
ATOMS = [" ", "  ", "\t", "\n", "\r", "\r\n", "\n\n", "    ", "\n    ", "\n- ", "a", "B", "é", "e\u0301",
         "\u00a0", "\u3000", "\u2009", "\u200b", "\u2060", "\ufeff", "\u200d", "\u200c", "\f", '"', "'", "`",
         "```", "~~~", '"""', "'''", ",", "- ", "key: ", ": ", "|", ">", "#", "{", "}", "[", "]", "\\", "1",
         "\n```json\n", "\n```\n", '"a"', "<pre>", "</pre>"]
noisy_text = st.lists(st.one_of(st.sampled_from(ATOMS), st.characters()), max_size=80).map("".join)
configs = st.builds(CanonicalizeConfig, **{s: st.booleans() for s in SWITCHES},
                    enabled=st.booleans(), tab_size=st.sampled_from([2, 4, 8]))
ZERO_WIDTH = set(ZERO_WIDTH_CHARS)


def visible(s: str) -> list[str]:
    """The characters no rule may change: all but whitespace and the removable zero-width ones."""
    return [c for c in s if not c.isspace() and c not in ZERO_WIDTH]


# -- the old default, kept as an oracle for the ``legacy`` rule set ------------------------------

_NL = r"(?:\r\n|\r(?!\n)|\n)"


def old_default(text: str, inner: bool = True, blank: bool = True) -> str:
    """prefixgate 0.1's four regex passes (``trailing_whitespace`` on)."""
    text = re.sub(r"\r\n?", "\n", text)
    text = re.sub(r"[ \t]+(?=\r\n|\r|\n|\Z)", "", text)
    if inner:
        text = re.sub(r"(?<=[^ \t\r\n])(?:[ \t]{2,}|\t)(?=[^\r\n])", " ", text)
    else:  # only runs holding a tab (the ``tabs`` switch)
        text = re.sub(r"(?<=[^ \t\r\n])[ \t]*\t[ \t]*(?=[^\r\n])", " ", text)
    if blank:
        text = re.sub(rf"({_NL})(?:[ \t]*{_NL}){{2,}}", lambda m: m.group(1) * 2, text)
    return text


# -- exact behaviour of each rule ---------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected", "rule"), [
    ("a\r\nb\rc", "a\nb\nc", "newlines"),
    ("line one \nline two   \n\nend", "line one\nline two\n\nend", "trailing_whitespace"),
    ("x  =  1;  y =   2", "x = 1; y = 2", "inner_spaces"),
    ("para\n\n\n\n  \nnext", "para\n\nnext", "blank_lines"),
])
def test_each_rule_does_exactly_its_job(raw, expected, rule):
    result = canonicalize_text(raw)
    assert result.value == expected
    assert result.changed
    assert rule in result.edits
    assert result.chars_removed == len(raw) - len(expected)


def test_rule_counts_say_what_each_rule_changed():
    result = canonicalize_text("a  b\r\nc   \n\n\n\nd", CanonicalizeConfig.named("prose"))
    assert result.value == "a b\nc\n\nd"
    assert result.rules == {
        "newlines": RuleCount(edits=1, chars_changed=2, chars_removed=1),
        "inner_spaces": RuleCount(edits=1, chars_changed=2, chars_removed=1),
        "trailing_whitespace": RuleCount(edits=1, chars_changed=3, chars_removed=3),
        "blank_lines": RuleCount(edits=1, chars_changed=3, chars_removed=2),
    }
    assert result.edits == {k: v.edits for k, v in result.rules.items()}
    assert sum(r.chars_removed for r in result.rules.values()) == result.chars_removed == 7


def test_unicode_spaces_and_zero_width_in_prose_but_never_zwj_or_zwnj():
    prose = CanonicalizeConfig.named("prose")
    result = canonicalize_text("Say\u00a0hi\u200b  to\u3000the\u2009team\ufeff.", prose)
    assert result.value == "Say hi to the team."
    assert result.rules["unicode_spaces"] == RuleCount(3, 3, 0)
    assert result.rules["zero_width"] == RuleCount(2, 2, 2)
    joined = "👩\u200d💻 and \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # ZWJ emoji, ZWNJ Persian
    assert canonicalize_text(joined, prose).value == joined
    assert canonicalize_text("a\u00a0\u00a0b\u200b", CanonicalizeConfig()).value == "a\u00a0\u00a0b\u200b"


def test_tabs_count_as_spaces_only_when_asked():
    assert canonicalize_text("name\t\tprice\nwidget\t\t3.50").value == "name\t\tprice\nwidget\t\t3.50"
    prose = canonicalize_text("name\t\tprice \t\nwidget\t3.50", CanonicalizeConfig.named("prose"))
    assert prose.value == "name price\nwidget 3.50"
    assert prose.rules["tabs"].edits == 2


def test_tab_indent_expands_to_tab_stops():
    config = CanonicalizeConfig(tab_indent=True, tab_size=4)
    assert canonicalize_text("if x:\n\tif y:\n\t\treturn 1\n  \treturn 2", config).value == (
        "if x:\n    if y:\n        return 1\n    return 2")


def test_indentation_is_kept_by_default_and_flattened_on_request():
    code = "def f():\n        return  1\n\tpass"
    assert canonicalize_text(code).value == "def f():\n        return 1\n\tpass"
    flat = canonicalize_text(code, CanonicalizeConfig.named("legacy", keep_indentation=False)).value
    assert flat == "def f():\n return 1\n pass"


def test_clean_text_is_reported_unchanged():
    result = canonicalize_text("You are a helpful assistant.\n\nAnswer briefly.")
    assert not result.changed and result.chars_removed == 0 and result.edits == {} and result.rules == {}


def test_never_lowercases_or_touches_other_characters():
    raw = "ÉCOLE  Straße\u00a0NBSP  ΣΊΣΥΦΟΣ"
    assert canonicalize_text(raw).value == "ÉCOLE Straße\u00a0NBSP ΣΊΣΥΦΟΣ"
    for name in NAMED:
        assert visible(canonicalize_text(raw, CanonicalizeConfig.named(name)).value) == visible(raw)


def test_nfc_is_off_in_every_rule_set_and_composes_when_on():
    raw = "cafe\u0301"
    for name in NAMED:
        assert canonicalize_text(raw, CanonicalizeConfig.named(name)).value == raw
    on = canonicalize_text(raw, CanonicalizeConfig(unicode_nfc=True))
    assert on.value == "café" and on.edits == {"unicode_nfc": 1}


def test_crlf_is_one_newline_not_two():
    assert canonicalize_text("a\r\n\r\nb").value == "a\n\nb"
    kept = canonicalize_text("a\r\n\r\n\r\n\r\nb", CanonicalizeConfig(newlines=False)).value
    assert kept == "a\r\n\r\nb"


# -- what safe protects -------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    # code fences (``` and ~~~) and indented code: byte for byte
    ("Run  it:\n```py\nx  =  1   \n\n\n\ny\t= 2\n```\nok  now",
     "Run it:\n```py\nx  =  1   \n\n\n\ny\t= 2\n```\nok now"),
    ("~~~\na  b  \n~~~", "~~~\na  b  \n~~~"),
    ("Text  here\n\n    code  x   \n\n\n    more\nback  here",
     "Text here\n\n    code  x   \n\n\n    more\nback here"),
    # strings: triple-quoted, quoted, backticks
    ('s = """a  \n\n\n b  """\nt  =  1', 's = """a  \n\n\n b  """\nt = 1'),
    ("say  \"a  b\"  and  'c  d'  or  `e  f`", "say \"a  b\" and 'c  d' or `e  f`"),
    ("don't  stop 'til  done", "don't stop 'til  done"),
    # data: tab lines (TSV cells), CSV-like paragraphs, YAML values, keys and items
    ("a\t\tb  c\nd\t \te", "a\t\tb  c\nd\t \te"),
    ("id,name  x\n1,Ann  Lee \n2,Bo", "id,name  x\n1,Ann  Lee \n2,Bo"),
    ("key:   two  spaces\nlist:\n  - an  item\nblock: |\n  kept  \n\n\n  too",
     "key: two  spaces\nlist:\n  - an  item\nblock: |\n  kept  \n\n\n  too"),
    ("summary: starts\n  continues  here", "summary: starts\n  continues  here"),
    # Markdown: hard breaks (normalized to two spaces), list-marker spacing, raw <pre>
    ("line   \nnext\nlast  \n\nend", "line  \nnext\nlast\n\nend"),
    ("a  \n- b  \n- c  \n2. d  \n# e  \nf", "a\n- b\n- c  \n2. d\n# e\nf"),  # no break before a block
    ("-    item  one\n1.  first", "- item one\n1. first"),  # spacing that sets nothing
    ("-   item  one\n    goes  on\n1.     code  here", "-   item one\n    goes  on\n1.     code  here"),
    ("<pre>\na  b  \n\n\n</pre>\nc  d", "<pre>\na  b  \n\n\n</pre>\nc d"),
])
def test_safe_protects(raw, expected):
    assert canonicalize_text(raw).value == expected


def test_markdown_lists_are_not_yaml_but_lists_under_a_key_are():
    assert canonicalize_text("Steps:\n- do  this\n- then  that").value == "Steps:\n- do  this\n- then  that"
    assert canonicalize_text("Intro.\n\n- do  this\n- then  that").value == "Intro.\n\n- do this\n- then that"
    code_then_list = "def f(x):\n    return x\n\n- a  list"  # a key must sit right above an item
    assert canonicalize_text(code_then_list).value == "def f(x):\n    return x\n\n- a list"


def test_python_blocks_are_not_yaml_keys():
    code = "class  Totals:\n    def f(self, x):\n        if x is  None:\n            return  0"
    assert canonicalize_text(code).value == (
        "class Totals:\n    def f(self, x):\n        if x is None:\n            return 0")
    yaml_doc = "big  box:\n  size  x: 1\n  items:\n  - a  b"
    assert canonicalize_text(yaml_doc).value == "big  box:\n  size  x: 1\n  items:\n  - a  b"


def test_each_protection_is_a_switch():
    raw = "say  \"a  b\"\nk:  v  w\nx\t\ty\n```\nc  d\n```"
    assert canonicalize_text(raw, CanonicalizeConfig(protect_quotes=False)).value.startswith('say "a b"')
    assert "k: v w" in canonicalize_text(raw, CanonicalizeConfig(protect_data=False)).value
    assert canonicalize_text("x\n\n    c  d", CanonicalizeConfig(protect_code=False)).value == "x\n\n    c d"
    assert canonicalize_text("a  \nb", CanonicalizeConfig(protect_markdown=False)).value == "a\nb"


# -- JSON ---------------------------------------------------------------------------------------


def test_json_is_laid_out_token_by_token():
    config = CanonicalizeConfig(json=True)
    laid = '{\n  "a": 1.50,\n  "b": [\n    "x  y",\n    {}\n  ],\n  "c": []\n}'
    compact = '{"a":1.50,"b":["x  y",{}],"c":[]}'
    for raw in (compact, '{\n    "a": 1.50,\n    "b": [ "x  y", { } ],  "c" : [\n]}'):
        assert canonicalize_text(raw, config).value == laid  # a whole message
        fenced = canonicalize_text(f"See:\n\n```json\n{raw}\n```\n", config)
        assert fenced.value == f"See:\n\n```json\n{laid}\n```\n"
        assert fenced.edits == {"json": 1}
        paragraph = canonicalize_text(f"See:\n\n{raw}\n\nok", config)
        assert paragraph.value == f"See:\n\n{laid}\n\nok"


def test_json_that_does_not_parse_is_left_alone():
    config = CanonicalizeConfig(json=True)
    for raw in ('{"a":  1,}', "[1, 2", "{'a': 1}", "```json\n{a  : 1}\n```", "```json\n[1,\n2"):
        result = canonicalize_text(raw, config)
        assert "json" not in result.edits
        assert result.value == canonicalize_text(raw).value  # only the line rules apply
    assert canonicalize_text("```python\n{\"a\":1}\n```", config).value == "```python\n{\"a\":1}\n```"


# -- rule sets and roles ------------------------------------------------------------------------


def test_rule_sets_by_name():
    assert set(RULE_SETS) == {"safe", "prose", "aggressive", "legacy", "off"}
    assert CanonicalizeConfig.named("safe") == CanonicalizeConfig()
    assert CanonicalizeConfig.named("off") == CanonicalizeConfig.off()
    assert CanonicalizeConfig.named("prose", json=True).json
    with pytest.raises(ValueError, match=r"unknown canonicalization rule set 'fast'.*'safe'"):
        CanonicalizeConfig.named("fast")
    with pytest.raises(ValueError, match="tab_size"):
        CanonicalizeConfig(tab_size=0)
    with pytest.raises(ValueError, match=r"roles\['system'\]"):
        CanonicalizeConfig(roles={"system": CanonicalizeConfig(roles={"user": "safe"})})


def test_roles_pick_a_rule_set_per_message():
    config = CanonicalizeConfig(roles={"system": "prose"})
    assert config.roles["system"] == CanonicalizeConfig.named("prose")
    assert config.for_role("user") is config and config.for_role(None) is config
    messages = [
        {"role": "system", "content": "Be\tbrief.\u00a0Cite  sources."},
        {"role": "user", "content": "cols:\ta\t\tb  and\u00a0c"},
    ]
    result = canonicalize_messages(messages, config)
    assert result.value[0]["content"] == "Be brief. Cite sources."
    assert result.value[1]["content"] == messages[1]["content"]  # a tab line under safe
    assert set(result.edits) == {"tabs", "unicode_spaces", "inner_spaces"}
    assert canonicalize_messages(messages, CanonicalizeConfig(enabled=False, roles={"system": "prose"})
                                 ).value == messages


def test_messages_canonicalize_content_only():
    messages = [
        {"role": "system", "content": "You are  terse.  \r\n"},
        {"role": "user", "content": [{"type": "text", "text": "hi  there"},
                                     {"type": "image_url", "image_url": {"url": "x  y"}}]},
        {"role": "assistant", "content": None, "name": "a  b"},
    ]
    result = canonicalize_messages(messages)
    assert result.value[0] == {"role": "system", "content": "You are terse.\n"}
    assert result.value[1]["content"][0]["text"] == "hi there"
    assert result.value[1]["content"][1] == messages[1]["content"][1]
    assert result.value[2] == messages[2]
    assert result.changed and result.chars_removed == 5
    assert messages[0]["content"] == "You are  terse.  \r\n"  # the input is not mutated


def test_type_errors_are_clear():
    with pytest.raises(TypeError, match="prompt must be str"):
        canonicalize_text(b"bytes")  # type: ignore[arg-type]


# -- properties ---------------------------------------------------------------------------------


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(noisy_text, st.sampled_from(NAMED))
def test_named_rule_sets_are_idempotent_and_touch_only_whitespace(text, name):
    config = CanonicalizeConfig.named(name)
    result = canonicalize_text(text, config)
    assert canonicalize_text(result.value, config).value == result.value
    assert visible(result.value) == visible(text)  # in order, so as a multiset and never lowercased
    assert sum(r.chars_removed for r in result.rules.values()) == result.chars_removed


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(noisy_text, configs)
def test_any_config_matches_the_line_by_line_reference(text, config):
    """The fast path (scans that find the lines to change) equals visiting every line."""
    config = dataclasses.replace(config, unicode_nfc=False)
    result = canonicalize_text(text, config)
    if config.enabled:
        assert result.value == _canonical(text, config, _Counts(), every_line=True)
    assert visible(result.value) == visible(text)
    if config.keep_indentation:
        assert canonicalize_text(result.value, config).value == result.value


@settings(max_examples=400)
@given(noisy_text, st.booleans(), st.booleans())
def test_legacy_rule_set_is_the_old_default(text, inner, blank):
    config = CanonicalizeConfig.named("legacy", inner_spaces=inner, blank_lines=blank)
    assert canonicalize_text(text, config).value == old_default(text, inner, blank)


@settings(max_examples=200)
@given(noisy_text)
def test_every_rule_off_is_identity(text):
    off = CanonicalizeConfig(**{s: False for s in SWITCHES if not s.startswith(("protect", "keep"))})
    assert canonicalize_text(text, off).value == text
    assert canonicalize_text(text, CanonicalizeConfig.off()).value == text


@settings(max_examples=200)
@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                       "content": noisy_text}), max_size=4), configs)
def test_messages_idempotent_and_report_changes(messages, config):
    config = dataclasses.replace(config, keep_indentation=True, roles={"system": "prose"})
    once = canonicalize_messages(messages, config)
    twice = canonicalize_messages(once.value, config)
    assert twice.value == once.value and not twice.changed
    assert once.changed == (once.value != messages)


def test_rule_names_are_the_enum():
    assert {r.value for r in Rule} >= {"newlines", "trailing_whitespace", "inner_spaces", "blank_lines",
                                        "tabs", "unicode_spaces", "zero_width", "json", "tab_indent"}
