"""Canonicalization: exact rule behaviour, and Hypothesis properties over arbitrary text."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate import CanonicalizeConfig, canonicalize_messages, canonicalize_text

RULES = ("newlines", "trailing_whitespace", "inner_spaces", "blank_lines", "unicode_nfc")

# Text rich in the characters the rules care about, plus arbitrary Unicode.
noisy_text = st.lists(
    st.one_of(st.sampled_from([" ", "  ", "\t", "\n", "\r", "\r\n", "a", "b", "é", "e\u0301",
                               "\u00a0", "\f"]), st.characters()),
    max_size=120,
).map("".join)
configs = st.builds(CanonicalizeConfig, **{r: st.booleans() for r in RULES},
                    keep_indentation=st.booleans(), enabled=st.booleans())


def non_ws(s: str) -> list[str]:
    return [c for c in s if not c.isspace()]


@pytest.mark.parametrize(("raw", "expected", "rule"), [
    ("a\r\nb\rc", "a\nb\nc", "newlines"),
    ("line one  \t\nline two \n", "line one\nline two\n", "trailing_whitespace"),
    ("x  =\t1;  y =   2", "x = 1; y = 2", "inner_spaces"),
    ("para\n\n\n\n  \nnext", "para\n\nnext", "blank_lines"),
])
def test_each_rule_does_exactly_its_job(raw, expected, rule):
    result = canonicalize_text(raw)
    assert result.value == expected
    assert result.changed
    assert rule in result.edits
    assert result.chars_removed == len(raw) - len(expected)


def test_indentation_is_kept_by_default_and_collapsed_on_request():
    code = "def f():\n        return  1\n\tpass"
    assert canonicalize_text(code).value == "def f():\n        return 1\n\tpass"
    flat = canonicalize_text(code, CanonicalizeConfig(keep_indentation=False)).value
    assert flat == "def f():\n return 1\n pass"


def test_clean_text_is_reported_unchanged():
    result = canonicalize_text("You are a helpful assistant.\n\nAnswer briefly.")
    assert not result.changed and result.chars_removed == 0 and result.edits == {}


def test_never_lowercases_or_touches_other_characters():
    raw = "ÉCOLE  Straße\u00a0NBSP  ΣΊΣΥΦΟΣ"
    assert canonicalize_text(raw).value == "ÉCOLE Straße\u00a0NBSP ΣΊΣΥΦΟΣ"


def test_nfc_is_off_by_default_and_composes_when_on():
    raw = "cafe\u0301"
    assert canonicalize_text(raw).value == raw
    on = canonicalize_text(raw, CanonicalizeConfig(unicode_nfc=True))
    assert on.value == "café" and on.edits == {"unicode_nfc": 1}


def test_crlf_is_one_newline_not_two():
    assert canonicalize_text("a\r\n\r\nb").value == "a\n\nb"
    kept = canonicalize_text("a\r\n\r\n\r\n\r\nb", CanonicalizeConfig(newlines=False)).value
    assert kept == "a\r\n\r\nb"


def test_messages_canonicalize_content_only():
    messages = [
        {"role": "system", "content": "You are  terse.  \r\n"},
        {"role": "user", "content": [{"type": "text", "text": "hi\t there"},
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


@settings(max_examples=400)
@given(noisy_text, configs)
def test_idempotent(text, config):
    once = canonicalize_text(text, config).value
    assert canonicalize_text(once, config).value == once


@settings(max_examples=400)
@given(noisy_text, configs)
def test_non_whitespace_sequence_is_unchanged(text, config):
    config = dataclasses.replace(config, unicode_nfc=False)
    assert non_ws(canonicalize_text(text, config).value) == non_ws(text)


@settings(max_examples=200)
@given(noisy_text)
def test_every_rule_off_is_identity(text):
    off = CanonicalizeConfig(**{r: False for r in RULES})
    assert canonicalize_text(text, off).value == text
    assert canonicalize_text(text, CanonicalizeConfig.off()).value == text


@settings(max_examples=200)
@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                       "content": noisy_text}), max_size=4), configs)
def test_messages_idempotent_and_report_changes(messages, config):
    once = canonicalize_messages(messages, config)
    twice = canonicalize_messages(once.value, config)
    assert twice.value == once.value and not twice.changed
    assert once.changed == (once.value != messages)
