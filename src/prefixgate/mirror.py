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
import itertools
from collections.abc import Sequence

from .chains import ChainTree, Run
from .keys import BlockHash

__all__ = ["PrefixMirror"]


class PrefixMirror:
    """An LRU set of block keys, capped at ``capacity`` keys (the engine's block count).

    Keys are whole-prefix keys, kept in a radix tree of chains (:class:`~prefixgate.chains.ChainTree`).
    Inserting a chain marks it most recently used; as in vLLM, which frees a finished request's
    blocks tail first, a chain's head is never older than its tail, so the least recently used
    block is always at the end of a leaf run. The mirror stamps the run each chain ends in and
    evicts from the stalest leaf run, tail first (a leaf's stamp passes to its parent when it
    goes): the order of a per-block LRU, for a few steps per chain instead of one per block.
    Matching is a walk with a binary search per run.

    Invariant: ``len(self) <= capacity``; every resident key's chain prefix is resident; blocks
    leave in least-recently-used order, a chain's tail before its head.

    Args:
        capacity: The most keys held; the engine's KV capacity in blocks.

    Raises:
        ValueError: If ``capacity`` is negative.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._tree = ChainTree()
        self._leaves: list[tuple[int, int, Run]] = []  # (stamp, seq, leaf run); stale ones skipped
        self._seq = itertools.count()
        self._now = 0
        self._rebuild_at = 4096
        self.evictions = 0

    def __len__(self) -> int:
        return self._tree.size

    def match(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Counts the leading ``hashes`` that are resident, up to ``limit`` blocks. Pure."""
        return self._tree.match(hashes, limit)[0]

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Marks the chain ``hashes`` resident and most recently used, evicting the least
        recently used blocks beyond capacity (a chain's tail before its head)."""
        _, tip = self._tree.add(hashes)
        if tip is None:
            return
        self._now += 1
        tip.stamp = self._now
        if not tip.kids:
            self._push(tip)
        if self._tree.size > self.capacity:
            self._evict()

    def _push(self, run: Run) -> None:
        heapq.heappush(self._leaves, (run.stamp, next(self._seq), run))
        if len(self._leaves) > self._rebuild_at:
            self._rebuild()

    def _evict(self) -> None:
        tree, leaves = self._tree, self._leaves
        while tree.size > self.capacity and leaves:
            stamp, _, run = heapq.heappop(leaves)
            if not run.alive or run.kids or run.stamp != stamp:
                continue  # stale: it went, grew a kid or was used again
            excess = tree.size - self.capacity
            if excess < len(run.keys):
                self.evictions += tree.trim(run, len(run.keys) - excess)
                self._push(run)
                return
            parent = run.parent
            self.evictions += tree.remove(run)
            if parent is not None:
                parent.stamp = max(parent.stamp, stamp)
                if not parent.kids:
                    self._push(parent)

    def _rebuild(self) -> None:
        """Drops stale heap entries (they pile up as chains are used again and again)."""
        leaves: list[tuple[int, int, Run]] = []
        stack = list(self._tree.roots.values())
        while stack:
            run = stack.pop()
            if run.kids:
                stack.extend(run.kids.values())
            else:
                leaves.append((run.stamp, next(self._seq), run))
        heapq.heapify(leaves)
        self._leaves = leaves
        self._rebuild_at = max(4096, 2 * len(leaves))

    def clear(self) -> None:
        """Forgets everything (the engine's cache was reset)."""
        self._tree.clear()
        self._leaves.clear()

    def __repr__(self) -> str:
        return (f"PrefixMirror(size={self._tree.size}, capacity={self.capacity}, "
                f"evictions={self.evictions})")
