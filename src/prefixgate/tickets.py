"""The ticket: one request's identity, keys and lifecycle, from ingress to its outcome.

A ticket is made once, at ingress, after canonicalization, tokenization and hashing; every later
stage reads its token ids and block hashes instead of deriving them again. Reservations (queue
slot, in-flight slot, KV blocks) belong to the ticket and are released when it ends.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .canonicalize import RuleCount
from .engine import Media
from .errors import Outcome
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
        media: A multimodal prompt's media items with their token positions, passed to the
            engine; ``None`` for text.
        failure: Why the gateway ended it before the engine saw it (set by the gateway).
        kill: Why the gateway is ending it while the engine has it (stall, shutdown).
        task: The task serving it while it is dispatched.
        in_engine: Whether that task is waiting on the engine for an output now.
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
    cached_tokens: int | None = None
    output_token_ids: tuple[int, ...] = ()
    granted: asyncio.Future[None] | None = field(default=None, repr=False)
    queue_key: Any = field(default=None, repr=False)
    canonical_rules: Mapping[str, RuleCount] = field(default_factory=dict, repr=False)
    failure: Exception | None = field(default=None, repr=False)
    kill: Exception | None = field(default=None, repr=False)
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    in_engine: bool = field(default=False, repr=False)
    media: tuple[Media, ...] | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"Ticket({self.request_id!r}, tenant={self.tenant!r}, "
                f"tokens={len(self.prompt_token_ids)}, blocks={len(self.block_hashes)}, "
                f"state={self.state.value})")
