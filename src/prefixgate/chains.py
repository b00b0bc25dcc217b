"""Prefix chains: a radix tree over whole-prefix block keys, shared by the ledger and the mirror.

A key stands for its whole prefix (keys.py), so a set of chains is a tree in which each key has
one parent. :class:`ChainTree` stores it as a radix tree: each node (:class:`Run`) holds a run of
consecutive keys that no chain enters or leaves in the middle, and an index maps every key to its
run. Finding how much of a chain is already in the tree is a binary search over the chain's
positions (the set is prefix-closed: a key's presence means every key before it is present),
whatever the tree's depth (siblings that fork at many places along one prefix make it deep);
adding a chain creates at most one run and splits at most one; dropping a run drops all its keys
at once. Index updates are C-level bulk operations; nothing costs a Python step per key.

:class:`ChainRefs` counts the chains owners hold on such a tree (the ledger's shared blocks, the
chains of the requests placed on a replica). Pure and synchronous; the mirror keeps its recency
on the runs itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from itertools import repeat

__all__ = ["ChainRefs", "ChainTree", "Run"]


class Run:
    """A run of consecutive keys, positions ``start`` to ``start + len(keys) - 1``.

    Attributes:
        keys: The keys (a tuple).
        start: Position of the first key in every chain through this run.
        parent: The run holding position ``start - 1``, or ``None`` at the root.
        kids: Runs continuing this one, by their first key.
        ref: :class:`ChainRefs`' count of held chains that pass through (or end in) the run.
        ends: :class:`ChainRefs`' count of held chains that end at the run's last key.
        stamp: The mirror's recency: when a chain through it was last used.
        alive: Whether the run is still in its tree.
    """

    __slots__ = ("alive", "ends", "keys", "kids", "parent", "ref", "stamp", "start")

    def __init__(self, keys: tuple[Hashable, ...], start: int, parent: Run | None) -> None:
        self.keys = keys
        self.start = start
        self.parent = parent
        self.kids: dict[Hashable, Run] = {}
        self.ref = 0
        self.ends = 0
        self.stamp = 0
        self.alive = True

    @property
    def end(self) -> int:
        """One past the position of the last key."""
        return self.start + len(self.keys)

    def __repr__(self) -> str:
        return f"Run({self.start}..{self.end}, kids={len(self.kids)}, ref={self.ref}, ends={self.ends})"


class ChainTree:
    """A radix tree of whole-prefix key chains.

    Invariant: ``size`` is the number of distinct keys held and ``index`` maps exactly those keys
    to the run holding them; every run is non-empty; a run's kids start where it ends and have
    distinct first keys; a chain's keys are held iff every run on its path is alive.
    """

    def __init__(self) -> None:
        self.roots: dict[Hashable, Run] = {}
        self.index: dict[Hashable, Run] = {}
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def match(self, chain: Sequence[Hashable], limit: int | None = None) -> tuple[int, Run | None]:
        """How many leading keys of ``chain`` (at most ``limit``) the tree holds, and the run
        holding the last of them (``None`` when there is none). Pure."""
        n = len(chain) if limit is None else min(len(chain), limit)
        if n == 0:
            return 0, None
        index = self.index
        if chain[0] not in index:
            return 0, None
        if chain[n - 1] in index:
            return n, index[chain[n - 1]]
        lo, hi = 1, n - 1  # chain[lo - 1] is held, chain[hi] is not
        while lo < hi:
            mid = (lo + hi) // 2
            if chain[mid] in index:
                lo = mid + 1
            else:
                hi = mid
        return lo, index[chain[lo - 1]]

    def split(self, run: Run, at: int) -> Run:
        """Splits ``run`` before position ``at`` (inside it) and returns the new upper run.

        ``run`` keeps its identity and becomes the lower part, so whatever points at it (a
        reservation's tip) still finds the run holding its last key. The upper part inherits
        ``ref`` and ``stamp``; ``ends`` stay with the lower part.
        """
        k = at - run.start
        upper = Run(run.keys[:k], run.start, run.parent)
        upper.ref, upper.stamp = run.ref, run.stamp
        self.index.update(zip(upper.keys, repeat(upper)))
        siblings = self.roots if run.parent is None else run.parent.kids
        siblings[upper.keys[0]] = upper
        run.keys = run.keys[k:]
        run.start = at
        run.parent = upper
        upper.kids[run.keys[0]] = run
        return upper

    def add(self, chain: Sequence[Hashable],
            matched: tuple[int, Run | None] | None = None) -> tuple[int, Run | None]:
        """Adds ``chain``; returns how many of its keys were new and the run ending at its last
        key (splitting a run if the chain ends or forks inside it; ``None`` for an empty chain).
        ``matched`` is :meth:`match`'s result for ``chain``, if the caller has it."""
        n = len(chain)
        if n == 0:
            return 0, None
        m, run = self.match(chain) if matched is None else matched
        if run is not None and m < run.end:
            run = self.split(run, m)
        if m == n:
            return 0, run
        new = Run(tuple(chain[m:]), m, run)
        self.index.update(zip(new.keys, repeat(new)))
        (self.roots if run is None else run.kids)[chain[m]] = new
        self.size += n - m
        return n - m, new

    def remove(self, run: Run) -> int:
        """Drops a run that has no kids; returns how many keys that freed."""
        siblings = self.roots if run.parent is None else run.parent.kids
        if siblings.get(run.keys[0]) is run:
            del siblings[run.keys[0]]
        deque(map(self.index.pop, run.keys), maxlen=0)
        run.alive = False
        self.size -= len(run.keys)
        return len(run.keys)

    def trim(self, run: Run, keep: int) -> int:
        """Drops all but the first ``keep`` (>= 1) keys of a run that has no kids; returns how many
        keys that freed."""
        dropped = len(run.keys) - keep
        deque(map(self.index.pop, run.keys[keep:]), maxlen=0)
        run.keys = run.keys[:keep]
        self.size -= dropped
        return dropped

    def merge(self, run: Run) -> Run:
        """Merges ``run`` into its only kid when no chain ends at it (keeps paths short);
        returns the run that now holds its keys."""
        if len(run.kids) != 1 or run.ends:
            return run
        (kid,) = run.kids.values()
        self.index.update(zip(run.keys, repeat(kid)))
        kid.keys = run.keys + kid.keys
        kid.start = run.start
        kid.parent = run.parent
        siblings = self.roots if run.parent is None else run.parent.kids
        siblings[run.keys[0]] = kid
        run.alive = False
        run.kids = {}
        return kid

    def clear(self) -> None:
        """Drops everything."""
        self.roots.clear()
        self.index.clear()
        self.size = 0

    def __repr__(self) -> str:
        return f"ChainTree(keys={self.size}, roots={len(self.roots)})"


class ChainRefs:
    """Chains held by owners, each key kept once however many held chains pass through it, and
    dropped when the last of them is released.

    Holding walks the chain (a binary search per run) and adds one run at most; releasing walks
    back up the owner's few runs and drops those no held chain passes through any more, whatever
    their length.

    Invariant: ``size`` is the number of distinct keys some held chain passes through; every run's
    ``ref`` counts the held chains through it; an owner holds at most one chain.
    """

    def __init__(self) -> None:
        self._tree = ChainTree()
        self._tips: dict[Hashable, Run | None] = {}  # owner -> the run its chain ends at

    @property
    def size(self) -> int:
        """Distinct keys held now."""
        return self._tree.size

    def __len__(self) -> int:
        return len(self._tips)

    def __contains__(self, owner: Hashable) -> bool:
        return owner in self._tips

    def match(self, chain: Sequence[Hashable]) -> tuple[int, Run | None]:
        """How many leading keys of ``chain`` are held, and the run holding the last of them
        (see :meth:`ChainTree.match`). Pure."""
        return self._tree.match(chain)

    def held(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` (consecutive whole-prefix keys: a chain or a run of one)
        held chains pass through. Pure."""
        return self._tree.match(keys)[0]

    def hold(self, owner: Hashable, chain: Sequence[Hashable],
             matched: tuple[int, Run | None] | None = None) -> int:
        """Holds ``chain`` for ``owner``; returns how many of its keys were not held before.
        ``matched`` is :meth:`match`'s result for ``chain``, if the caller has it.

        Raises:
            ValueError: If ``owner`` already holds a chain.
        """
        if owner in self._tips:
            raise ValueError(f"{owner!r} already holds a chain")
        added, tip = self._tree.add(chain, matched)
        if tip is not None:
            tip.ends += 1
            run: Run | None = tip
            while run is not None:
                run.ref += 1
                run = run.parent
        self._tips[owner] = tip
        return added

    def release(self, owner: Hashable) -> int:
        """Releases ``owner``'s chain; returns how many keys no held chain passes through any
        more (0 if it held none, or only keys other chains still hold)."""
        tip = self._tips.pop(owner, None)
        if tip is None:
            return 0
        tree, freed, survivor = self._tree, 0, None
        tip.ends -= 1
        run: Run | None = tip
        while run is not None:
            run.ref -= 1
            parent = run.parent
            if run.ref == 0:  # no held chain passes through: nor through its kids
                freed += tree.remove(run)
            elif survivor is None:
                survivor = run
            run = parent
        if survivor is not None:  # it lost a kid or a chain end: keep the tree compact
            tree.merge(survivor)
        return freed

    def __repr__(self) -> str:
        return f"ChainRefs(owners={len(self._tips)}, keys={self._tree.size})"
