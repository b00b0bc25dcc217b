"""The switches and the value types of canonicalization.

:class:`Rule` names the rules, :class:`CanonicalizeConfig` switches them (:data:`RULE_SETS` holds
the named sets), and :class:`RuleCount` and :class:`Canonicalized` say what a call changed. What
each rule and protection does is described in the package docstring (``prefixgate.canonicalize``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Rule(enum.StrEnum):
    """The rules, by the name under which :class:`Canonicalized` reports them."""

    NEWLINES = "newlines"
    ZERO_WIDTH = "zero_width"
    UNICODE_SPACES = "unicode_spaces"
    JSON = "json"
    TAB_INDENT = "tab_indent"
    TRAILING_WHITESPACE = "trailing_whitespace"
    INNER_SPACES = "inner_spaces"
    TABS = "tabs"
    BLANK_LINES = "blank_lines"
    UNICODE_NFC = "unicode_nfc"


ZERO_WIDTH_CHARS = "\u200b\u2060\ufeff"
"""Removed by ``zero_width``: zero-width space, word joiner, BOM (zero-width no-break space)."""
UNICODE_SPACE_CHARS = "\u00a0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u202f\u205f\u3000"
"""Turned into a space by ``unicode_spaces``: Unicode's space separators (Zs) other than U+0020."""


@dataclass(frozen=True, slots=True)
class CanonicalizeConfig:
    """Which rules apply and what they leave alone. ``CanonicalizeConfig()`` is the ``safe`` set.

    Invariant: with the default protections on, the output parses like the input in every format
    of the meaning corpus (see the module docstring); rules and protections are independent
    switches, so any other combination is the caller's choice.

    Attributes:
        enabled: Master switch; ``False`` makes canonicalization the identity (roles included).
        newlines: CRLF/CR to LF.
        trailing_whitespace: Strip spaces (with ``tabs`` also tabs) at line ends.
        inner_spaces: Collapse runs of two or more spaces inside a line to one.
        keep_indentation: ``False`` also collapses indentation (flattens Python and YAML).
        blank_lines: Collapse runs of blank lines to one.
        tabs: Tabs inside and at the end of lines count as spaces (merges TSV columns).
        unicode_spaces: Unicode space separators to an ASCII space.
        zero_width: Remove U+200B, U+2060, U+FEFF.
        json: Re-lay out JSON blocks (fenced ``json``, whole message, ``{``/``[`` paragraphs).
        tab_indent: Tabs in indentation to spaces, up to the next multiple of ``tab_size``.
        tab_size: Tab stop width for ``tab_indent`` and for measuring indentation.
        unicode_nfc: Unicode NFC (changes non-whitespace characters; in no rule set).
        protect_code: Leave code blocks (fenced, indented), triple-quoted strings, YAML block
            scalars and raw HTML ``<pre>``-like blocks alone (details: module docstring).
        protect_quotes: Leave text inside ``"…"``, ``'…'`` and backtick spans alone.
        protect_data: Leave lines holding a tab, CSV-like paragraphs, YAML keys, values, items,
            continuation lines and flow-collection scalars alone.
        protect_markdown: Keep hard breaks, list-marker spacing that later lines depend on, and
            indented code inside lists.
        roles: Per chat role, the config for that role's messages (names of :data:`RULE_SETS`
            are accepted); other roles use this config.
    """

    enabled: bool = True
    newlines: bool = True
    trailing_whitespace: bool = True
    inner_spaces: bool = True
    keep_indentation: bool = True
    blank_lines: bool = True
    tabs: bool = False
    unicode_spaces: bool = False
    zero_width: bool = False
    json: bool = False
    tab_indent: bool = False
    tab_size: int = 4
    unicode_nfc: bool = False
    protect_code: bool = True
    protect_quotes: bool = True
    protect_data: bool = True
    protect_markdown: bool = True
    roles: Mapping[str, CanonicalizeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tab_size, int) or not 1 <= self.tab_size <= 16:
            raise ValueError(f"CanonicalizeConfig.tab_size must be an int in [1, 16], got {self.tab_size!r}")
        if not isinstance(self.roles, Mapping):
            raise ValueError("CanonicalizeConfig.roles must map role names to configs or rule-set names")
        roles: dict[str, CanonicalizeConfig] = {}
        for role, value in self.roles.items():
            config = CanonicalizeConfig.named(value) if isinstance(value, str) else value
            if not isinstance(role, str) or not isinstance(config, CanonicalizeConfig) or config.roles:
                raise ValueError(f"CanonicalizeConfig.roles[{role!r}] must be a rule-set name or a "
                                 f"CanonicalizeConfig without roles of its own, got {value!r}")
            roles[role] = config
        object.__setattr__(self, "roles", MappingProxyType(roles))

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Picklable (ingress worker processes get it): the read-only roles mapping is not.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["roles"] = dict(self.roles)
        return _config_from_fields, (fields,)

    @classmethod
    def off(cls) -> CanonicalizeConfig:
        """A config that changes nothing."""
        return cls(enabled=False)

    @classmethod
    def named(cls, name: str, **changes: Any) -> CanonicalizeConfig:
        """A rule set of :data:`RULE_SETS` by name, with some fields changed.

        Raises:
            ValueError: For an unknown name (the message lists the known ones).
        """
        try:
            base = RULE_SETS[name]
        except KeyError:
            raise ValueError(f"unknown canonicalization rule set {name!r}; "
                             f"one of {sorted(RULE_SETS)}") from None
        return dataclasses.replace(base, **changes) if changes else base

    def for_role(self, role: object) -> CanonicalizeConfig:
        """The config that applies to a message of ``role``."""
        if not self.enabled:
            return self
        return self.roles.get(role, self) if isinstance(role, str) else self


_SAFE = CanonicalizeConfig()
_PROSE = dataclasses.replace(_SAFE, tabs=True, unicode_spaces=True, zero_width=True, protect_quotes=False,
                             protect_data=False, protect_markdown=False)
def _config_from_fields(fields: dict[str, Any]) -> CanonicalizeConfig:
    return CanonicalizeConfig(**fields)


RULE_SETS: Mapping[str, CanonicalizeConfig] = MappingProxyType({
    "safe": _SAFE,
    "prose": _PROSE,
    "aggressive": dataclasses.replace(_PROSE, json=True, tab_indent=True, protect_code=False),
    "legacy": dataclasses.replace(_SAFE, tabs=True, protect_code=False, protect_quotes=False,
                                  protect_data=False, protect_markdown=False),
    "off": CanonicalizeConfig(enabled=False),
})
"""Rule sets by name (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class RuleCount:
    """What one rule changed.

    Attributes:
        edits: Substitutions it made (a run, a line end, a character, a JSON block).
        chars_changed: Input characters it replaced or removed.
        chars_removed: Characters it removed net (negative when it added, as JSON layout may).
    """

    edits: int
    chars_changed: int
    chars_removed: int


@dataclass(frozen=True, slots=True)
class Canonicalized:
    """The result of canonicalizing a prompt or a list of chat messages.

    Attributes:
        value: The canonical text (``str``) or messages (a list of new message dicts).
        changed: Whether anything differs from the input.
        chars_removed: Input length minus output length, in characters (summed over messages).
        edits: How many substitutions each rule made, for rules that made any.
        rules: Per rule that changed anything, its :class:`RuleCount`; their ``chars_removed``
            sum to ``chars_removed``.
    """

    value: Any
    changed: bool
    chars_removed: int
    edits: Mapping[str, int] = field(default_factory=dict)
    rules: Mapping[str, RuleCount] = field(default_factory=dict)
