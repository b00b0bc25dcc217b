"""Reference text generated from the code: the configuration (from :class:`GatewayConfig`'s
fields and docstring) and the metrics (from :data:`~prefixgate.serve.metrics.METRICS`).

``docs/serve.md`` holds each between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers;
a test checks the committed text equals what these functions write, and
``python -m prefixgate.serve.reference docs/serve.md`` rewrites it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from ..config import GatewayConfig
from .cli import config_fields
from .metrics import METRICS

__all__ = ["config_reference", "field_docs", "metrics_reference", "update"]

_ROLE = re.compile(r":(?:class|mod|meth|func|data|attr):`~?([^`]+)`")


def _markdown(text: str) -> str:
    """reStructuredText's inline code and cross references as Markdown code."""
    text = _ROLE.sub(lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)
    return text.replace("``", "`")


_FIELD = re.compile(r"^ {8}(\w+): (.*)$")
_SECTION = re.compile(r"^ {4}(\S[^:]*):$")


def field_docs() -> dict[str, tuple[str, str]]:
    """Each documented :class:`GatewayConfig` field: ``(section, description)``, from its
    docstring's ``Section:`` blocks of ``name: text`` entries."""
    out: dict[str, tuple[str, str]] = {}
    section, name, text = "", None, []
    for line in (GatewayConfig.__doc__ or "").splitlines():
        m_section, m_field = _SECTION.match(line), _FIELD.match(line)
        if (m_section or m_field or not line.strip()) and name is not None:
            out[name] = (section, " ".join(text))
            name = None
        if m_section:
            section = m_section.group(1).split(" (")[0]
        elif m_field:
            name, text = m_field.group(1), [m_field.group(2).strip()]
        elif name is not None and line.startswith(" " * 12):
            text.append(line.strip())
    if name is not None:
        out[name] = (section, " ".join(text))
    return out


def _default(f: dataclasses.Field[object]) -> str:
    if f.default is not dataclasses.MISSING:
        value: object = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:  # pragma: no cover - every field has a default
        return ""
    text = repr(value)
    if "CanonicalizeConfig(" in text:
        return "`'safe'` rule set"
    return f"`{text}`"


def config_reference() -> str:
    """The Markdown table of every :class:`GatewayConfig` field: section, name, the flag and
    environment variable of ``prefixgate serve`` (where the field takes text), default, meaning."""
    docs = field_docs()
    settable = {name for name, _, _ in config_fields()}
    rows = ["| section | field | `prefixgate serve` flag / environment | default | meaning |",
            "|---|---|---|---|---|"]
    for f in dataclasses.fields(GatewayConfig):
        section, text = docs.get(f.name, ("", ""))
        where = (f"`--{f.name.replace('_', '-')}` / `PREFIXGATE_{f.name.upper()}`" if f.name in settable
                 else "Python only")
        text = _markdown(text).replace("|", "\\|")
        rows.append(f"| {section} | `{f.name}` | {where} | {_default(f)} | {text} |")
    return "\n".join(rows)


def metrics_reference() -> str:
    """The Markdown table of every ``prefixgate_*`` metric ``/metrics`` exposes."""
    rows = ["| metric | labels | meaning |", "|---|---|---|"]
    labels = {"requests_total": "outcome", "refused_total": "outcome", "http_refused_total": "outcome",
              "refusals_by_reason_total": "reason", "client_disconnects_total": "phase",
              "canonicalized_requests_total": "rule", "canonicalized_chars_total": "rule",
              "time_to_first_token_seconds": "endpoint", "tenant_in_flight": "tenant",
              "replica_in_flight": "replica", "replica_queued": "replica", "replica_alive": "replica",
              "placements_total": "replica", "kv_usage": "replica"}
    for name, help_text in METRICS.items():
        label = labels.get(name.removeprefix("prefixgate_"), "")
        rows.append(f"| `{name}` | {label and f'`{label}`'} | {help_text} |")
    return "\n".join(rows)


def update(text: str) -> str:
    """``text`` with every generated section rewritten."""
    sections = (("config-reference", config_reference()), ("metrics-reference", metrics_reference()))
    for marker, body in sections:
        pattern = re.compile(rf"(<!-- {marker}:start -->\n)(?:.*?\n)?(<!-- {marker}:end -->)", re.S)
        text = pattern.sub(lambda m: f"{m.group(1)}{body}\n{m.group(2)}", text)  # noqa: B023  (used at once)
    return text


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/serve.md")
    path.write_text(update(path.read_text()))
