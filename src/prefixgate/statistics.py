"""Counters kept by the gateway, and the frozen snapshot that :meth:`Gateway.statistics` returns."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .engine import KvStats
from .errors import Outcome, Reason
from .tickets import Ticket

__all__ = ["GatewayStatistics", "ReplicaStatistics", "RuleStats", "StatsRecorder"]


@dataclass(frozen=True, slots=True)
class ReplicaStatistics:
    """One replica of a gateway over several engines.

    Attributes:
        name: Its name (placement hashes it).
        alive: Whether it takes requests.
        placed: Requests placed on it so far.
        queued: Requests waiting in its queue now.
        running: Requests its engine is serving now.
        reserved_blocks: KV blocks reserved by its running requests now.
        kv: Its engine's latest KV state, or ``None``.
    """

    name: str
    alive: bool
    placed: int
    queued: int
    running: int
    reserved_blocks: int
    kv: KvStats | None


@dataclass(frozen=True, slots=True)
class RuleStats:
    """What one canonicalization rule changed over the accepted requests.

    Attributes:
        requests: Requests it changed.
        edits: Substitutions it made.
        chars_changed: Input characters it replaced or removed.
        chars_removed: Characters it removed net (negative where it added).
    """

    requests: int = 0
    edits: int = 0
    chars_changed: int = 0
    chars_removed: int = 0


@dataclass(frozen=True, slots=True)
class GatewayStatistics:
    """A point-in-time snapshot of a gateway. Counters are cumulative since it started.

    Attributes:
        requests: Requests accepted at ingress and queued.
        refused: Requests refused at ingress (never queued), by outcome name
            (``admission_refused`` and ``policy_failed`` for the admission policy's).
        outcomes: Accepted requests that ended, by outcome name (``completed``, ``cancelled``…).
        canonicalized: Accepted requests whose prompt canonicalization changed.
        chars_removed: Characters removed by canonicalization, summed.
        canonicalize_rules: Per canonicalization rule (by name), what it changed (at most one
            entry per rule: a bounded set).
        queued: Requests waiting for dispatch now.
        running: Requests the engine is serving now.
        prompt_tokens: Prompt tokens of completed requests.
        predicted_hit_tokens: Cache-hit tokens the gateway predicted for completed requests.
        engine_cached_tokens: Cache-hit tokens the engine reported for completed requests.
        kv: The engine's latest KV state, or ``None``.
        rejected_reasons: Refusals with a reason (``Overloaded``/``QueueFull``/``RateLimited``,
            and ``AdmissionRefused`` by its policy's reason), by reason.
        reserved_blocks: KV blocks reserved by running requests now.
        median_wait: Median queue wait of recently dispatched requests (seconds), or ``None``.
        aged_dispatches: Dispatches forced by the aging bound.
        replicas: Per replica, when the gateway has several engines (else empty); the fields above
            then sum over them (``kv`` is ``None``, ``median_wait`` the median of theirs, ``blocked``
            the first replica's that is blocked).
        replaced: Requests placed again on another replica because theirs died before their
            first output (each is counted once in ``requests`` and ``outcomes``).
        moved: Requests placed again while they waited, because another replica's engine
            reported their prefix stored (``GatewayConfig.move_to_stored``; counted once too).
        blocked: Why the scheduler last stopped dispatching (a :class:`~prefixgate.errors.Reason`),
            or ``None``.
    """

    requests: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)
    outcomes: Mapping[str, int] = field(default_factory=dict)
    canonicalized: int = 0
    chars_removed: int = 0
    canonicalize_rules: Mapping[str, RuleStats] = field(default_factory=dict)
    queued: int = 0
    running: int = 0
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    engine_cached_tokens: int = 0
    kv: KvStats | None = None
    rejected_reasons: Mapping[str, int] = field(default_factory=dict)
    reserved_blocks: int = 0
    median_wait: float | None = None
    aged_dispatches: int = 0
    blocked: Reason | None = None
    replicas: tuple[ReplicaStatistics, ...] = ()
    replaced: int = 0
    moved: int = 0

    @property
    def hit_rate(self) -> float:
        """Engine-reported cached tokens over prompt tokens, for completed requests."""
        return self.engine_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def completed(self) -> int:
        """Requests that completed."""
        return self.outcomes.get(Outcome.COMPLETED.value, 0)


class StatsRecorder:
    """The mutable counters behind :class:`GatewayStatistics`. Updated only by the gateway."""

    def __init__(self) -> None:
        self.requests = 0
        self.refused: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.canonicalized = 0
        self.chars_removed = 0
        self.rules: dict[str, list[int]] = {}  # rule -> [requests, edits, chars changed, removed]
        self.prompt_tokens = 0
        self.predicted_hit_tokens = 0
        self.engine_cached_tokens = 0
        self.replaced = 0
        self.moved = 0

    def refuse(self, outcome: Outcome, reason: Reason | str | None = None) -> None:
        self.refused[outcome.value] += 1
        if reason is not None:
            self.reasons[str(reason)] += 1  # keys are plain strings

    def accept(self, ticket: Ticket) -> None:
        self.requests += 1
        if ticket.canonicalized:
            self.canonicalized += 1
            self.chars_removed += ticket.chars_removed
            for name, count in ticket.canonical_rules.items():
                row = self.rules.get(name)
                if row is None:
                    row = self.rules[name] = [0, 0, 0, 0]
                row[0] += 1
                row[1] += count.edits
                row[2] += count.chars_changed
                row[3] += count.chars_removed

    def replace(self, ticket: Ticket, moved: bool = False) -> None:
        """Un-counts ``ticket``, accepted and ended (its replica died before dispatching it, or
        ``moved`` while it waited), as the request goes on as another ticket, which will be
        counted."""
        if moved:
            self.moved += 1
        else:
            self.replaced += 1
        self.requests -= 1
        if ticket.outcome is not None:
            self.outcomes[ticket.outcome.value] -= 1
            if not self.outcomes[ticket.outcome.value]:
                del self.outcomes[ticket.outcome.value]
        if ticket.canonicalized:
            self.canonicalized -= 1
            self.chars_removed -= ticket.chars_removed
            for name, count in ticket.canonical_rules.items():
                row = self.rules[name]
                row[0] -= 1
                row[1] -= count.edits
                row[2] -= count.chars_changed
                row[3] -= count.chars_removed

    def end(self, ticket: Ticket) -> None:
        assert ticket.outcome is not None
        self.outcomes[ticket.outcome.value] += 1
        if ticket.outcome is Outcome.COMPLETED and ticket.cached_tokens is not None:
            self.prompt_tokens += ticket.num_prompt_tokens
            self.predicted_hit_tokens += ticket.predicted_hit_tokens or 0
            self.engine_cached_tokens += ticket.cached_tokens

    def snapshot(self, *, queued: int, running: int, kv: KvStats | None, reserved_blocks: int,
                 median_wait: float | None, aged_dispatches: int,
                 blocked: Reason | None, replicas: tuple[ReplicaStatistics, ...] = ()) -> GatewayStatistics:
        return GatewayStatistics(
            requests=self.requests, refused=MappingProxyType(dict(self.refused)),
            outcomes=MappingProxyType(dict(self.outcomes)), canonicalized=self.canonicalized,
            chars_removed=self.chars_removed,
            canonicalize_rules=MappingProxyType({k: RuleStats(*v) for k, v in self.rules.items()}),
            queued=queued, running=running,
            prompt_tokens=self.prompt_tokens, predicted_hit_tokens=self.predicted_hit_tokens,
            engine_cached_tokens=self.engine_cached_tokens, kv=kv,
            rejected_reasons=MappingProxyType(dict(self.reasons)), reserved_blocks=reserved_blocks,
            median_wait=median_wait, aged_dispatches=aged_dispatches, blocked=blocked,
            replicas=replicas, replaced=self.replaced, moved=self.moved,
        )

    def __repr__(self) -> str:
        return (f"StatsRecorder(requests={self.requests}, ended={sum(self.outcomes.values())}, "
                f"refused={sum(self.refused.values())})")
