"""Errors that tell the caller what to do, and the outcome of every request.

Three families, by what the caller should do next:

* :class:`Rejected`: the request was never queued. Fix it (``InvalidRequest``,
  ``PromptTooLong``) or retry later (``QueueFull``, ``Overloaded``, ``RateLimited``,
  ``AdmissionRefused`` carry ``retry_after``); ``AdmissionPolicyFailed`` is a bug in the
  configured admission policy.
* :class:`Evicted`: the request was queued but left before the engine saw it
  (``QueueTimeout``, ``ShuttingDown``). Retrying is safe: no tokens were produced.
* :class:`EngineError`: the engine failed while serving it; ``__cause__`` holds the engine's
  own exception. ``EngineDead`` means every later request will fail too.

Every accepted request ends in exactly one :class:`Outcome`, which feeds the statistics.
"""

from __future__ import annotations

import contextlib
import enum


class Outcome(enum.Enum):
    """How a request ended. Counted in :class:`~prefixgate.GatewayStatistics`."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    INVALID = "invalid"
    TOO_LONG = "too_long"
    TOO_LARGE = "too_large"
    QUEUE_FULL = "queue_full"
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"
    ADMISSION_REFUSED = "admission_refused"
    POLICY_FAILED = "policy_failed"
    QUEUE_TIMEOUT = "queue_timeout"
    SHUTTING_DOWN = "shutting_down"
    ENGINE_ERROR = "engine_error"


class Reason(enum.StrEnum):
    """Why a request was refused for load, or why dispatch stopped: a
    :class:`RetryableRejection`'s ``reason``, ``GatewayStatistics.blocked`` and the keys of
    ``GatewayStatistics.rejected_reasons``. Members are strings, so ``reason == "kv_reserved"``
    and JSON keep working."""

    KV_RESERVED = "kv_reserved"
    """The KV blocks reserved by requests in flight leave no room for it (less the watermark)."""
    KV_FREE_LOW = "kv_free_low"
    """The engine's latest stats show too few free KV blocks."""
    KV_STATS_STALE = "kv_stats_stale"
    """The engine has had work but reported no step for ``stats_max_age``: treated as full."""
    MAX_IN_FLIGHT = "max_in_flight"
    """``max_in_flight`` requests are in the engine already."""
    PREFILL_BACKLOG = "prefill_backlog"
    """Requests handed to the engine and not yet started hold ``max_prefill_backlog`` prompt
    tokens it must still compute."""
    TENANT_SHARE = "tenant_share"
    """Every waiting tenant is at its ``max_in_flight_share`` while others have work in flight."""
    QUEUED_AHEAD = "queued_ahead"
    """``try_generate``: requests are already waiting; it would not go first."""
    ENGINE_BUSY = "engine_busy"
    """The engine's own admission limit refused it (vLLM's ``max_num_queued_reqs``)."""
    RATE_LIMITED = "rate_limited"
    """The tenant's request rate is used up."""
    QUEUE_FULL = "queue_full"
    """``max_queue_len`` requests are waiting."""
    PREDICTED_WAIT = "predicted_wait"
    """Its predicted queue wait exceeds ``max_queue_wait``."""


class PrefixgateError(Exception):
    """Base class of every error prefixgate raises."""

    outcome: Outcome = Outcome.ENGINE_ERROR


class Rejected(PrefixgateError):
    """The request was refused before it was queued; nothing of it reached the engine."""


class InvalidRequest(Rejected, ValueError):
    """Raised when the prompt or its parameters are malformed: empty prompt, non-UTF-8 text,
    bad sampling parameters, unknown tenant, duplicate request id. Do not retry unchanged."""

    outcome = Outcome.INVALID


