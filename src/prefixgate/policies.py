"""Admission policies: your rules for which requests may be queued, and a token budget.

An :class:`AdmissionPolicy` is consulted once per request, after the request itself was checked
(and prepared: its tokens are known) and before rate limits, load checks and the queue. It
returns ``None`` to admit the request or a :class:`Refusal`; the gateway raises a refusal as
:class:`~prefixgate.errors.AdmissionRefused` before any engine call. Every request it admits is
reported back exactly once, when the request ends in whatever way, with what it really used
(:class:`Usage`), so a budget charged up front can be settled. :class:`TokenBudget` is the
built-in: a tokens-per-minute budget per tenant.

:class:`AdmissionGate` is the gateway's side: it calls the policy, turns its answers into errors
and keeps the exactly-once promise.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

from .clock import Clock
from .errors import AdmissionPolicyFailed, AdmissionRefused, Outcome
from .tickets import Ticket

__all__ = ["AdmissionGate", "AdmissionPolicy", "Refusal", "TokenBudget", "Usage",
           "is_admission_policy", "make_admission_policy"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refusal:
    """An :class:`AdmissionPolicy`'s "no", raised to the caller as ``AdmissionRefused``.

    Attributes:
        reason: A short machine-readable reason from a small fixed set (``"token_budget"``):
            ``AdmissionRefused.reason``, and counted by it in ``statistics().rejected_reasons``.
        retry_after: Seconds after which the same request is likely to be admitted (>= 0;
            ``math.inf`` for "not with these settings").
        message: What the caller reads; the reason when empty.

    Raises:
        ValueError: If ``reason`` is empty or ``retry_after`` is negative or NaN.
    """

    reason: str
    retry_after: float
    message: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"Refusal.reason must be a non-empty str, got {self.reason!r}")
        if not isinstance(self.retry_after, int | float) or not self.retry_after >= 0:
            raise ValueError(f"Refusal.retry_after must be a number >= 0, got {self.retry_after!r}")


@dataclass(frozen=True, slots=True)
class Usage:
    """What an admitted request used, reported to :meth:`AdmissionPolicy.release` when it ends.

    Attributes:
        outcome: How it ended (``QUEUE_FULL`` and the like when it was refused after the policy
            admitted it; ``CANCELLED`` when its caller gave up).
        dispatched: Whether the engine was given it. ``False``: nothing was computed for it.
        prompt_tokens: Its prompt tokens.
        output_tokens: Tokens the engine generated for it, or ``None`` when the gateway cannot
            tell: it did not complete, its outputs were deltas, or it asked for several
            completions.
    """

    outcome: Outcome
    dispatched: bool
    prompt_tokens: int
    output_tokens: int | None


class AdmissionPolicy(Protocol):
    """Decides, before a request is queued, whether it may be: budgets, quotas, feature gates.

    Pass an instance (or a class, instantiated once per gateway) as
    ``GatewayConfig(admission_policy=...)``. It is consulted by ``generate`` (at the stream's
    first iteration), ``submit`` (at its ``await``) and ``try_generate`` (at the call), once
    the request is prepared and before rate limits, load checks and the queue; nothing of a
    refused request reaches the engine. Both methods run on the event loop: keep them quick and
    never block. Times are the gateway's clock.

    Every request :meth:`check` admits is passed to :meth:`release` exactly once when it ends,
    however it ends: completed, failed, cancelled, refused later (``QueueFull``,
    ``RateLimited``, ``Overloaded``) or timed out in the queue. An exception from :meth:`check`
    refuses that request with ``AdmissionPolicyFailed`` (the exception is its ``__cause__``);
    one from :meth:`release` is logged and dropped. Other requests are not affected either way.
    An instance shared by several gateways shares its state among them (one budget for all).
    """

    def check(self, ticket: Ticket, now: float) -> Refusal | None:
        """Whether ``ticket`` may be queued.

        Args:
            ticket: The request, read-only: its final ``tenant``, ``priority``,
                ``prompt_token_ids``, ``max_tokens``, ``request_id`` and ``arrival``.
            now: The gateway's clock, in seconds.

        Returns:
            ``None`` to admit it, or a :class:`Refusal`.
        """
        ...

    def release(self, ticket: Ticket, usage: Usage, now: float) -> None:
        """``ticket``, which :meth:`check` admitted, has ended; ``usage`` says what it used.

        Args:
            ticket: The same object :meth:`check` was given.
            usage: How it ended and the tokens it used.
            now: The gateway's clock, in seconds.
        """
        ...


def is_admission_policy(value: object) -> bool:
    """Whether ``value`` (an instance or a class) has :class:`AdmissionPolicy`'s methods."""
    return callable(getattr(value, "check", None)) and callable(getattr(value, "release", None))


