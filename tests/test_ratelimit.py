"""Per-tenant rates: exact fractional rates, FIFO waiters woken once per slot, waiting counted as
queued and bounded by max_queue_len and queue_timeout, or refusal at once (``on_limit``)."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate import (
    AutoClock,
    FakeClock,
    Gateway,
    GatewayConfig,
    QueueFull,
    QueueTimeout,
    RateLimited,
    ShuttingDown,
    TenantLimits,
)
from prefixgate.ratelimit import RateLimiter
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=1)


async def drain(stream):
    return [o async for o in stream]



@pytest.mark.parametrize("rate", [1.5, 2.5, 0.4])
async def test_a_fractional_rate_holds_within_2_percent_over_600_s(rate):
    clock = AutoClock()  # 600 s of virtual time pass by themselves: no advance, no spins
    engine = FakeEngine()
    config = GatewayConfig(default_tenant_limits=TenantLimits(rate=rate), max_queue_len=100_000)
    async with Gateway(engine, config, clock=clock) as gw:
        tasks = [asyncio.create_task(drain(gw.generate(f"r{i}", SP, tenant="t"))) for i in range(2000)]
        await clock.sleep(600.0)
        await run_until_idle()
        served = len(engine.started)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    expected = rate * 600 + max(1, int(rate))  # the burst, then the rate
    assert abs(served - expected) <= 0.02 * expected, (served, expected)


async def test_waiters_are_served_in_arrival_order_with_one_wake_up_per_slot():
    clock = FakeClock()
    limiter = RateLimiter(2.0, clock, burst=1)
    order: list[int] = []

    async def one(i: int) -> None:
        await limiter.acquire()
        order.append(i)

    assert limiter.try_acquire()  # the burst
    tasks = [asyncio.create_task(one(i)) for i in range(5)]
    await run_until_idle()
    assert limiter.waiting == 5 and order == []
    for k in range(1, 6):
        await clock.advance(0.5)
        await run_until_idle()
        assert order == list(range(k))  # exactly one more per 0.5 s slot, in arrival order
    await asyncio.gather(*tasks)
    assert not limiter.try_acquire() and limiter.retry_after() == pytest.approx(0.5)


async def test_waiting_for_the_rate_is_bounded_by_max_queue_len_and_queue_timeout():
    clock = FakeClock()
    engine = FakeEngine()
    config = GatewayConfig(default_tenant_limits=TenantLimits(rate=1.0), max_queue_len=2,
                           queue_timeout=1.5)
    async with Gateway(engine, config, clock=clock) as gw:
        first = asyncio.create_task(drain(gw.generate("r0", SP, tenant="t")))
        waiting = [asyncio.create_task(drain(gw.generate(f"r{i}", SP, tenant="t"))) for i in (1, 2)]
        await run_until_idle()
        assert gw.statistics().queued == 2
        with pytest.raises(QueueFull):
            await gw.submit("r3", SP, tenant="t")
        await clock.advance(1.0)
        await run_until_idle()
        await asyncio.gather(first, waiting[0])
        await clock.advance(0.6)  # r2's 1.5 s are up before its slot at 2.0 s
        with pytest.raises(QueueTimeout):
            await waiting[1]
        stats = gw.statistics()
    assert len(engine.started) == 2 and stats.queued == 0
    assert stats.refused == {"queue_full": 1, "queue_timeout": 1}


async def test_on_limit_refuse_raises_rate_limited_at_once_with_retry_after():
    clock = FakeClock()
    engine = FakeEngine()
    config = GatewayConfig(tenants={"free": TenantLimits(rate=0.5, on_limit="refuse")})
    async with Gateway(engine, config, clock=clock) as gw:
        await drain(await gw.submit("ok", SP, tenant="free"))
        with pytest.raises(RateLimited) as info:
            await gw.submit("too soon", SP, tenant="free")
        assert info.value.retry_after == pytest.approx(2.0)
        await drain(gw.generate("other tenants are not limited", SP, tenant="paid"))
        await clock.advance(2.0)
        await drain(await gw.submit("on time", SP, tenant="free"))
    assert len(engine.started) == 3


async def test_closing_the_gateway_ends_rate_waiters_with_shutting_down():
    clock = FakeClock()
    gw = Gateway(FakeEngine(), GatewayConfig(default_tenant_limits=TenantLimits(rate=1.0)), clock=clock)
    await drain(gw.generate("takes the burst", SP, tenant="t"))
    waiter = asyncio.create_task(drain(gw.generate("waits", SP, tenant="t")))
    await run_until_idle()
    await gw.aclose()
    with pytest.raises(ShuttingDown):
        await waiter


def test_tenant_limits_are_validated():
    for bad in ({"rate": 0}, {"rate": float("inf")}, {"rate": 1, "burst": 0}, {"on_limit": "drop"}):
        with pytest.raises(ValueError, match="TenantLimits"):
            TenantLimits(**bad)