class PromptTooLong(InvalidRequest):
    """Raised when prompt tokens plus requested output exceed the model's context length.

    Attributes:
        num_tokens: Prompt tokens after canonicalization and tokenization, or ``None`` when the
            prompt was refused on its character count before tokenizing it.
        limit: The most prompt tokens accepted.
    """

    outcome = Outcome.TOO_LONG

    def __init__(self, message: str, *, num_tokens: int | None, limit: int) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.limit = limit


class RequestTooLarge(InvalidRequest):
    """Raised when a request's KV blocks (its prompt plus its output limit, capped at the model's
    context) can never fit the gateway's KV budget, even on an idle engine.

    Attributes:
        blocks: The blocks it needs alone.
        limit: The most blocks the gateway can reserve (``num_blocks × kv_budget``).
    """

    outcome = Outcome.TOO_LARGE

    def __init__(self, message: str, *, blocks: int, limit: int) -> None:
        super().__init__(message)
        self.blocks = blocks
        self.limit = limit


class RetryableRejection(Rejected):
    """A refusal caused by load, not by the request. Retry after ``retry_after`` seconds.

    Attributes:
        retry_after: Seconds after which a retry is likely to be accepted (an estimate from
            the recent drain rate), never negative.
        reason: Why, counted in statistics: a :class:`Reason` (a string a custom engine passes
            is turned into its member when it names one, else kept as it is).
    """

    def __init__(self, message: str, *, retry_after: float, reason: Reason | str) -> None:
        super().__init__(message)
        self.retry_after = max(0.0, retry_after)
        if not isinstance(reason, Reason):
            with contextlib.suppress(ValueError):
                reason = Reason(reason)
        self.reason: Reason | str = reason


class QueueFull(RetryableRejection):
    """Raised when the gateway's bounded waiting queue is at its configured length."""

    outcome = Outcome.QUEUE_FULL


class Overloaded(RetryableRejection):
    """Raised when admitting the request would push the engine's free KV blocks below the
    watermark (or the engine's KV state is unknown or stale)."""

    outcome = Outcome.OVERLOADED


class RateLimited(RetryableRejection):
    """Raised by the non-blocking submit path when the tenant's request rate is exhausted."""

    outcome = Outcome.RATE_LIMITED


class AdmissionRefused(RetryableRejection):
    """Raised when the configured ``AdmissionPolicy`` refused the request (a tenant's token
    budget is spent, say): ``reason`` is the policy's own, ``retry_after`` its estimate."""

    outcome = Outcome.ADMISSION_REFUSED


class AdmissionPolicyFailed(Rejected):
    """Raised when the configured ``AdmissionPolicy`` failed on the request: its ``check``
    raised (that exception is ``__cause__``) or answered something other than ``None`` or a
    ``Refusal``. The request was not queued; other requests are unaffected. Fix the policy."""

    outcome = Outcome.POLICY_FAILED


class Evicted(PrefixgateError):
    """The request was queued but removed before the engine started it. Safe to retry."""


class QueueTimeout(Evicted):
    """Raised when a queued request waited longer than ``queue_timeout`` to be dispatched."""

    outcome = Outcome.QUEUE_TIMEOUT


class ShuttingDown(Evicted):
    """Raised for requests still queued (or submitted) while the gateway closes."""

    outcome = Outcome.SHUTTING_DOWN


class EngineError(PrefixgateError):
    """Raised when the engine failed while serving the request; ``__cause__`` is the engine's
    own exception. Output already streamed stays valid; the request will produce no more."""

    outcome = Outcome.ENGINE_ERROR


class EngineDead(EngineError):
    """Raised when the engine process has died. Every later request fails the same way until
    a new engine is started."""


class EngineStalled(EngineError):
    """Raised for requests in flight when the engine made no progress (no output and no
    scheduler step) for ``GatewayConfig.stall_timeout`` seconds; they are aborted."""


class UsageError(PrefixgateError, RuntimeError):
    """Raised when the API is misused: a stream iterated by two tasks at once, or a gateway used
    from an event loop or thread other than the one it runs on. Not a request outcome."""
