"""Injected time: a ``Clock`` protocol, the real monotonic clock, and two clocks for tests.

:class:`FakeClock` moves only when told to; :class:`AutoClock` (the simulator's clock) moves by
itself, to the next sleeper's deadline, whenever every task on the event loop is blocked.
:func:`run_until_idle` waits until every other task is blocked, without moving any clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["AutoClock", "Clock", "FakeClock", "LoopLag", "MonotonicClock", "run_until_idle"]


@runtime_checkable
class Clock(Protocol):
    """Where the gateway reads time and sleeps. Seconds, monotonic, arbitrary origin."""

    def now(self) -> float:
        """The current time in seconds."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspends the caller for ``seconds`` of this clock's time."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def __repr__(self) -> str:
        return "MonotonicClock()"


class FakeClock:
    """A clock that moves only when told to; sleepers wake when :meth:`advance` passes them.

    Invariant: ``now()`` never decreases, and a sleeper is woken exactly once, in deadline order.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    async def advance(self, seconds: float) -> None:
        """Moves time forward by ``seconds``; after each sleeper due by then wakes, and at the
        end, every task runs until it blocks (:func:`run_until_idle`) before time moves on."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards (seconds={seconds})")
        target = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
                await run_until_idle()  # the woken task and what it wakes, before moving on
        self._now = target
        await run_until_idle()

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now:.3f}, sleepers={len(self._sleepers)})"


def _ready_queue(loop: asyncio.AbstractEventLoop) -> deque[Any] | None:
    """The loop's queue of ready callbacks (CPython 3.11-3.13's private ``_ready`` deque), or
    ``None`` where it cannot be read (uvloop)."""
    ready = getattr(loop, "_ready", None)
    return ready if isinstance(ready, deque) else None


def _only_probes(ready: deque[Any], *, defer_to_idle: bool) -> bool:
    """Whether nothing but probes is ready (an idle probe counts as work when deferring to it)."""
    for handle in ready:
        callback = getattr(handle, "_callback", None)
        if callback is _idle_probe:
            if defer_to_idle:
                return False
        elif callback is not _clock_probe and not handle.cancelled():
            return False
    return True


def _probe(probe: Callable[..., None], done: asyncio.Future[None], ready: deque[Any] | None, left: int,
           *, defer_to_idle: bool) -> None:
    """One turn of a probe: sets ``done`` once nothing but probes is ready, or re-queues ``probe``."""
    if done.done():
        return
    if ready is not None:
        if _only_probes(ready, defer_to_idle=defer_to_idle):
            done.set_result(None)
            return
    elif left <= 0:  # pragma: no cover - non-CPython event loops
        done.set_result(None)
        return
    done.get_loop().call_soon(probe, done, ready, left - 1)


def _clock_probe(done: asyncio.Future[None], ready: deque[Any] | None, left: int) -> None:
    """A callback that re-queues itself until nothing but probes is ready, then sets ``done``.

    Being a plain callback, not a task step, it lets the probes of several clocks sharing one
    loop recognise each other instead of each seeing the other as pending work. It yields to a
    pending :func:`run_until_idle`, so time never moves while one waits. (Probes are told apart
    by function identity, hence two thin functions over :func:`_probe`.)
    """
    _probe(_clock_probe, done, ready, left, defer_to_idle=True)


def _idle_probe(done: asyncio.Future[None], ready: deque[Any] | None, left: int) -> None:
    """As :func:`_clock_probe`, for :func:`run_until_idle`: clocks' probes do not count as work."""
    _probe(_idle_probe, done, ready, left, defer_to_idle=False)


