"""Stage 4: admit only what fits in the engine's KV cache, and say when to retry.

vLLM accepts everything; when its KV blocks run out it preempts and recomputes, and latency
collapses for everyone. The gateway instead keeps a *block ledger*: every dispatched ticket
reserves the blocks it will need, ``ceil((prompt − hits on blocks already reserved + output
reserve) / block)``, with shared prefix blocks counted once across running tickets; the
scheduler dispatches only while reservations fit, live engine stats agree, and a watermark is
left free. Reservations belong to the ticket and are released when it ends,
however it ends.

Pure and synchronous; the gateway's async shell calls it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from .chains import ChainRefs
from .clock import Clock
from .engine import KvStats
from .errors import Reason, RequestTooLarge
from .tickets import Ticket

__all__ = ["Admission", "BlockLedger", "DrainRate"]

_MIN_WAIT_SAMPLES = 8


class BlockLedger:
    """Per-ticket reservations of KV blocks against a fixed capacity, shared prefix blocks
    counted once.

    vLLM keeps one copy of a full prompt block however many running requests use it, and
    frees it only when the last of them ends. The ledger does the same: a reservation is a
    ticket's *shared* blocks (keys of full prompt blocks) plus its *private* blocks (the partial
    last block and the output reserve). A ticket is charged for the shared blocks no other
    running ticket holds yet; a shared block comes back when its last holder releases. Charging
    each ticket for its whole prompt instead would turn away work that fits; charging the first
    holder alone (and freeing the block when it ends) would let siblings run on blocks the
    ledger counts as free, which is how preemption storms start.

    Shared keys are whole-prefix keys (see keys.py), so the held blocks form a tree of chains,
    counted by :class:`~prefixgate.chains.ChainRefs` (a radix tree whose runs count the
    reservations passing through them): reserving walks the chain (a binary search per run) and
    adds one run at most; releasing walks back up the reservation's few runs and drops those no
    one passes through any more, whatever their length.

    Invariant: ``reserved == len(shared blocks held) + sum(private blocks)``,
    ``reserved + free == capacity`` and ``0 <= reserved <= capacity + overcommit`` at all times;
    a ticket holds at most one reservation, and releasing it twice releases nothing the second
    time.

    Args:
        capacity: The engine's KV capacity in blocks.
        overcommit: Blocks that reservations may take beyond ``capacity`` (the lookahead).

    Raises:
        ValueError: If ``capacity`` or ``overcommit`` is negative.
    """

    def __init__(self, capacity: int, overcommit: int = 0) -> None:
        if capacity < 0 or overcommit < 0:
            raise ValueError(f"capacity and overcommit must be >= 0, got {capacity}, {overcommit}")
        self.capacity = capacity
        self.overcommit = overcommit
        self.reserved = 0
        self._held: dict[int, tuple[int, int]] = {}  # id -> (shared, private)
        self._shared = ChainRefs()

    @property
    def free(self) -> int:
        """Blocks not reserved by any ticket."""
        return self.capacity - self.reserved

    @property
    def shared_blocks(self) -> int:
        """Distinct shared blocks held now."""
        return self._shared.size

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, ticket: Ticket) -> int:
        """Blocks ``ticket`` uses, shared ones included (0 if it holds no reservation)."""
        shared, private = self._held.get(id(ticket), (0, 0))
        return shared + private

    def held(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` (consecutive whole-prefix keys: a chain or a run of one)
        reservations hold. Pure."""
        return self._shared.held(keys)

    def need(self, shared: Sequence[Hashable], private: int) -> int:
        """Blocks a reservation of ``shared`` keys (a chain of whole-prefix keys) and
        ``private`` blocks would add now. Pure."""
        return len(shared) - self._shared.held(shared) + private

    def can_reserve(self, blocks: int) -> bool:
        """Whether ``blocks`` more would fit (the overcommit included). Pure."""
        return 0 <= blocks <= self.free + self.overcommit

    def reserve(self, ticket: Ticket, shared: Sequence[Hashable], private: int) -> int:
        """Reserves ``shared`` (a chain of whole-prefix keys) and ``private`` blocks for
        ``ticket``; returns the blocks it added to ``reserved``.

        Raises:
            ValueError: If ``ticket`` already holds a reservation, ``private`` is negative, or
                it does not fit (callers check :meth:`need` and :meth:`can_reserve` first).
        """
        if id(ticket) in self._held:
            raise ValueError(f"{ticket.request_id} already holds {self.holds(ticket)} blocks")
        if private < 0:
            raise ValueError(f"private blocks must be >= 0, got {private}")
        matched = self._shared.match(shared)
        added = len(shared) - matched[0] + private
        if not self.can_reserve(added):
            raise ValueError(f"cannot reserve {added} blocks with {self.free} free")
        self._shared.hold(id(ticket), shared, matched)
        self._held[id(ticket)] = (len(shared), private)
        self.reserved += added
        return added

    def release(self, ticket: Ticket) -> int:
        """Releases ``ticket``'s reservation; returns how many blocks came free (0 if it held
        none; shared blocks other tickets still hold stay reserved)."""
        held = self._held.pop(id(ticket), None)
        if held is None:
            return 0
        freed = held[1] + self._shared.release(id(ticket))
        self.reserved -= freed
        return freed

    def __repr__(self) -> str:
        return (f"BlockLedger(reserved={self.reserved}, free={self.free}, tickets={len(self._held)}, "
                f"shared={self._shared.size})")


