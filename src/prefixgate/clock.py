"""Injected time: a ``Clock`` protocol, the real monotonic clock and a manual fake for tests."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "MonotonicClock"]


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
        """Moves time forward by ``seconds`` and lets every sleeper due by then run."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards (seconds={seconds})")
        target = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
            for _ in range(3):  # let the woken task and what it wakes run before moving on
                await asyncio.sleep(0)
        self._now = target
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now:.3f}, sleepers={len(self._sleepers)})"
