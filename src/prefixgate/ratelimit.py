"""Per-tenant request rates: asyncio-throttle's sliding-window log on the gateway's clock.

asyncio-throttle keeps a log of recent acquisitions and admits while fewer than ``rate_limit``
fall inside ``period``. Its stock ``acquire`` reads ``time.monotonic`` and polls every 10 ms;
here the log is read on the injected :class:`~prefixgate.clock.Clock` (so the simulator's
virtual time works) and a waiter sleeps exactly until the oldest entry leaves the window.
"""

from __future__ import annotations

from asyncio_throttle import Throttler

from .clock import Clock

__all__ = ["TenantThrottle"]


class TenantThrottle(Throttler):
    """A sliding-window rate limit of ``rate`` requests per second.

    Invariant: at most ``rate_limit`` acquisitions lie within any ``period`` of clock time.

    Args:
        rate: Requests per second (fractions allowed: 0.5 means one every two seconds).
        clock: The gateway's clock.
    """

    def __init__(self, rate: float, clock: Clock) -> None:
        period = 1.0 if rate >= 1 else 1.0 / rate
        super().__init__(rate_limit=max(1, round(rate * period)), period=period)
        self.clock = clock

    def flush(self) -> None:
        now = self.clock.now()
        while self._task_logs and now - self._task_logs[0] >= self.period:
            self._task_logs.popleft()

    def try_acquire(self) -> bool:
        """Takes a slot if one is free now; never waits."""
        self.flush()
        if len(self._task_logs) < self.rate_limit:
            self._task_logs.append(self.clock.now())
            return True
        return False

    def retry_after(self) -> float:
        """Seconds until a slot frees (0 if one is free now)."""
        self.flush()
        if len(self._task_logs) < self.rate_limit:
            return 0.0
        return self._task_logs[0] + self.period - self.clock.now()

    def in_window(self) -> int:
        """Acquisitions still inside the sliding window."""
        self.flush()
        return len(self._task_logs)

    async def acquire(self) -> None:
        while not self.try_acquire():
            await self.clock.sleep(max(self.retry_after(), 1e-6))

    def __repr__(self) -> str:
        return f"TenantThrottle({self.rate_limit}/{self.period:g}s, in_window={len(self._task_logs)})"
