"""Cancellation at every await: nothing leaks, the engine request is aborted, the next one runs.

Each test ends by checking the same invariants: the gateway holds no ticket (queued or running),
the request id is free again, and the engine runs nothing for us.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from prefixgate import Gateway, GatewayConfig, Outcome, ShuttingDown
from prefixgate.testing import FakeClock, FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=50)


def assert_nothing_held(gw: Gateway, engine: FakeEngine) -> None:
    stats = gw.statistics()
    assert stats.queued == 0 and stats.running == 0
    assert gw._live == {}
    assert engine.running == set()


async def spin(n: int = 0) -> None:
    await run_until_idle()


async def test_cancelling_the_consumer_mid_stream_aborts_the_engine_request():
    engine = FakeEngine(step=asyncio.Event())
    gw = Gateway(engine)
    got = []

    async def consume():
        async for out in gw.generate("prompt", SP, request_id="c1"):
            got.append(out)
            engine.step.clear()

    engine.step.set()
    task = asyncio.create_task(consume())
    await spin()
    assert engine.running == {"c1"} and len(got) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "c1" in engine.aborted
    assert_nothing_held(gw, engine)
    assert gw.statistics().outcomes == {"cancelled": 1}


async def test_closing_the_stream_early_aborts_and_frees_the_window():
    engine = FakeEngine()
    gw = Gateway(engine, GatewayConfig(max_in_flight=1))
    stream = gw.generate("prompt", SP, request_id="early")
    async for _ in stream:
        break
    await stream.aclose()
    assert engine.aborted == ["early"]
    assert_nothing_held(gw, engine)
    outs = [o async for o in gw.generate("next", FakeSamplingParams(max_tokens=2))]
    assert outs[-1].finished


async def test_async_with_closes_the_stream():
    engine = FakeEngine()
    gw = Gateway(engine)
    async with gw.generate("prompt", SP, request_id="ctx") as stream:
        await stream.__anext__()
    assert engine.aborted == ["ctx"]
    assert_nothing_held(gw, engine)


async def test_an_abandoned_stream_is_aborted_when_collected():
    engine = FakeEngine()
    gw = Gateway(engine)

    async def leave_early():
        async for _ in gw.generate("prompt", SP, request_id="gc"):
            return

    await leave_early()
    gc.collect()
    await spin(10)
    assert engine.aborted == ["gc"]
    assert_nothing_held(gw, engine)


async def test_cancelling_while_queued_dequeues_without_touching_the_engine():
    engine = FakeEngine(step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", max_in_flight=1))
    first = asyncio.create_task(gw.generate("first", SP, request_id="a").__anext__())
    queued = asyncio.create_task(gw.generate("second", SP, request_id="b").__anext__())
    await spin()
    assert gw.statistics().queued == 1
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert gw.statistics().queued == 0 and engine.started == ["a"]
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert_nothing_held(gw, engine)
    assert gw.statistics().outcomes == {"cancelled": 2}


async def test_a_stream_never_iterated_holds_nothing():
    engine = FakeEngine()
    gw = Gateway(engine)
    stream = gw.generate("never", SP, request_id="n")
    await stream.aclose()
    assert engine.started == [] and gw.statistics().requests == 0
    assert_nothing_held(gw, engine)


async def test_stopping_at_the_finished_output_counts_as_completed():
    engine = FakeEngine()
    gw = Gateway(engine)
    stream = gw.generate("done", FakeSamplingParams(max_tokens=2))
    async for out in stream:
        if out.finished:
            break
    await stream.aclose()
    assert engine.aborted == []
    assert stream.ticket.outcome is Outcome.COMPLETED


@pytest.mark.vllm
async def test_cancelled_consumer_leaves_no_running_request_in_vllm(vllm_engine):
    from vllm import SamplingParams

    llm = vllm_engine.vllm_engine
    gw = Gateway(vllm_engine)
    got = []

    async def consume():
        sp = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0)
        async for out in gw.generate("Tell me a long story. " * 20, sp, request_id="vllm-cancel"):
            got.append(out)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.01)
    assert llm.get_num_unfinished_requests() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):  # the engine core confirms the abort asynchronously
        if llm.get_num_unfinished_requests() == 0 and vllm_engine.kv_stats().running == 0:
            break
        await asyncio.sleep(0.02)
    assert llm.get_num_unfinished_requests() == 0
    assert vllm_engine.kv_stats().running == 0
    assert gw.statistics().outcomes == {"cancelled": 1} and gw._live == {}


async def test_closing_with_a_timeout_aborts_what_still_runs():
    clock = FakeClock()
    engine = FakeEngine(clock=clock, output_time=1.0)
    gw = Gateway(engine, clock=clock)
    task = asyncio.create_task(drain_all(gw.generate("slow", SP, request_id="slow")))
    await spin()
    closing = asyncio.create_task(gw.aclose(timeout=5.0))
    await spin()
    await clock.advance(5.0)
    await closing
    assert engine.aborted[0] == "slow"
    await clock.advance(1.0)
    with pytest.raises(ShuttingDown):
        await task
    assert_nothing_held(gw, engine)
    assert gw.statistics().outcomes == {"shutting_down": 1}


async def test_an_engine_side_abort_is_an_explicit_error_not_a_completion():
    from prefixgate import EngineError
    from prefixgate.sim import SimEngine

    sim = SimEngine(block_size=4, num_blocks=64, max_model_len=128)
    gw = Gateway(sim, clock=sim.clock)
    stream = gw.generate("abort me from the engine side", FakeSamplingParams(max_tokens=20))
    with pytest.raises(EngineError, match="aborted"):
        async for _ in stream:
            await sim.abort(stream.request_id)
    assert stream.ticket.outcome is Outcome.ENGINE_ERROR
    assert gw.statistics().outcomes == {"engine_error": 1}


async def drain_all(stream):
    return [o async for o in stream]
