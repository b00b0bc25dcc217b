"""A bounded mirror of the engine's prefix cache, kept from what the gateway dispatched.

The engine does not say which blocks it holds; it does not need to. Every block that enters it
went through the gateway, so the gateway records the block keys of each dispatched prompt (and,
on completion, of the prompt plus its output, which vLLM caches too) in an LRU capped at the
engine's block capacity. When nothing has been evicted this predicts the engine's
``num_cached_tokens`` exactly (a test checks it against vLLM); under pressure it is a bounded
estimate, since the engine's LRU also keeps blocks of running requests pinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .keys import BlockHash

__all__ = ["PrefixMirror"]


class PrefixMirror:
    """An LRU set of block keys, capped at ``capacity`` entries (the engine's block count).

    Invariant: ``len(self) <= capacity``; the least recently inserted or matched key is evicted
    first, as the engine's free-block queue evicts its least recently used block first.

    Args:
        capacity: The most keys held; the engine's KV capacity in blocks.

    Raises:
        ValueError: If ``capacity`` is negative.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def match(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Counts the leading ``hashes`` that are resident, up to ``limit`` blocks. Pure."""
        n = 0
        for h in hashes[: len(hashes) if limit is None else limit]:
            if h not in self._keys:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Marks ``hashes`` resident and most recently used, evicting the oldest over capacity.

        A chain is inserted tail first, so its head ends up most recent and, when it must evict,
        the tail goes before the head (as vLLM frees a finished request's blocks tail first).
        """
        keys = self._keys
        for h in reversed(hashes):
            if h in keys:
                keys.move_to_end(h)
            else:
                keys[h] = None
        while len(keys) > self.capacity:
            keys.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        """Forgets everything (the engine's cache was reset)."""
        self._keys.clear()

    def __repr__(self) -> str:
        return (f"PrefixMirror(size={len(self._keys)}, capacity={self.capacity}, "
                f"evictions={self.evictions})")
