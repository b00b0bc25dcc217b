"""``docs/serve.md``'s generated sections are current, and cover every field and metric."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefixgate import GatewayConfig
from prefixgate.serve import METRICS
from prefixgate.serve.reference import config_reference, field_docs, metrics_reference, update

DOC = Path(__file__).resolve().parent.parent / "docs" / "serve.md"


def test_the_committed_reference_is_what_the_code_generates():
    text = DOC.read_text()
    assert update(text) == text, "run: python -m prefixgate.serve.reference docs/serve.md"
    assert config_reference() in text and metrics_reference() in text


def test_every_config_field_is_documented_and_every_metric_listed():
    docs = field_docs()
    assert {f.name for f in dataclasses.fields(GatewayConfig)} == set(docs)
    assert all(len(text) > 15 for _, text in docs.values())
    reference = metrics_reference()
    assert all(f"`{name}`" in reference for name in METRICS)
