"""A bounded mirror of the engine's prefix cache, kept from what the gateway dispatched.

The engine does not say which blocks it holds; it does not need to. Every block that enters it
went through the gateway, so the gateway records the block keys of each dispatched prompt (and,
on completion, of the prompt plus its output, which vLLM caches too) in an LRU capped at the
engine's block capacity. When nothing has been evicted this predicts the engine's
``num_cached_tokens`` exactly (a test checks it against vLLM); under pressure it is a bounded
estimate, since the engine's LRU also keeps blocks of running requests pinned.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .keys import BlockHash, resident_prefix

__all__ = ["PrefixMirror"]


class PrefixMirror:
    """An LRU set of block keys, capped at ``capacity`` entries (the engine's block count).

    Keys are whole-prefix keys, so the resident set is a forest of chains. Inserting a chain
    marks it most recently used; as in vLLM, which frees a finished request's blocks tail first,
    a chain's head is never older than its tail, so the least recently used block is always a
    leaf. The mirror therefore keeps one recency stamp per chain end (and, as leaves go, passes
    it to their parent) and evicts the stalest leaf: the same order as a per-block LRU, for the
    cost of the keys a chain adds rather than of every key it touches. Matching is a binary
    search.

    Invariant: ``len(self) <= capacity``; every resident key's chain prefix is resident; the
    least recently inserted chain end is evicted first, tail before head.

    Args:
        capacity: The most keys held; the engine's KV capacity in blocks.

    Raises:
        ValueError: If ``capacity`` is negative.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._children: dict[BlockHash, int] = {}  # resident key -> resident keys continuing it
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._stamp: dict[BlockHash, int] = {}  # last use of chains ending at (or below) a key
        self._leaves: list[tuple[int, BlockHash]] = []  # heap of (stamp, leaf); stale entries skipped
        self._now = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._children)

    def __contains__(self, key: object) -> bool:
        return key in self._children

    def match(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Counts the leading ``hashes`` that are resident, up to ``limit`` blocks. Pure."""
        return resident_prefix(hashes, self._children.__contains__, limit)

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Marks the chain ``hashes`` resident and most recently used, evicting the least
        recently used blocks beyond capacity (a chain's tail before its head)."""
        n = len(hashes)
        if n == 0:
            return
        children = self._children
        held = resident_prefix(hashes, children.__contains__)
        if held < n:
            new = tuple(hashes[held:])
            parent = hashes[held - 1] if held else None
            if parent is not None:
                children[parent] += 1
            children.update(dict.fromkeys(new[:-1], 1))
            children[new[-1]] = 0
            self._parent.update(zip(new, (parent, *new[:-1]), strict=True))
        self._now += 1
        tip = hashes[-1]
        self._stamp[tip] = self._now
        if not children[tip]:
            heapq.heappush(self._leaves, (self._now, tip))
        if len(children) > self.capacity:
            self._evict()
        elif len(self._leaves) > 2 * len(children) + 64:
            self._rebuild()

    def _evict(self) -> None:
        children, stamps, parents, leaves = self._children, self._stamp, self._parent, self._leaves
        while len(children) > self.capacity:
            if not leaves:  # pragma: no cover - every resident chain has a leaf on the heap
                self._rebuild()
            stamp, key = heapq.heappop(leaves)
            if children.get(key) != 0 or stamps.get(key, 0) != stamp:
                continue  # stale: the key left, gained a child or was used again
            del children[key]
            del stamps[key]
            parent = parents.pop(key)
            self.evictions += 1
            if parent is not None:
                children[parent] -= 1
                if stamps.get(parent, 0) < stamp:
                    stamps[parent] = stamp
                if not children[parent]:
                    heapq.heappush(leaves, (stamps[parent], parent))

    def _rebuild(self) -> None:
        """Drops stale heap entries (they pile up as chains are used again and again)."""
        stamps = self._stamp
        self._leaves = [(stamps.get(k, 0), k) for k, n in self._children.items() if not n]
        for stamp, key in self._leaves:
            stamps.setdefault(key, stamp)
        heapq.heapify(self._leaves)

    def clear(self) -> None:
        """Forgets everything (the engine's cache was reset)."""
        self._children.clear()
        self._parent.clear()
        self._stamp.clear()
        self._leaves.clear()

    def __repr__(self) -> str:
        return (f"PrefixMirror(size={len(self._children)}, capacity={self.capacity}, "
                f"evictions={self.evictions})")
