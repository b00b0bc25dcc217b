"""Dispatch pacing (``GatewayConfig.max_prefill_backlog``): requests handed to the engine and not
yet started hold at most that many prompt tokens to compute; each first output frees its share.
By default (``prefill_backlog_steps``) the cap is four of the engine's steps' worth of tokens
(``max_num_batched_tokens``), where the engine reports its step budget."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate import Gateway, GatewayConfig, Overloaded
from prefixgate.testing import FakeClock, FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=2)


async def drain(stream):
    return [o async for o in stream]


def prompts(n: int, size: int) -> list[str]:
    """``n`` prompts of ``size`` bytes (= tokens under the fake's byte tokenizer), no two alike
    from the first byte: nothing predicted cached."""
    return [(chr(ord("a") + i) * size) for i in range(n)]


async def held(backlog: int | None, texts: list[str]) -> tuple[Gateway, FakeEngine, list[asyncio.Task]]:
    """A gateway in front of an engine that produces no output until ``engine.step`` is set,
    with ``texts`` submitted at once."""
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(max_prefill_backlog=backlog, ordering="fcfs"))
    tasks = [asyncio.create_task(drain(gw.generate(t, SP, request_id=f"r{i}"))) for i, t in enumerate(texts)]
    await run_until_idle()
    return gw, engine, tasks


async def test_dispatch_stops_at_the_backlog_and_first_outputs_let_the_rest_go():
    gw, engine, tasks = await held(100, prompts(8, 40))
    # 40 tokens each: the third takes the backlog to 120 >= 100, then dispatch waits.
    assert engine.started == ["r0", "r1", "r2"]
    assert gw.statistics().blocked == "prefill_backlog" and gw.statistics().queued == 5
    engine.step.set()
    results = await asyncio.gather(*tasks)
    assert all(len(r) == 2 for r in results) and sorted(engine.started) == [f"r{i}" for i in range(8)]
    assert gw._scheduler.backlog == 0


async def test_a_first_output_lets_the_next_go_before_anything_completes():
    clock = FakeClock()
    engine = FakeEngine(block_size=4, clock=clock, output_time=1.0)  # an output a second
    gw = Gateway(engine, GatewayConfig(max_prefill_backlog=50, ordering="fcfs"), clock=clock)
    slow = FakeSamplingParams(max_tokens=10)
    tasks = [asyncio.create_task(drain(gw.generate(t, slow, request_id=f"r{i}")))
             for i, t in enumerate(prompts(4, 40))]
    await run_until_idle()
    assert engine.started == ["r0", "r1"]  # 80 >= 50
    await clock.advance(1.0)  # r0 and r1 have their first output, nine to go
    await run_until_idle()
    assert engine.started == ["r0", "r1", "r2", "r3"] and gw.statistics().running == 4
    await clock.advance(20.0)
    assert all(len(r) == 10 for r in await asyncio.gather(*tasks))
    assert gw._scheduler.backlog == 0


async def test_without_a_backlog_cap_the_burst_goes_at_once():
    gw, engine, tasks = await held(None, prompts(8, 40))
    assert len(engine.started) == 8 and gw.statistics().blocked is None
    engine.step.set()
    await asyncio.gather(*tasks)


async def test_a_prompt_longer_than_the_backlog_goes_when_nothing_is_pending():
    gw, engine, tasks = await held(10, prompts(3, 40))
    assert engine.started == ["r0"]
    engine.step.set()
    await asyncio.gather(*tasks)
    assert engine.started == ["r0", "r1", "r2"] and gw._scheduler.backlog == 0


async def test_predicted_hits_do_not_count():
    # Siblings of a loaded prefix count only their uncached tail: all fit a backlog the first
    # one alone fills.
    shared = "s" * 64
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(max_prefill_backlog=80, min_aging_wait=60))
    engine.step.set()
    await drain(gw.generate(shared + "warm", SP, request_id="warm"))
    engine.step.clear()
    tasks = [asyncio.create_task(drain(gw.generate(shared + f"q{i}", SP, request_id=f"q{i}")))
             for i in range(6)]
    await run_until_idle()
    assert len(engine.started) == 7  # each counts its 2 uncached tokens, not 66: all fit
    engine.step.set()
    await asyncio.gather(*tasks)


async def test_cancelling_a_dispatched_request_before_its_first_output_frees_its_share():
    gw, engine, tasks = await held(30, prompts(2, 40))
    assert engine.started == ["r0"]
    tasks[0].cancel()
    await run_until_idle()
    assert engine.aborted == ["r0"] and engine.started == ["r0", "r1"]
    engine.step.set()
    assert len(await tasks[1]) == 2
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert gw._scheduler.backlog == 0 and gw._live == {}


async def test_dispatch_now_refuses_while_the_backlog_is_full():
    gw, engine, tasks = await held(30, prompts(1, 40))
    assert engine.started == ["r0"]
    with pytest.raises(Overloaded) as e:
        gw.try_generate("z" * 8, SP, request_id="now")
    assert e.value.reason == "prefill_backlog"
    engine.step.set()
    await asyncio.gather(*tasks)


def test_the_backlog_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_backlog"):
        GatewayConfig(max_prefill_backlog=0)
    with pytest.raises(ValueError, match="prefill_backlog_steps"):
        GatewayConfig(prefill_backlog_steps=0)


async def burst(engine: FakeEngine, config: GatewayConfig, n: int = 8) -> tuple[Gateway, list[asyncio.Task]]:
    gw = Gateway(engine, config)
    tasks = [asyncio.create_task(drain(gw.generate(t, SP, request_id=f"r{i}")))
             for i, t in enumerate(prompts(n, 40))]
    await run_until_idle()
    return gw, tasks


async def test_by_default_the_backlog_is_four_engine_steps_of_prefill():
    engine = FakeEngine(block_size=4, step=asyncio.Event(), max_num_batched_tokens=25)
    gw, tasks = await burst(engine, GatewayConfig(ordering="fcfs"))
    # 4 * 25 = 100 tokens: the third prompt of 40 takes the backlog to 120, then dispatch waits.
    assert gw._scheduler.max_prefill_backlog == 100 and engine.started == ["r0", "r1", "r2"]
    assert gw.statistics().blocked == "prefill_backlog"
    engine.step.set()
    assert all(len(r) == 2 for r in await asyncio.gather(*tasks))
    assert gw._scheduler.backlog == 0


@pytest.mark.parametrize(("step_tokens", "config", "started"), [
    (25, GatewayConfig(ordering="fcfs", prefill_backlog_steps=None), 8),  # pacing off
    (25, GatewayConfig(ordering="fcfs", prefill_backlog_steps=1.5), 1),  # 38 tokens: one goes alone
    (25, GatewayConfig(ordering="fcfs", max_prefill_backlog=50), 2),  # an explicit cap wins
    (None, GatewayConfig(ordering="fcfs"), 8),  # an engine without a step budget is not paced
])
async def test_the_default_backlog_follows_the_engine_and_the_config(step_tokens, config, started):
    engine = FakeEngine(block_size=4, step=asyncio.Event(), max_num_batched_tokens=step_tokens)
    _, tasks = await burst(engine, config)
    assert len(engine.started) == started
    engine.step.set()
    assert all(len(r) == 2 for r in await asyncio.gather(*tasks))


async def test_each_replica_is_paced_by_its_own_engines_step_budget():
    engines = [FakeEngine(block_size=4, step=asyncio.Event(), max_num_batched_tokens=n) for n in (20, None)]
    gw = Gateway(engines, GatewayConfig(ordering="fcfs", placement="round_robin"))
    assert [u.scheduler.max_prefill_backlog for u in gw._router.units] == [80, None]
    tasks = [asyncio.create_task(drain(gw.generate(t, SP, request_id=f"r{i}")))
             for i, t in enumerate(prompts(8, 40))]
    await run_until_idle()
    assert [len(e.started) for e in engines] == [2, 4]
    for e in engines:
        e.step.set()
    assert all(len(r) == 2 for r in await asyncio.gather(*tasks))


async def test_each_replica_paces_its_own_backlog():
    engines = [FakeEngine(block_size=4, step=asyncio.Event()) for _ in range(2)]
    gw = Gateway(engines, GatewayConfig(max_prefill_backlog=50, ordering="fcfs", placement="round_robin"))
    tasks = [asyncio.create_task(drain(gw.generate(t, SP, request_id=f"r{i}")))
             for i, t in enumerate(prompts(8, 40))]
    await run_until_idle()
    assert [len(e.started) for e in engines] == [2, 2]  # 80 >= 50 on each, four queued on each
    for e in engines:
        e.step.set()
    assert all(len(r) == 2 for r in await asyncio.gather(*tasks))
    assert sorted(len(e.started) for e in engines) == [4, 4]
    assert [u.scheduler.backlog for u in gw._router.units] == [0, 0]
