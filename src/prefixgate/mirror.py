"""A bounded mirror of the engine's prefix cache, kept from what the gateway dispatched.

The engine does not say which blocks it holds; it does not need to. Every block that enters it
went through the gateway, so the gateway records the block keys of each dispatched prompt (and,
on completion, of the prompt plus its output, which vLLM caches too) in an LRU capped at the
engine's block capacity, never evicting what running requests use (the ledger says which). When
nothing has been evicted this predicts the engine's ``num_cached_tokens`` exactly (a test checks
it against vLLM); under pressure it is an estimate, since running requests also hold blocks no
prompt chain names (a partial last block, the output being written).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

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

    Invariant: ``len(self) <= capacity`` unless more keys than that are in use (the ledger's
    lookahead lets reservations pass the capacity); every resident key's chain prefix is
    resident; blocks not in use leave in least-recently-used order, a chain's tail before its
    head.

    vLLM never evicts a block a running request uses, however old: given ``in_use``, the
    mirror does not either. A run whose leading keys are in use loses only its tail; one wholly
    in use waits (it becomes most recently used when its request ends and the gateway records
    it). Without this, a prefix dispatched early to a long request counts as the oldest: the
    mirror drops it while the engine keeps it, and keeps instead a prefix the engine evicts.

    Args:
        capacity: The most keys held; the engine's KV capacity in blocks.
        in_use: How many leading keys of a run of consecutive keys running requests use (the
            replica passes its ledger's :meth:`~prefixgate.admission.BlockLedger.held`); keys
            stand for their whole prefix, so those in use lead. ``None``: none are.

    Raises:
        ValueError: If ``capacity`` is negative.
    """

    def __init__(self, capacity: int,
                 in_use: Callable[[Sequence[Hashable]], int] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.in_use = in_use
        self._tree = ChainTree()
        self._leaves: list[tuple[int, int, Run]] = []  # (stamp, seq, leaf run); stale ones skipped
        self._seq = itertools.count()
        self._now = 0
        self._rebuild_at = 4096
        self.evictions = 0
        self.followed = False
        """Whether a :class:`~prefixgate.cache_events.CacheFollower` keeps this mirror in step
        with the engine's cache events (set by the follower)."""
        self.learned: list[Callable[[Sequence[BlockHash]], None]] = []
        """Called with the keys of every chain :meth:`learn` marks resident (what the engine
        reported it stored): a scheduler over this mirror hears of prefixes another gateway's
        requests loaded."""

    def __len__(self) -> int:
        return self._tree.size

    def match(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Counts the leading ``hashes`` that are resident, up to ``limit`` blocks. Pure."""
        return self._tree.match(hashes, limit)[0]

    def holds(self, key: BlockHash) -> bool:
        """Whether the block ``key`` (and so its whole prefix) is resident. Pure."""
        return key in self._tree.index

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

    def learn(self, parent: BlockHash | None, keys: Sequence[BlockHash]) -> bool:
        """Marks ``keys``, the blocks after ``parent`` (``None``: a chain from the root), resident
        and most recently used, as the engine reported it stored them
        (:mod:`prefixgate.cache_events`). Returns ``False``, learning nothing, if ``parent`` is
        not resident (its chain is unknown)."""
        if parent is None:
            self.insert(keys)
        elif not self._learn_after(parent, keys):
            return False
        for listener in self.learned:
            listener(keys)
        return True

    def _learn_after(self, parent: BlockHash, keys: Sequence[BlockHash]) -> bool:
        run = self._tree.index.get(parent)
        if run is None:
            return False
        parts: list[Sequence[Hashable]] = [keys, run.keys[: run.keys.index(parent) + 1]]
        up = run.parent
        while up is not None:  # the runs from the root to ``parent``, last first
            parts.append(up.keys)
            up = up.parent
        chain = [key for part in reversed(parts) for key in part]
        self.insert(chain)  # type: ignore[arg-type]  # the tree holds the keys inserted: BlockHashes
        return True

    def forget(self, keys: Sequence[BlockHash]) -> int:
        """Drops each of ``keys`` and every block after it, as the engine reported it evicted
        them (the engine matches a prompt only up to its first missing block, so what follows
        one can never hit); returns how many keys went."""
        tree, gone = self._tree, 0
        for key in keys:
            run = tree.index.get(key)
            if run is None:
                continue
            at = run.start + run.keys.index(key)
            if at > run.start:
                tree.split(run, at)  # ``run`` is now the part from ``key`` on
            parent = run.parent
            stack, order = [run], []
            while stack:
                r = stack.pop()
                order.append(r)
                stack.extend(r.kids.values())
            for r in reversed(order):  # kids before their parents
                gone += tree.remove(r)
            if parent is not None and not parent.kids:
                self._push(parent)
        return gone

    def _push(self, run: Run) -> None:
        heapq.heappush(self._leaves, (run.stamp, next(self._seq), run))
        if len(self._leaves) > self._rebuild_at:
            self._rebuild()

    def _evict(self) -> None:
        tree, leaves = self._tree, self._leaves
        waiting: list[Run] = []  # leaf runs in use now, put back once done
        while tree.size > self.capacity and leaves:
            stamp, _, run = heapq.heappop(leaves)
            if not run.alive or run.kids or run.stamp != stamp:
                continue  # stale: it went, grew a kid or was used again
            used = 0 if self.in_use is None else self.in_use(run.keys)
            if used == len(run.keys):
                waiting.append(run)
                continue
            excess = tree.size - self.capacity
            if excess < len(run.keys) - used:
                self.evictions += tree.trim(run, len(run.keys) - excess)
                self._push(run)
                break
            if used:
                self.evictions += tree.trim(run, used)
                waiting.append(run)
                continue
            parent = run.parent
            self.evictions += tree.remove(run)
            if parent is not None:
                parent.stamp = max(parent.stamp, stamp)
                if not parent.kids:
                    self._push(parent)
        for run in waiting:
            heapq.heappush(self._leaves, (run.stamp, next(self._seq), run))

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
