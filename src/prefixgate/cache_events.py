"""What an engine says its prefix cache stored and evicted, and how a mirror follows it.

A gateway's mirror learns a replica's cache from what that gateway dispatched
(:mod:`prefixgate.mirror`). With several gateways in front of the same engines that is only part
of the truth: each sees its own requests, so each may start a new prefix on a different replica,
and none sees the others' blocks evicted. vLLM publishes every block it stores in and evicts from
its prefix cache (``--kv-events-config``: ``BlockStored`` with the block's token ids, its parent's
hash and its cache salt; ``BlockRemoved``; ``AllBlocksCleared``); :class:`SimEngine` does the same
when asked (``cache_events=True``). A :class:`CacheFollower` turns those events into the
gateway's own block keys (re-hashing the tokens from the parent's key, or from the namespace root
the salt names) and keeps the mirror in step: every gateway then sees where any gateway's
requests put a prefix, once it is prefilled.

The engine's hashes are opaque here; the follower keeps a bounded map from them to the gateway's
keys. A stored block whose parent it never learned, or whose salt names a tenant this gateway has
not served, is skipped: those keys could not be matched by any request of this gateway yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from .keys import BlockHash, chain_hashes, pack_tokens
from .mirror import PrefixMirror

__all__ = ["BlocksRemoved", "BlocksStored", "CacheCleared", "CacheEvent", "CacheFollower", "CacheListeners"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full blocks the engine just registered in its prefix cache.

    Attributes:
        block_hashes: The engine's hashes of the blocks, in order (opaque here).
        parent: The engine's hash of the block before the first, or ``None`` at the start of a
            prompt.
        token_ids: The blocks' tokens, ``len(block_hashes) * block_size`` of them.
        cache_salt: The request's cache salt (``None``: the shared namespace).
        lora: The LoRA adapter's name, or ``None``.
        media: Whether media items fall in these blocks (their keys depend on the items'
            identifiers, which the event does not carry in a form the gateway hashes).
        salt_known: Whether the event says the salt (a vLLM whose events carry no extra keys
            does not: a run from the start of a prompt is then skipped, since it may be any
            tenant's).
    """

    block_hashes: tuple[Hashable, ...]
    parent: Hashable | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    lora: str | None = None
    media: bool = False
    salt_known: bool = True


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks the engine evicted from its prefix cache (the engine's hashes)."""

    block_hashes: tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The engine dropped every cached block (``reset_prefix_cache``)."""


CacheEvent = BlocksStored | BlocksRemoved | CacheCleared


class CacheListeners:
    """Who an engine tells of its cache events: the engine side of ``add_cache_listener``.

    Args:
        owner: Names the engine in the log when a listener fails.
    """

    def __init__(self, owner: str = "an engine") -> None:
        self.owner = owner
        self._listeners: list[Callable[[Sequence[CacheEvent]], None]] = []

    def add(self, listener: Callable[[Sequence[CacheEvent]], None]) -> Callable[[], None]:
        """Adds ``listener``; returns what removes it (idempotent)."""
        listeners = self._listeners
        listeners.append(listener)

        def remove() -> None:
            if listener in listeners:
                listeners.remove(listener)
        return remove

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Gives ``events`` to every listener; one that raises is logged and the rest still hear."""
        for listener in tuple(self._listeners):
            try:
                listener(events)
            except Exception:  # a listener's bug must not stop the engine
                log.exception("prefixgate: a cache event listener of %s failed", self.owner)

    def __len__(self) -> int:
        return len(self._listeners)


class CacheFollower:
    """Applies an engine's cache events to a gateway's mirror of that engine.

    Invariant: ``_keys`` maps an engine hash to the gateway's key for the same block while the
    engine holds it (as far as the events said), at most ``limit`` entries (past that it is
    cleared: later blocks of the chains it knew are skipped until their prompts are stored again).

    Args:
        mirror: The mirror to keep in step.
        block_size: Tokens per block.
        root_for: The gateway's namespace root for a cache salt and LoRA name, or ``None`` when
            it cannot tell (a salt it never gave).
        limit: The most engine hashes remembered; the engine's block count is enough for a
            complete picture.
    """

    def __init__(self, mirror: PrefixMirror, block_size: int,
                 root_for: Callable[[str | None, str | None], BlockHash | None], *, limit: int) -> None:
        if block_size < 1 or limit < 1:
            raise ValueError(f"CacheFollower needs block_size >= 1 and limit >= 1, got {block_size}, {limit}")
        self.mirror = mirror
        self.block_size = block_size
        self.root_for = root_for
        self.limit = limit
        self._keys: dict[Hashable, BlockHash] = {}
        self.stored = 0
        """Blocks learned from the events."""
        self.removed = 0
        """Blocks the events took out of the mirror."""
        self.skipped = 0
        """Stored blocks not learned (unknown parent or salt, media, malformed)."""

    def apply(self, events: Sequence[CacheEvent]) -> None:
        """Applies ``events`` in order."""
        for event in events:
            if isinstance(event, BlocksStored):
                self._stored(event)
            elif isinstance(event, BlocksRemoved):
                keys = [k for h in event.block_hashes if (k := self._keys.pop(h, None)) is not None]
                self.removed += self.mirror.forget(keys)
            elif isinstance(event, CacheCleared):
                self._keys.clear()
                self.mirror.clear()

    def reset(self) -> None:
        """Forgets the engine's hashes (the engine restarted: its cache is empty)."""
        self._keys.clear()

    def _stored(self, event: BlocksStored) -> None:
        n = len(event.block_hashes)
        if event.media or n == 0 or len(event.token_ids) != n * self.block_size:
            self.skipped += n
            return
        if event.parent is None:
            parent_key = None
            root = self.root_for(event.cache_salt, event.lora) if event.salt_known else None
        else:
            root = parent_key = self._keys.get(event.parent)
        if root is None:
            self.skipped += n
            return
        try:
            keys = chain_hashes(pack_tokens(event.token_ids), self.block_size, root)
        except ValueError:
            self.skipped += n
            return
        if not self.mirror.learn(parent_key, keys):
            self.skipped += n
            return
        if len(self._keys) + n > self.limit:
            self._keys.clear()
        self._keys.update(zip(event.block_hashes, keys, strict=True))
        self.stored += n

    def __repr__(self) -> str:
        return (f"CacheFollower(known={len(self._keys)}, stored={self.stored}, removed={self.removed}, "
                f"skipped={self.skipped})")
