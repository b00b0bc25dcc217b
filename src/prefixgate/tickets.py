"""The ticket: one request's identity, keys and lifecycle, from ingress to its outcome.

A ticket is made once, at ingress, after canonicalization, tokenization and hashing; every later
stage reads its token ids and block hashes instead of deriving them again. Reservations (queue
slot, in-flight slot, KV blocks) belong to the ticket and are released when it ends.

This module owns a ticket's lifecycle: its state, outcome and timings change only through the
ticket's methods (:meth:`Ticket.enqueue`, :meth:`~Ticket.start`, :meth:`~Ticket.retire`,
:meth:`~Ticket.complete`, :meth:`~Ticket.end`, :meth:`~Ticket.close`, ...), called by the
scheduler (queueing.py) and the dispatcher (dispatch.py); everything else reads them.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .canonicalize import RuleCount
from .engine import Media
from .errors import Outcome, PrefixgateError
from .keys import BlockHash, Namespace

__all__ = ["Ticket", "TicketState"]


class TicketState(enum.Enum):
    """Where a ticket is in its life. Moves only forward: NEW → QUEUED → RUNNING → DONE."""

    NEW = "new"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Ticket:
    """One request inside the gateway. Identity is the object; ``request_id`` is unique while live.

    Attributes:
        request_id: The id given to the engine.
        tenant: The tenant, or ``None``.
        namespace: Model, LoRA and tenant namespace of the block keys.
        prompt_token_ids: The canonical prompt's token ids.
        block_hashes: One key per full block of the prompt.
        cacheable_blocks: Leading blocks that can ever hit: ``(len(prompt) - 1) // block_size``,
            or 0 when the engine will not read the cache for this request.
        sampling_params: The engine's sampling parameters.
        max_tokens: Requested output limit, or ``None``.
        cache_salt: Passed to the engine to isolate the tenant's cache, or ``None``.
        lora_request: Passed to the engine.
        priority: Lower runs first under the ``priority`` ordering.
        arrival: Gateway clock time at ingress.
        canonicalized: Whether canonicalization changed the prompt.
        chars_removed: Characters canonicalization removed.
        canonical_rules: What each canonicalization rule changed (rules that changed nothing
            absent).
        seq: Arrival sequence number (ties break on it).
        state: Where it is in its life (:class:`TicketState`).
        outcome: How it ended, once known.
        dispatched_at: Gateway clock time it was handed to the engine.
        first_output_at: Gateway clock time of its first output.
        backlog_tokens: While dispatched and without output: the prompt tokens it counts in its
            scheduler's prefill backlog (``GatewayConfig.max_prefill_backlog``); else 0.
        finished_at: Gateway clock time its reservations were released.
        predicted_hit_tokens: Cache-hit tokens the gateway predicted at dispatch.
        predicted_wait: Raw predicted queue wait when it joined a non-empty queue.
        cached_tokens: Cache-hit tokens the engine reported.
        output_token_ids: Its output's token ids, once completed (when the engine gives them all).
        media: A multimodal prompt's media items with their token positions, passed to the
            engine; ``None`` for text.
        failure: Why the gateway ended it before the engine saw it.
        kill: Why the gateway is ending it while the engine has it (stall, shutdown).
        queue_key: The ordering policy's key, fixed when it is queued.
        granted: Serving handle (dispatch.py's alone): resolved when the scheduler dispatches it.
        task: Serving handle: the task serving it while it is dispatched.
        in_engine: Serving handle: whether that task is waiting on the engine for an output now
            (toggled around every output: a plain field, not a method, on that hot path).
    """

    request_id: str
    tenant: str | None
    namespace: Namespace
    prompt_token_ids: Sequence[int]
    block_hashes: tuple[BlockHash, ...]
    cacheable_blocks: int
    sampling_params: Any
    max_tokens: int | None
    cache_salt: str | None
    lora_request: Any
    priority: int
    arrival: float
    canonicalized: bool
    chars_removed: int
    seq: int
    state: TicketState = TicketState.NEW
    outcome: Outcome | None = None
    dispatched_at: float | None = None
    first_output_at: float | None = None
    finished_at: float | None = None
    predicted_hit_tokens: int | None = None
    predicted_wait: float | None = None
    backlog_tokens: int = field(default=0, repr=False)
    cached_tokens: int | None = None
    output_token_ids: tuple[int, ...] = ()
    granted: asyncio.Future[None] | None = field(default=None, repr=False)
    queue_key: Any = field(default=None, repr=False)
    canonical_rules: Mapping[str, RuleCount] = field(default_factory=dict, repr=False)
    failure: Exception | None = field(default=None, repr=False)
    kill: PrefixgateError | None = field(default=None, repr=False)
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    in_engine: bool = field(default=False, repr=False)
    media: tuple[Media, ...] | None = field(default=None, repr=False)

    # -- lifecycle: the only writers of state, outcome, timings and predictions ---------------

    def enqueue(self, key: Any) -> None:
        """NEW → QUEUED, sorted by the ordering policy's ``key`` while it waits."""
        self.queue_key = key
        self.state = TicketState.QUEUED

    def start(self, now: float, predicted_hit_tokens: int) -> None:
        """QUEUED → RUNNING: dispatched at ``now``, predicted to hit ``predicted_hit_tokens``."""
        self.state = TicketState.RUNNING
        self.dispatched_at = now
        self.predicted_hit_tokens = predicted_hit_tokens

    def retire(self) -> None:
        """→ DONE: it left the scheduler (its queue or the in-flight window) for good."""
        self.state = TicketState.DONE

    def predict_wait(self, raw: float | None) -> None:
        """Notes the raw queue wait predicted when it joined the queue (to calibrate it later)."""
        self.predicted_wait = raw

    def fail(self, error: Exception) -> None:
        """Ends it before the engine saw it: its stream raises ``error``."""
        self.failure = error

    def doom(self, error: PrefixgateError) -> bool:
        """Marks it to end with ``error`` while the engine has it; ``False`` if it already was."""
        if self.kill is not None:
            return False
        self.kill = error
        return True

    def first_output(self, now: float) -> None:
        """Notes its first output, at ``now``."""
        self.first_output_at = now

    def complete(self, cached_tokens: int | None, output_token_ids: tuple[int, ...]) -> None:
        """It completed: the engine's cached tokens and its output (``()`` if not known)."""
        self.outcome = Outcome.COMPLETED
        self.cached_tokens = cached_tokens
        self.output_token_ids = output_token_ids

    def end(self, outcome: Outcome) -> None:
        """Records how it ended (callers decide whether that overrides an earlier outcome)."""
        self.outcome = outcome

    def close(self, now: float) -> None:
        """Its reservations were released at ``now`` (once: ``finished_at`` says whether)."""
        self.finished_at = now

    def requeued(self) -> Ticket:
        """A fresh ticket (NEW) for the same prepared request, keeping its id, keys and arrival:
        to place it on another replica when its own died before its first output."""
        return Ticket(self.request_id, self.tenant, self.namespace, self.prompt_token_ids, self.block_hashes,
                      self.cacheable_blocks, self.sampling_params, self.max_tokens, self.cache_salt,
                      self.lora_request, self.priority, self.arrival, self.canonicalized,
                      self.chars_removed, self.seq, canonical_rules=self.canonical_rules, media=self.media)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"Ticket({self.request_id!r}, tenant={self.tenant!r}, "
                f"tokens={len(self.prompt_token_ids)}, blocks={len(self.block_hashes)}, "
                f"state={self.state.value})")
