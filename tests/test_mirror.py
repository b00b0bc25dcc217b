"""The prefix mirror: a radix tree with leaf-run LRU must evict exactly like a per-block LRU."""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.mirror import PrefixMirror


class BlockLru:
    """The reference: one LRU entry per block; a chain is inserted tail first, so its head is
    the most recent (vLLM frees a finished request's blocks tail first)."""

    def __init__(self, capacity: int, in_use: Counter[str] | None = None) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[str, None] = OrderedDict()
        self.in_use = in_use if in_use is not None else Counter()

    def insert(self, chain: tuple[str, ...]) -> None:
        for key in reversed(chain):
            self.keys[key] = None
            self.keys.move_to_end(key)
        evictable = [key for key in self.keys if not self.in_use[key]]  # oldest first
        while len(self.keys) > self.capacity and evictable:
            del self.keys[evictable.pop(0)]

    def match(self, chain: tuple[str, ...]) -> int:
        n = 0
        for key in chain:
            if key not in self.keys:
                break
            n += 1
        return n


def _chain(path: tuple[int, ...]) -> tuple[str, ...]:
    """Whole-prefix keys: key i names the path up to and including block i."""
    return tuple("/".join(map(str, path[: i + 1])) for i in range(len(path)))


# Chains over a small alphabet of blocks, so they share prefixes and fork at random places.
paths = st.lists(st.integers(0, 2), min_size=0, max_size=9).map(tuple)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 24), ops=st.lists(st.tuples(st.booleans(), paths), max_size=60))
def test_matches_a_per_block_lru_under_any_sequence(capacity, ops):
    mirror, reference = PrefixMirror(capacity), BlockLru(capacity)
    for insert, path in ops:
        chain = _chain(path)
        if insert:
            mirror.insert(chain)
            reference.insert(chain)
        assert mirror.match(chain) == reference.match(chain)
        assert len(mirror) == len(reference.keys) <= capacity
        assert set(mirror._tree.index) == set(reference.keys)  # the key index is exact


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 24),
       ops=st.lists(st.tuples(st.sampled_from(["insert", "start", "finish"]), paths), max_size=60))
def test_matches_a_per_block_lru_that_keeps_blocks_in_use(capacity, ops):
    """As vLLM, the mirror never evicts a block a running request uses: a request's chain is in
    use from its dispatch (inserted then) to its end (inserted again, as the gateway records a
    finished request's blocks, then no longer in use)."""
    in_use: Counter[str] = Counter()
    running: list[tuple[str, ...]] = []
    mirror = PrefixMirror(capacity, in_use=lambda keys: next(
        (i for i, key in enumerate(keys) if not in_use[key]), len(keys)))
    reference = BlockLru(capacity, in_use)
    for op, path in ops:
        chain = _chain(path)
        if op == "start":
            running.append(chain)
            in_use.update(chain)
        elif op == "finish" and running:
            chain = running.pop(0)
            in_use.subtract(chain)
        mirror.insert(chain)
        reference.insert(chain)
        assert set(mirror._tree.index) == set(reference.keys)
        assert all(key in mirror._tree.index for key, n in in_use.items() if n > 0)
        assert len(mirror) <= max(capacity, sum(1 for n in in_use.values() if n > 0))


def test_a_long_chain_is_evicted_tail_first_in_one_step():
    mirror = PrefixMirror(3000)
    long = tuple(range(2048))  # int keys, as block hashes are
    mirror.insert(long)
    mirror.insert(tuple(range(10_000, 11_000)))  # over capacity by 48 blocks
    assert mirror.match(long) == 2048 - 48
    assert mirror.evictions == 48 and len(mirror) == 3000


def test_limit_caps_the_match():
    mirror = PrefixMirror(100)
    mirror.insert(_chain((1, 2, 3, 4)))
    assert mirror.match(_chain((1, 2, 3, 4)), 2) == 2
    assert mirror.match(_chain((1, 2, 9)), None) == 2
    assert mirror.match((), None) == 0