def make_admission_policy(value: AdmissionPolicy | type) -> AdmissionPolicy:
    """The policy ``GatewayConfig.admission_policy`` gives: an instance, or a class to instantiate.

    Raises:
        ValueError: If it is neither.
    """
    if not is_admission_policy(value):
        raise ValueError(f"admission_policy {value!r} is not an AdmissionPolicy: it needs "
                         "check(ticket, now) and release(ticket, usage, now) methods")
    return value() if isinstance(value, type) else value


class TokenBudget:
    """A tokens-per-minute budget per tenant: the built-in :class:`AdmissionPolicy`.

    Each tenant (``None`` included) has a bucket of up to ``burst`` tokens that refills at
    ``tokens_per_minute``. A request is charged its prompt tokens plus its output limit
    (``max_tokens``, or ``default_output_tokens`` when it sets none) when it is admitted. When it
    ends the charge is settled: all of it is given back if the engine never got the request;
    for one that completed, the charge becomes the tokens it really used (prompt plus
    generated), more or less than charged; otherwise (cancelled or failed mid-stream) the charge
    stands. A request is admitted when its tenant's bucket holds its charge, or is full (a
    request larger than ``burst`` then takes the bucket below zero and the tenant waits for it to
    refill); otherwise it is refused with reason ``"token_budget"`` and a ``retry_after`` of the
    seconds until the bucket holds enough.

    Invariant: a bucket never holds more than ``burst``. Bounds: at most ``max_tenants``
    buckets, beyond which full ones (which a fresh bucket equals) are forgotten.

    Args:
        tokens_per_minute: The rate at which each tenant's bucket refills.
        burst: The most tokens a tenant may spend at once after an idle spell; a minute's
            worth (``tokens_per_minute``) when ``None``.
        default_output_tokens: Output tokens charged for a request without ``max_tokens``.
        max_tenants: Buckets kept before full ones are forgotten.

    Raises:
        ValueError: If a number is not positive (and finite).
    """

    def __init__(self, tokens_per_minute: float, *, burst: float | None = None,
                 default_output_tokens: int = 256, max_tenants: int = 65_536) -> None:
        for name, value in (("tokens_per_minute", tokens_per_minute), ("burst", burst),
                            ("default_output_tokens", default_output_tokens),
                            ("max_tenants", max_tenants)):
            if value is not None and not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"TokenBudget {name} must be a positive finite number, got {value!r}")
        self.tokens_per_minute = float(tokens_per_minute)
        self.burst = float(tokens_per_minute if burst is None else burst)
        self.default_output_tokens = default_output_tokens
        self.max_tenants = max_tenants
        self._per_second = self.tokens_per_minute / 60.0
        self._buckets: dict[str | None, list[float]] = {}  # tenant -> [level, as of when]

    def charge(self, ticket: Ticket) -> int:
        """Tokens ``ticket`` is charged when admitted: prompt plus output limit."""
        output = ticket.max_tokens if ticket.max_tokens is not None else self.default_output_tokens
        return ticket.num_prompt_tokens + output

    def level(self, tenant: str | None, now: float) -> float:
        """Tokens in ``tenant``'s bucket at ``now`` (negative while it pays off a large request)."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return self.burst
        return min(self.burst, bucket[0] + (now - bucket[1]) * self._per_second)

    def _set(self, tenant: str | None, level: float, now: float) -> None:
        buckets = self._buckets
        if tenant not in buckets and len(buckets) >= self.max_tenants:
            self._buckets = buckets = {t: b for t, b in buckets.items() if self.level(t, now) < self.burst}
        buckets[tenant] = [min(self.burst, level), now]

    def check(self, ticket: Ticket, now: float) -> Refusal | None:
        cost = self.charge(ticket)
        level = self.level(ticket.tenant, now)
        if level >= cost or level >= self.burst:
            self._set(ticket.tenant, level - cost, now)
            return None
        short = min(cost, self.burst) - level
        return Refusal("token_budget", short / self._per_second,
                       f"tenant {ticket.tenant!r} is over its token budget "
                       f"({self.tokens_per_minute:g} tokens/min): the request needs {cost}, "
                       f"{max(0.0, level):.0f} are left")

    def release(self, ticket: Ticket, usage: Usage, now: float) -> None:
        charged = self.charge(ticket)
        if not usage.dispatched:
            used = 0
        elif usage.output_tokens is not None:
            used = usage.prompt_tokens + usage.output_tokens
        else:
            return  # the charge stands
        if used != charged:
            self._set(ticket.tenant, self.level(ticket.tenant, now) + charged - used, now)

    def __repr__(self) -> str:
        return (f"TokenBudget({self.tokens_per_minute:g}/min, burst={self.burst:g}, "
                f"tenants={len(self._buckets)})")


class AdmissionGate:
    """Runs a gateway's :class:`AdmissionPolicy`: raises its refusals as ``AdmissionRefused``
    and its failures as ``AdmissionPolicyFailed``, and releases each admitted ticket once.

    A request placed again on another replica (its replica died before answering it, or it
    moved where its prefix is stored) is still the same request: its ticket's admission is
    *held* when the old ticket ends (:meth:`hold`) and *handed over* to the new ticket
    (:meth:`hand_over`), so the policy is consulted once and told once, whichever replica
    serves it; :meth:`release` settles a held ticket that is not placed again.

    Invariant: ``admitted`` holds exactly the tickets the policy admitted that have not been
    released (bounded by the gateway's live requests); ``held`` is a subset of it, of tickets
    that ended and wait to be handed over or released.

    Args:
        policy: The policy.
        clock: The gateway's clock.
    """

    def __init__(self, policy: AdmissionPolicy, clock: Clock) -> None:
        self.policy = policy
        self.clock = clock
        self.admitted: set[Ticket] = set()
        self.held: set[Ticket] = set()

    def check(self, ticket: Ticket) -> None:
        """Admits ``ticket`` or raises.

        Raises:
            AdmissionRefused: The policy refused it.
            AdmissionPolicyFailed: The policy raised, or answered neither ``None`` nor a
                :class:`Refusal`.
        """
        name = type(self.policy).__name__
        try:
            refusal: Any = self.policy.check(ticket, self.clock.now())
        except Exception as e:
            raise AdmissionPolicyFailed(f"admission policy {name}.check raised on "
                                        f"{ticket.request_id}: {e!r}") from e
        if refusal is None:
            self.admitted.add(ticket)
            return
        if not isinstance(refusal, Refusal):
            raise AdmissionPolicyFailed(f"admission policy {name}.check returned {refusal!r} for "
                                        f"{ticket.request_id}; it must return None or a Refusal")
        raise AdmissionRefused(refusal.message or f"refused by {name}: {refusal.reason}",
                               retry_after=refusal.retry_after, reason=refusal.reason)

    def hold(self, ticket: Ticket) -> None:
        """Keeps ``ticket``'s admission past its end, until :meth:`hand_over` or
        :meth:`release`: it ended to be placed again."""
        if ticket in self.admitted:
            self.held.add(ticket)

    def hand_over(self, old: Ticket, new: Ticket) -> None:
        """Moves ``old``'s admission, if it has one, to ``new`` (the same request placed
        again), telling the policy nothing: ``new`` then needs no :meth:`check`."""
        if old in self.admitted:
            self.admitted.discard(old)
            self.held.discard(old)
            self.admitted.add(new)

    def release(self, ticket: Ticket) -> None:
        """Reports ``ticket``'s usage to the policy if it admitted it and was not told yet."""
        if ticket not in self.admitted:
            return
        self.admitted.discard(ticket)
        self.held.discard(ticket)
        output = (len(ticket.output_token_ids) if ticket.outcome is Outcome.COMPLETED
                  and ticket.output_token_ids else None)
        outcome = ticket.outcome or getattr(ticket.failure, "outcome", None) or Outcome.CANCELLED
        usage = Usage(outcome=outcome,
                      dispatched=ticket.dispatched_at is not None,
                      prompt_tokens=ticket.num_prompt_tokens, output_tokens=output)
        try:
            self.policy.release(ticket, usage, self.clock.now())
        except Exception:
            log.exception("prefixgate: admission policy %s.release raised on %s; ignored",
                          type(self.policy).__name__, ticket.request_id)

    def __repr__(self) -> str:
        return f"AdmissionGate({self.policy!r}, admitted={len(self.admitted)}, held={len(self.held)})"
