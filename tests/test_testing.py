"""The testing story: ``run_until_idle`` instead of ``sleep(0)`` spins, and an ``AutoClock`` that
moves virtual time by itself, used with ``FakeEngine`` and a gateway as a user's tests would."""

from __future__ import annotations

import asyncio

from prefixgate import AutoClock, FakeClock, Gateway, GatewayConfig
from prefixgate.sim import SimClock
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle


async def drain(stream):
    return [o async for o in stream]


async def test_run_until_idle_waits_for_every_task_however_deep_its_chain_of_yields():
    reached: list[int] = []

    async def deep(n: int) -> None:
        for _ in range(n):  # far more plain yields than any fixed spin would cover
            await asyncio.sleep(0)
        reached.append(n)
        await asyncio.Event().wait()  # then blocks for good

    tasks = [asyncio.create_task(deep(n)) for n in (1, 200, 1000)]
    await run_until_idle()
    assert reached == [1, 200, 1000]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_no_clock_moves_while_run_until_idle_waits():
    clock = AutoClock()
    woke: list[float] = []

    async def sleeper() -> None:
        await clock.sleep(5.0)
        woke.append(clock.now())

    task = asyncio.create_task(sleeper())
    await run_until_idle()
    assert clock.now() == 0.0 and woke == []  # idle, yet the 5 s sleeper has not been woken
    await clock.sleep(5.0)  # now let time pass: the earlier sleeper wakes first, at 5.0
    await task
    assert woke == [5.0] and clock.now() == 5.0


async def test_the_simulators_clock_is_the_auto_clock():
    assert SimClock is AutoClock
    assert repr(AutoClock(start=2.0)) == "AutoClock(now=2.000000, pending=0)"


async def test_a_gateway_on_an_auto_clock_needs_no_advance_calls_and_no_spins():
    clock = AutoClock()
    engine = FakeEngine(clock=clock, output_time=1.0)  # one output per virtual second
    async with Gateway(engine, GatewayConfig(ordering="fcfs", max_in_flight=1,
                                             queue_timeout=3.5), clock=clock) as gw:
        tasks = [asyncio.create_task(drain(gw.generate(f"request {i}", FakeSamplingParams(2),
                                                       request_id=f"r{i}")))
                 for i in range(3)]
        await run_until_idle()
        stats = gw.statistics()
        assert (stats.running, stats.queued, clock.now()) == (1, 2, 0.0)
        await clock.sleep(2.5)  # r0 ended at t=2 after two outputs; r1 was dispatched then
        assert engine.started == ["r0", "r1"] and gw.statistics().completed == 1
        results = await asyncio.gather(*tasks, return_exceptions=True)
    # r2 would start at t=4, past its 3.5 s queue timeout: the timer fired in virtual time.
    assert [type(r).__name__ for r in results] == ["list", "list", "QueueTimeout"]
    assert clock.now() == 4.0


async def test_fake_clock_advance_finishes_what_a_woken_timer_sets_off_before_moving_on():
    clock = FakeClock()
    seen: list[tuple[str, float]] = []

    async def timer(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        for _ in range(100):  # a deep chain of plain yields after the wake-up
            await asyncio.sleep(0)
        seen.append((name, clock.now()))

    tasks = [asyncio.create_task(timer("a", 1.0)), asyncio.create_task(timer("b", 2.0))]
    await run_until_idle()
    await clock.advance(5.0)
    assert seen == [("a", 1.0), ("b", 2.0)]  # each finished at its own time, none left behind
    await asyncio.gather(*tasks)
