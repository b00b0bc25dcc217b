"""Per-tenant request rates on the gateway's clock: a GCRA limiter with a FIFO of waiters.

The generic cell rate algorithm (virtual scheduling) admits a request when the clock has reached
its theoretical arrival time less a burst tolerance, then moves that time on by one interval
(``1 / rate``). Over any long span it admits ``rate`` requests per second exactly (1.5/s is
1.5/s, not 2/s), and after an idle spell up to ``burst`` at once. Waiters queue in arrival order
and are woken one per slot, by one timer on the gateway's clock, so the simulator's virtual time
and ``FakeClock`` drive it like real time.

asyncio-throttle, which this module wrapped before, reads ``time.monotonic``, polls every 10 ms
and counts whole requests per window (so 1.5/s enforced 2/s); reading its private log on our
clock was the only way to reuse it, so the limiter is written here instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Iterator, Mapping

from .clock import Clock
from .config import TenantLimits

__all__ = ["RateLimiter", "TenantThrottles"]


class RateLimiter:
    """``rate`` requests per second for one tenant.

    Invariant: over any span of ``t`` seconds at most ``burst + rate * t`` acquisitions succeed;
    waiters are served in the order they began to wait.

    Args:
        rate: Requests per second (fractions are exact: 0.5 is one every two seconds).
        clock: The gateway's clock.
        burst: Requests that may go at once after an idle spell; ``max(1, floor(rate))`` when
            ``None`` (a one-second window's worth).

    Raises:
        ValueError: If ``rate`` is not positive or ``burst`` is below 1.
    """

    def __init__(self, rate: float, clock: Clock, burst: int | None = None) -> None:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"rate must be a positive finite number, got {rate!r}")
        self.rate = rate
        self.clock = clock
        self.burst = max(1, math.floor(rate)) if burst is None else burst
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst!r}")
        self.interval = 1.0 / rate
        self._tolerance = (self.burst - 1) * self.interval
        self._tat = clock.now()  # theoretical arrival time of the next request
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.Task[None] | None = None
        self.acquired = 0

    @property
    def waiting(self) -> int:
        """Callers waiting in :meth:`acquire`."""
        return len(self._waiters)

    def retry_after(self) -> float:
        """Seconds until a new request would be admitted (0 if now, and nobody waits ahead)."""
        ahead = len(self._waiters) * self.interval
        return max(0.0, self._tat - self._tolerance - self.clock.now()) + ahead

    def idle(self) -> bool:
        """Whether forgetting this limiter would change nothing: no waiters and a full burst."""
        return not self._waiters and self._tat <= self.clock.now()

    def try_acquire(self) -> bool:
        """Takes a slot if one is free now and nobody waits ahead; never waits."""
        return not self._waiters and self._take()

    def _take(self) -> bool:
        now = self.clock.now()
        if now < self._tat - self._tolerance:
            return False
        self._tat = max(self._tat, now) + self.interval
        self.acquired += 1
        return True

    async def acquire(self) -> None:
        """Waits for a slot, behind everyone already waiting. Cancellation leaves the queue."""
        if self.try_acquire():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._arm()
        try:
            await waiter
        except BaseException:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            self._arm()
            raise

    def _arm(self) -> None:
        if self._waiters and (self._timer is None or self._timer.done()):
            self._timer = asyncio.ensure_future(self._wake())

    async def _wake(self) -> None:
        while self._waiters:
            delay = self._tat - self._tolerance - self.clock.now()
            if delay > 0:
                await self.clock.sleep(delay)
            while self._waiters and self._waiters[0].done():  # cancelled while waiting
                self._waiters.popleft()
            if self._waiters and self._take():
                self._waiters.popleft().set_result(None)

    def close(self, error: BaseException) -> None:
        """Stops the timer; every waiter's :meth:`acquire` raises ``error``."""
        if self._timer is not None:
            self._timer.cancel()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def __repr__(self) -> str:
        return (f"RateLimiter({self.rate:g}/s, burst={self.burst}, waiting={len(self._waiters)}, "
                f"acquired={self.acquired})")


class TenantThrottles:
    """Each rate-limited tenant's :class:`RateLimiter`, made at its first request.

    Bound: an API key is a tenant, and there may be millions; beyond ``max_entries`` limiters,
    the idle ones (those a fresh limiter would equal) are dropped before a new one is made.

    Args:
        tenants: Per-tenant limits; others (and ``None``) get ``default``.
        default: Limits of tenants not in ``tenants``.
        clock: The gateway's clock.
        max_entries: Limiters kept before idle ones are dropped.
    """

    def __init__(self, tenants: Mapping[str, TenantLimits], default: TenantLimits, clock: Clock,
                 max_entries: int = 4096) -> None:
        self.tenants = tenants
        self.default = default
        self.clock = clock
        self.max_entries = max_entries
        self._limiters: dict[str | None, RateLimiter] = {}

    def limits(self, tenant: str | None) -> TenantLimits:
        """``tenant``'s limits."""
        return self.tenants.get(tenant, self.default) if tenant else self.default

    def get(self, tenant: str | None) -> RateLimiter | None:
        """``tenant``'s limiter, or ``None`` if its rate is unlimited."""
        limits = self.limits(tenant)
        if limits.rate is None:
            return None
        limiter = self._limiters.get(tenant)
        if limiter is None:
            if len(self._limiters) >= self.max_entries:  # forget tenants a fresh limiter would equal
                self._limiters = {t: th for t, th in self._limiters.items() if not th.idle()}
            limiter = self._limiters[tenant] = RateLimiter(limits.rate, self.clock, limits.burst)
        return limiter

    def close(self, error: BaseException) -> None:
        """Ends every waiter of every limiter with ``error``."""
        for limiter in self._limiters.values():
            limiter.close(error)

    def __len__(self) -> int:
        return len(self._limiters)

    def __iter__(self) -> Iterator[RateLimiter]:
        return iter(self._limiters.values())

    def __repr__(self) -> str:
        return f"TenantThrottles({len(self._limiters)} tenants, max {self.max_entries})"