class DrainRate:
    """Completions per second over a sliding window of the last ``window`` completions.

    Invariant: holds at most ``window`` timestamps, oldest first.
    """

    def __init__(self, clock: Clock, window: int = 64) -> None:
        self.clock = clock
        self._times: deque[float] = deque(maxlen=window)

    def record(self) -> None:
        """Notes one completion now."""
        self._times.append(self.clock.now())

    def per_second(self) -> float | None:
        """The recent completion rate, or ``None`` before two completions were seen."""
        if len(self._times) < 2:
            return None
        span = max(self.clock.now(), self._times[-1]) - self._times[0]
        return (len(self._times) - 1) / span if span > 0 else None

    def __repr__(self) -> str:
        rate = self.per_second()
        return f"DrainRate({'unknown' if rate is None else f'{rate:.2f}/s'})"


class Admission:
    """Decides whether a ticket's KV needs fit now, and estimates when a refused one would.

    A ticket fits when its block need fits the ledger's free blocks less the watermark *and*,
    while anything is in flight, the engine's latest stats are fresh and show as many free
    blocks. Stats count as "full" (fail safe) once the engine has had work for
    ``stats_max_age`` seconds without reporting a step: if it stops reporting, the gateway stops
    dispatching. Seconds the event loop itself was late do not count (``loop_lag``): on an H200
    driving two engines through a burst the loop lagged 2-5 s, and stats late for that reason
    refused 2-4% of the burst as ``kv_stats_stale``. An idle engine reports nothing, so age is
    counted from the later of the last report and the moment the engine last went from idle to
    busy; with nothing in flight one request is always let through.

    Output is reserved for what the engine may really generate: ``max_tokens`` capped at the
    model's context (``max_model_len`` less the prompt, where vLLM stops a request), or that
    whole room when a request sets no ``max_tokens`` (unless ``default_output_tokens`` says
    otherwise: then requests generating more than assumed may be preempted).

    Args:
        ledger: The block ledger.
        block_size: The engine's block size.
        max_model_len: The engine's context length.
        output_reserve: Share of the output limit reserved in blocks (1.0 = all of it).
        default_output_tokens: Output tokens assumed when a request gives no ``max_tokens``;
            ``None``: up to the model's context.
        watermark_blocks: Blocks always kept free.
        stats_max_age: Seconds after which engine stats count as "full".
        kv_stats: Returns the engine's latest stats.
        clock: The gateway's clock.
        loop_lag: How late the event loop has been since a given time (seconds; see
            :class:`~prefixgate.clock.LoopLag`): stats count as stale only once they are older
            than ``stats_max_age`` plus that, since news from an in-process engine waits for the
            loop. ``None``: no allowance (virtual and fake clocks).
    """

    def __init__(self, ledger: BlockLedger, *, block_size: int, output_reserve: float,
                 default_output_tokens: int | None, watermark_blocks: int, stats_max_age: float,
                 kv_stats: Callable[[], KvStats | None], clock: Clock,
                 max_model_len: int | None = None,
                 loop_lag: Callable[[float], float] | None = None) -> None:
        self.ledger = ledger
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.output_reserve = output_reserve
        self.default_output_tokens = default_output_tokens
        self.watermark_blocks = watermark_blocks
        self.stats_max_age = stats_max_age
        self.kv_stats = kv_stats
        self.clock = clock
        self.loop_lag = loop_lag
        self.drain = DrainRate(clock)
        self.busy_since = 0.0
        self._waits: deque[tuple[float, float]] = deque(maxlen=64)  # (raw predicted, actual)

    def split(self, ticket: Ticket) -> tuple[Sequence[Hashable], int]:
        """``ticket``'s shared block keys and its count of private blocks. Pure.

        Shared: the full prompt blocks that can ever hit (``cacheable_blocks``; vLLM recomputes
        the last prompt token, so a prompt's last full block is not reused by an identical
        prompt). Private: the rest of the prompt plus the output reserve, at least one block.
        """
        n = ticket.num_prompt_tokens
        room = None if self.max_model_len is None else max(1, self.max_model_len - n)
        out = ticket.max_tokens if ticket.max_tokens is not None else self.default_output_tokens
        if out is None:
            out = room if room is not None else 1
        elif room is not None and out > room:
            out = room  # vLLM stops a request at the model's context length
        shared = ticket.block_hashes[: ticket.cacheable_blocks]
        rest = n - len(shared) * self.block_size + out * self.output_reserve
        private = math.ceil(rest / self.block_size)
        return shared, max(private, 1)  # the prompt's last token always lands in a private block

    def check_fits_ever(self, ticket: Ticket) -> None:
        """Refuses a ticket whose blocks can never be reserved, even with nothing else running.

        Raises:
            RequestTooLarge: naming the blocks it needs and the ledger's capacity.
        """
        shared, private = self.split(ticket)
        blocks = len(shared) + private
        if blocks > self.ledger.capacity:
            raise RequestTooLarge(
                f"{ticket.request_id} needs {blocks} KV blocks ({ticket.num_prompt_tokens} prompt tokens "
                f"plus its output limit); the gateway can reserve at most {self.ledger.capacity}",
                blocks=blocks, limit=self.ledger.capacity)

    def need(self, ticket: Ticket) -> int:
        """Blocks dispatching ``ticket`` now would add to the ledger: its prompt blocks no
        running ticket holds (cached-but-idle blocks count: the engine's free count includes
        them and using them takes them out of it), plus its private blocks. Pure."""
        return self.ledger.need(*self.split(ticket))

    def blocked_reason(self, blocks: int, ahead: bool = False) -> Reason | None:
        """Why ``blocks`` more cannot be dispatched now, or ``None`` if they can. With
        ``ahead``, the ledger's overcommit (the lookahead) counts as free. Pure."""
        if len(self.ledger) == 0:
            return None  # idle engine: always let one through, whatever its stats say
        extra = self.ledger.overcommit if ahead else 0
        if blocks > self.ledger.free - self.watermark_blocks + extra:
            return Reason.KV_RESERVED
        stats = self.kv_stats()
        if stats is None:
            return None  # an engine without stats: the ledger alone decides
        since = max(stats.time, self.busy_since)
        age = self.clock.now() - since
        if age > self.stats_max_age and (self.loop_lag is None
                                         or age > self.stats_max_age + self.loop_lag(since)):
            return Reason.KV_STATS_STALE
        if blocks > stats.free_blocks - self.watermark_blocks + extra:
            return Reason.KV_FREE_LOW
        return None

    def may_look_ahead(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` may use the lookahead: its whole output fits in one block, so once
        vLLM runs it, it needs at most one block more (no decode growth to preempt others for)."""
        return bool(self.ledger.overcommit) and ticket.max_tokens is not None \
            and ticket.max_tokens <= self.block_size

    def reserve(self, ticket: Ticket, shared: Sequence[Hashable] | None = None,
                private: int | None = None) -> int:
        """Reserves a dispatched ticket's blocks (see :meth:`BlockLedger.reserve`); returns the
        blocks added. ``shared`` and ``private`` are :meth:`split`'s, if already computed."""
        if shared is None or private is None:
            shared, private = self.split(ticket)
        if len(self.ledger) == 0:
            self.busy_since = self.clock.now()
        return self.ledger.reserve(ticket, shared, private)

    def fits(self, blocks: int) -> bool:
        """Whether ``blocks`` more can be dispatched now."""
        return self.blocked_reason(blocks) is None

    def raw_wait(self, ahead: int) -> float | None:
        """Seconds until ``ahead`` requests and then one more are dispatched at the recent
        drain rate, first come first served; ``None`` while the rate is unknown."""
        rate = self.drain.per_second()
        return None if rate is None else (ahead + 1) / rate

    @property
    def wait_correction(self) -> float:
        """Observed over predicted queue wait of recent requests (1.0 until
        ``_MIN_WAIT_SAMPLES`` were seen), clamped to [0.5, 8].

        The raw estimate assumes first come first served; prefix ordering lets siblings of
        resident prefixes overtake, and KV frees in waves as groups finish, so a request joining
        a cold group waits longer than its place in line says (on W4 at 2x, 3-4x longer)."""
        raw = sum(r for r, _ in self._waits)
        if len(self._waits) < _MIN_WAIT_SAMPLES or raw <= 0:
            return 1.0
        return min(8.0, max(0.5, sum(a for _, a in self._waits) / raw))

    def observe_wait(self, raw: float, actual: float) -> None:
        """Records a request's raw predicted wait (:meth:`raw_wait` when it joined the queue)
        against how long it waited (a lower bound if it left the queue undispatched)."""
        self._waits.append((raw, actual))

    def estimated_wait(self, ahead: int) -> float | None:
        """Seconds until ``ahead`` queued requests and then one more are dispatched: the raw
        estimate times :attr:`wait_correction`; ``None`` while the drain rate is unknown."""
        raw = self.raw_wait(ahead)
        return None if raw is None else raw * self.wait_correction

    def __repr__(self) -> str:
        return (f"Admission({self.ledger!r}, watermark={self.watermark_blocks}, "
                f"reserve={self.output_reserve}, {self.drain!r})")
