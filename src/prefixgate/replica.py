"""A replica: one engine and what the gateway knows of it.

What belongs to one engine lives here: the engine itself, the mirror of its prefix cache, its KV
block ledger and admission rule, how many requests it runs at once, how its outputs are read,
and its health (dead or alive, and the watchdog that notices when it stalls). A gateway over
several engines holds one replica per engine (router.py), each built the same way, sharing
nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

from .admission import Admission, BlockLedger
from .cache_events import CacheFollower
from .clock import Clock, LoopLag, MonotonicClock
from .config import GatewayConfig
from .engine import Engine, completion_reader, engine_slots
from .errors import EngineDead, EngineStalled, PrefixgateError
from .keys import BlockHash, chain_hashes, media_extras, pack_tokens
from .mirror import PrefixMirror
from .tickets import Ticket

__all__ = ["Replica"]

log = logging.getLogger(__name__)


class Replica:
    """One engine behind the gateway, with its cache mirror, KV ledger and health.

    Invariant: while :attr:`dead` is set the replica refuses work; it is cleared only by
    :meth:`revive` (an engine that reports health, such as a remote server that came back); the
    stall watchdog runs only while the replica has requests in flight and is not draining.

    Args:
        engine: The engine.
        config: The gateway's configuration (KV budget, watermark, lookahead, output reserve,
            stats age, stall timeout, key seed).
        clock: The gateway's clock.

    Attributes:
        engine: The engine.
        mirror: What the engine's prefix cache holds, as far as the gateway can tell.
        admission: Its KV block ledger and the rule that decides what fits.
        slots: The engine's ``max_num_seqs``, or ``None`` if it has no such limit.
        completion: Reads the engine's outputs (:meth:`Engine.completion`).
        dead: Why the engine died, once it did.
        draining: Its gateway is closing: the watchdog stops at its next tick.
        outputs: Outputs streamed so far: the watchdog's sign of progress.
    """

    def __init__(self, engine: Engine, config: GatewayConfig, clock: Clock) -> None:
        self.engine = engine
        self.config = config
        self.clock = clock
        self.loop_lag = LoopLag(active=lambda: bool(self._running))
        """How late the event loop is, measured while requests are in flight (real clock only):
        KV stats that are late because the loop was are not taken for a silent engine."""
        self.mirror = PrefixMirror(engine.num_blocks, in_use=lambda keys: self.admission.ledger.held(keys))
        capacity = int(engine.num_blocks * config.kv_budget)
        self.admission = Admission(
            BlockLedger(capacity, int(capacity * config.kv_lookahead)), block_size=engine.block_size,
            output_reserve=config.output_reserve,
            default_output_tokens=config.default_output_tokens,
            watermark_blocks=int(engine.num_blocks * config.kv_watermark),
            stats_max_age=max(config.stats_max_age, getattr(engine, "stats_max_age", 0.0) or 0.0),
            kv_stats=engine.kv_stats, clock=clock,
            max_model_len=engine.max_model_len,
            loop_lag=self.loop_lag.lag_since if isinstance(clock, MonotonicClock) else None)
        self.slots: int | None = engine_slots(engine)
        self.completion = completion_reader(engine)
        self.dead: EngineDead | None = None
        self.draining = False
        self.outputs = 0
        self._running: Collection[Ticket] = ()
        self._on_stall: Callable[[Ticket, PrefixgateError], None] | None = None
        self._watchdog: asyncio.Task[None] | None = None  # on virtual and fake clocks
        self._watch_timer: asyncio.TimerHandle | None = None  # on the real clock
        self._stall_mark: tuple[Any, float] = (None, 0.0)  # (last progress seen, since when)
        self.cache_follower: CacheFollower | None = None
        """Keeps :attr:`mirror` in step with the engine's cache events, when it publishes them."""
        self._unfollow: Callable[[], None] | None = None

    # -- health -----------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raises :class:`EngineDead` if the engine has died."""
        if self.dead is not None:
            raise EngineDead("the engine has died") from self.dead.__cause__

    def mark_dead(self, error: EngineDead) -> bool:
        """Notes that the engine died of ``error``; ``True`` the first time only."""
        if self.dead is not None:
            return False
        self.dead = error
        return True

    def revive(self) -> bool:
        """Takes a dead engine back once it reports healthy again; ``True`` if it was dead. Its
        cache mirror starts empty: what the engine holds after an outage is unknown (a restarted
        server holds nothing)."""
        if self.dead is None:
            return False
        self.dead = None
        self.mirror.clear()  # in place: the scheduler and placement read this same mirror
        if self.cache_follower is not None:
            self.cache_follower.reset()
        return True

    def watch(self, running: Collection[Ticket],
              on_stall: Callable[[Ticket, PrefixgateError], None]) -> None:
        """Tells the stall watchdog what this replica runs (a live collection) and how to end a
        request the engine stalls on."""
        self._running = running
        self._on_stall = on_stall

    def arm_watchdog(self) -> None:
        """Starts watching for stalls while requests are in flight: a loop timer on the real
        clock (nothing to clean up), a task sleeping on a virtual or fake clock."""
        if isinstance(self.clock, MonotonicClock):
            self.loop_lag.arm()
        stall = self.config.stall_timeout
        if stall is None or self._watchdog is not None or self._watch_timer is not None:
            return
        self._stall_mark = (None, self.clock.now())
        if isinstance(self.clock, MonotonicClock):
            self._watch_timer = asyncio.get_running_loop().call_later(stall / 4, self._watch_tick)
        else:
            self._watchdog = asyncio.ensure_future(self._watch_task(stall))

    def _watch_tick(self) -> None:
        self._watch_timer = None
        if self._running and not self.draining:
            self.check_stall()
            stall = self.config.stall_timeout
            assert stall is not None
            self._watch_timer = asyncio.get_running_loop().call_later(stall / 4, self._watch_tick)

    async def _watch_task(self, stall_timeout: float) -> None:
        try:
            while self._running and not self.draining:
                await self.clock.sleep(stall_timeout / 4)
                self.check_stall()
        finally:
            if self._watchdog is asyncio.current_task():
                self._watchdog = None

    def check_stall(self) -> None:
        """Ends what the engine holds if it made no progress (no output and no scheduler step)
        for ``stall_timeout`` seconds while requests were in flight."""
        stall = self.config.stall_timeout
        if stall is None or not self._running or self._on_stall is None:
            return
        stats = self.engine.kv_stats()
        progress = (self.outputs, stats.steps if stats is not None else 0)
        last, since = self._stall_mark
        now = self.clock.now()
        if progress != last:
            self._stall_mark = (progress, now)
        elif now - since > stall:
            log.warning("prefixgate: the engine made no progress for %.1f s; failing the %d requests "
                        "in flight", now - since, len(self._running))
            for ticket in list(self._running):
                self._on_stall(ticket, EngineStalled(f"no progress from the engine for {now - since:.1f} s "
                                                     f"(stall_timeout {stall:g} s)"))
            self._stall_mark = (progress, now)

    def idle(self) -> None:
        """Nothing runs any more: a watchdog task on a virtual clock must not be left pending
        (the loop's heartbeat stops itself at its next beat)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def disarm_watchdog(self) -> None:
        """Stops the watchdog and the loop's heartbeat, whatever the clock."""
        self.idle()
        self.loop_lag.disarm()
        if self._watch_timer is not None:
            self._watch_timer.cancel()
            self._watch_timer = None

    # -- the cache mirror -------------------------------------------------------------------

    def follow_cache_events(self, root_for: Callable[[str | None, str | None], BlockHash | None]) -> bool:
        """Has the mirror follow what the engine reports it caches and evicts
        (:mod:`prefixgate.cache_events`), if it reports it (an engine with
        ``add_cache_listener`` that publishes events); returns whether it does. ``root_for``
        gives the gateway's namespace root for a cache salt and LoRA name."""
        add = getattr(self.engine, "add_cache_listener", None)
        if add is None or self._unfollow is not None:
            return self._unfollow is not None
        follower = CacheFollower(self.mirror, self.engine.block_size, root_for,
                                 limit=4 * max(1, self.engine.num_blocks))
        remove = add(follower.apply)
        if remove is None:
            return False
        self.cache_follower, self._unfollow = follower, remove
        return True

    def unfollow_cache_events(self) -> None:
        """Stops following the engine's cache events (the gateway closed). Idempotent."""
        remove, self._unfollow = self._unfollow, None
        if remove is not None:
            remove()

    def cache_output(self, ticket: Ticket) -> None:
        """Records a completed ticket's blocks as most recently used in the mirror (freed now,
        as in vLLM's LRU). The engine also caches full blocks of the output (all but the last
        token's KV is computed): a follow-up turn that repeats them hits. Only the blocks past
        the prompt's chain are hashed."""
        known = ticket.block_hashes
        size = self.engine.block_size
        rest = ticket.prompt_token_ids[len(known) * size :]
        if len(rest) + len(ticket.output_token_ids) - 1 >= size:
            root = known[-1] if known else ticket.namespace.root(self.config.key_seed)
            tail = pack_tokens(rest) + pack_tokens(ticket.output_token_ids[:-1])
            extras = media_extras([(m.position, m.identifier) for m in ticket.media or ()
                                   if m.position is not None], size, start=len(known))
            known = (*known, *chain_hashes(tail, size, root, extras=extras))
        self.mirror.insert(known)

    def __repr__(self) -> str:
        state = "dead" if self.dead is not None else "draining" if self.draining else "alive"
        return f"Replica({self.engine!r}, {state}, {self.admission.ledger!r}, {self.mirror!r})"