async def run_until_idle(*, fallback_yields: int = 64) -> None:
    """Returns once every other task on the running loop is blocked: nothing is ready to run.

    Use it in tests instead of loops of ``await asyncio.sleep(0)``: after it, every request you
    started has gone as far as it can (queued, dispatched, waiting on the engine or on a clock).
    No clock moves while it waits, an :class:`AutoClock` included; to let time pass, sleep on
    the clock (``AutoClock``) or ``advance`` it (``FakeClock``). Work outside the loop (threads,
    processes, sockets, real timers) is not waited for.

    Args:
        fallback_yields: On loops whose ready queue cannot be read (uvloop), yields that stand
            for "idle" (enough for shallow await chains only).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.call_soon(_idle_probe, done, _ready_queue(loop), fallback_yields)
    await done


class AutoClock:
    """Virtual time that moves by itself: when every task on the event loop is blocked, ``now``
    jumps to the earliest pending :meth:`sleep` deadline and that sleeper wakes.

    The simulator runs on it (``prefixgate.sim.SimClock`` is this class), and so can your tests:
    pass one to :class:`~prefixgate.Gateway` and :class:`~prefixgate.testing.FakeEngine`
    (``FakeEngine(clock=clock, output_time=1.0)``), and ``await clock.sleep(5)`` lets exactly
    5 s of virtual time pass, every timer due on the way (queue timeouts, rate limits, engine
    outputs) firing in order, with no ``advance`` calls and no ``sleep(0)`` spins. Sleepers due
    at the same instant wake in the order they began sleeping, so a timer due exactly when your
    sleep ends but set after it began fires just after your sleep returns.

    Pending events are the deadlines of :meth:`sleep` calls. A driver task waits until the loop
    is *quiescent* (no callback ready to run: every task is blocked on a future), then moves
    ``now`` to the earliest deadline and wakes that one sleeper, and repeats; when nothing
    sleeps it exits, and the next :meth:`sleep` restarts it.

    Quiescence is read from the loop's ready queue (``loop._ready``, private but a plain deque
    of ``Handle`` objects in CPython 3.11-3.13) by a probe callback that re-queues itself until
    only probes (of this or another ``AutoClock`` on the same loop) are ready. On loops without
    it (uvloop), the probe re-queues ``fallback_yields`` times instead, which is enough for
    shallow await chains only. Work outside the loop (threads, subprocesses, sockets, real
    timers) is not waited for: code under test must take all its time from this clock.

    Invariants: ``now()`` never decreases; it changes only while the loop is quiescent (and no
    :func:`run_until_idle` is waiting); sleepers wake in deadline order, ties in the order they
    began sleeping, one at a time.

    Args:
        start: The initial time in seconds.
        fallback_yields: Yields that stand for quiescence when the ready queue is unreadable.
    """

    def __init__(self, start: float = 0.0, *, fallback_yields: int = 16) -> None:
        self._now = float(start)
        self._events: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._cancelled = 0
        self._driver: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fallback_yields = fallback_yields
        self.events_fired = 0

    def now(self) -> float:
        """The current virtual time in seconds."""
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Suspends the caller until virtual time reaches ``now() + seconds``.

        ``sleep(0)`` is a barrier: it returns at the same virtual time, after every other task
        has run until it blocks.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop: events of the old one can never fire
            self._loop, self._events, self._driver, self._cancelled = loop, [], None, 0
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._events, (self._now + max(0.0, seconds), self._seq, fut))
        self._seq += 1
        if self._driver is None:
            self._driver = loop.create_task(self._drive(loop))
        try:
            await fut
        except asyncio.CancelledError:
            self._cancelled += 1
            if self._cancelled > 1024 and self._cancelled * 2 > len(self._events):
                self._events = [e for e in self._events if not e[2].done()]
                heapq.heapify(self._events)
                self._cancelled = 0
            raise

    async def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        ready = _ready_queue(loop)
        try:
            while True:
                quiescent: asyncio.Future[None] = loop.create_future()
                loop.call_soon(_clock_probe, quiescent, ready, self._fallback_yields)
                await quiescent
                events = self._events
                while events and events[0][2].done():  # cancelled sleepers: no time passes
                    heapq.heappop(events)
                if not events:
                    return
                when, _, fut = heapq.heappop(events)
                if when > self._now:
                    self._now = when
                self.events_fired += 1
                fut.set_result(None)
        finally:
            if self._driver is asyncio.current_task():
                self._driver = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(now={self._now:.6f}, pending={len(self._events)})"


class LoopLag:
    """How late the running event loop is: a heartbeat every ``period`` seconds while armed.

    Everything the gateway learns from an in-process engine (outputs, per-step KV stats) arrives
    as callbacks on the loop it runs on; when the loop is busy for seconds (one Python process
    driving engines and a gateway through a burst), news from the engine is late by as much,
    though the engine is fine. :meth:`lag_since` says how late the loop has been, so that stats
    are not taken for a silent engine when the loop was the one that could not listen.

    Args:
        period: Seconds between heartbeats.
        active: Whether to keep beating: checked at each heartbeat, which stops when it says
            no (so arming it again for every request of a steady stream costs nothing); always,
            when ``None``, until :meth:`disarm`.
    """

    __slots__ = ("_active", "_due", "_handle", "_marks", "period")

    def __init__(self, period: float = 0.1, active: Callable[[], bool] | None = None) -> None:
        self.period = period
        self._active = active
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._marks: deque[tuple[float, float]] = deque(maxlen=256)

    @property
    def armed(self) -> bool:
        """Whether the heartbeat is running."""
        return self._handle is not None

    def arm(self) -> None:
        """Starts the heartbeat on the running loop (until :meth:`disarm`). Idempotent."""
        if self._handle is None:
            self._due = time.monotonic() + self.period
            self._handle = asyncio.get_running_loop().call_later(self.period, self._tick)

    def disarm(self) -> None:
        """Stops the heartbeat."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.monotonic()
        self._marks.append((now, now - self._due))
        if self._active is not None and not self._active():
            self._handle = None
            return
        self._due = now + self.period
        self._handle = asyncio.get_running_loop().call_later(self.period, self._tick)

    def lag_since(self, since: float) -> float:
        """The most the loop was late (seconds, ``time.monotonic``) at heartbeats after
        ``since``, or by now for a heartbeat overdue now; 0 when not armed."""
        if self._handle is None:
            return 0.0
        now = time.monotonic()
        late = max(0.0, now - self._due)
        for at, lag in reversed(self._marks):
            if at < since:
                break
            late = max(late, lag)
        return late

    def __repr__(self) -> str:
        return f"LoopLag(period={self.period}, armed={self.armed})"
