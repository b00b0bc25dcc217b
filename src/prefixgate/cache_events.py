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
keys. A stored block whose parent it never learned is skipped. One whose salt names a tenant this
gateway has not served (another gateway's tenant, or its own from before a restart) is kept
aside, with what the engine stores after it, until the gateway gives that salt
(:meth:`CacheFollower.resolve`): then the mirror learns what is still cached under it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
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
            complete picture. Blocks kept aside for salts not yet known count apart, up to
            the same number (past it the oldest salt's are dropped).
    """

    def __init__(self, mirror: PrefixMirror, block_size: int,
                 root_for: Callable[[str | None, str | None], BlockHash | None], *, limit: int) -> None:
        if block_size < 1 or limit < 1:
            raise ValueError(f"CacheFollower needs block_size >= 1 and limit >= 1, got {block_size}, {limit}")
        self.mirror = mirror
        mirror.followed = True
        self.block_size = block_size
        self.root_for = root_for
        self.limit = limit
        self._keys: dict[Hashable, BlockHash] = {}
        self.stored = 0
        """Blocks learned from the events."""
        self.removed = 0
        """Blocks the events took out of the mirror."""
        self.skipped = 0
        """Stored blocks not learned (unknown parent, media, malformed, or kept aside for a
        salt not yet known and dropped)."""
        self.pending = 0
        """Stored blocks kept aside for salts this gateway has not given yet."""
        self._pending: OrderedDict[str, list[CacheEvent]] = OrderedDict()  # salt -> its events
        self._pending_salt: dict[Hashable, str] = {}  # engine hash kept aside -> its salt

    def apply(self, events: Sequence[CacheEvent]) -> None:
        """Applies ``events`` in order."""
        for event in events:
            if isinstance(event, BlocksStored):
                self._stored(event)
            elif isinstance(event, BlocksRemoved):
                keys = [k for h in event.block_hashes if (k := self._keys.pop(h, None)) is not None]
                self.removed += self.mirror.forget(keys)
                if self._pending_salt:
                    self._set_aside_removed(event)
            elif isinstance(event, CacheCleared):
                self._keys.clear()
                self.mirror.clear()
                self._drop_pending()

    def reset(self) -> None:
        """Forgets the engine's hashes (the engine restarted: its cache is empty)."""
        self._keys.clear()
        self._drop_pending()

    def resolve(self, salt: str) -> None:
        """The gateway now gives ``salt``: the mirror learns what was kept aside for it (what the
        engine stored under it and has not evicted since)."""
        if salt in self._pending:
            self.apply(self._take(salt))

    def _take(self, salt: str | None) -> list[CacheEvent]:
        """Takes a salt's events (the oldest salt's with ``None``) out of those kept aside."""
        events = self._pending.pop(salt) if salt is not None else self._pending.popitem(last=False)[1]
        for event in events:
            if isinstance(event, BlocksStored):
                for h in event.block_hashes:
                    self._pending_salt.pop(h, None)
                self.pending -= len(event.block_hashes)
        return events

    def _set_aside(self, salt: str, event: BlocksStored) -> None:
        events = self._pending.get(salt)
        if events is None:
            events = self._pending[salt] = []
        events.append(event)
        for h in event.block_hashes:
            self._pending_salt[h] = salt
        self.pending += len(event.block_hashes)
        while self.pending > self.limit and self._pending:
            before = self.pending
            self._take(None)
            self.skipped += before - self.pending

    def _set_aside_removed(self, event: BlocksRemoved) -> None:
        by_salt: dict[str, list[Hashable]] = {}
        for h in event.block_hashes:
            salt = self._pending_salt.get(h)
            if salt is not None:
                by_salt.setdefault(salt, []).append(h)
        for salt, hashes in by_salt.items():  # replayed in order when the salt is given
            self._pending[salt].append(BlocksRemoved(tuple(hashes)))

    def _drop_pending(self) -> None:
        self._pending.clear()
        self._pending_salt.clear()
        self.pending = 0

    def _stored(self, event: BlocksStored) -> None:
        n = len(event.block_hashes)
        if event.media or n == 0 or len(event.token_ids) != n * self.block_size:
            self.skipped += n
            return
        if event.parent is None:
            parent_key = None
            root = self.root_for(event.cache_salt, event.lora) if event.salt_known else None
            if root is None and event.salt_known and event.cache_salt is not None:
                self._set_aside(event.cache_salt, event)  # a tenant this gateway has not served
                return
        else:
            root = parent_key = self._keys.get(event.parent)
            if root is None and (salt := self._pending_salt.get(event.parent)) is not None:
                self._set_aside(salt, event)  # after blocks kept aside
                return
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
                f"skipped={self.skipped}, pending={self.pending})")
