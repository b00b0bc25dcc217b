"""Admission known before the first output (``Gateway.submit``), and a queue bound that counts
what still waits after the dispatch decision, not same-tick arrivals."""

from __future__ import annotations

import asyncio
import gc

import pytest

from prefixgate import Gateway, GatewayConfig, QueueFull
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=2)


async def drain(stream):
    return [out async for out in stream]


async def settle() -> None:
    await run_until_idle()


@pytest.fixture
def engine():
    return FakeEngine(block_size=4, max_model_len=64)


async def test_submit_raises_queue_full_before_any_engine_call_or_output(engine):
    engine.step = asyncio.Event()  # the engine holds every request until released
    config = GatewayConfig(ordering="fcfs", max_in_flight=1, max_queue_len=1)
    async with Gateway(engine, config) as gw:
        first = await gw.submit("first", SP, request_id="a")
        second = await gw.submit("second", SP, request_id="b")
        assert first.entered and second.entered and first.ticket is not None
        with pytest.raises(QueueFull) as info:
            await gw.submit("third", SP, request_id="c")
        assert info.value.reason == "queue_full" and info.value.retry_after > 0
        assert engine.started == []  # nothing reached the engine: nobody iterates yet
        assert gw.statistics().refused == {"queue_full": 1}
        tasks = [asyncio.create_task(drain(s)) for s in (first, second)]
        await settle()
        engine.step.set()
        outs = await asyncio.gather(*tasks)
        again = await drain(await gw.submit("third", SP, request_id="c"))  # its id is free again
    assert engine.started == ["a", "b", "c"]
    assert [o[-1].finished for o in outs] == [True, True] and again[-1].finished
    assert gw.statistics().outcomes == {"completed": 3}


async def test_a_submitted_stream_closed_or_dropped_unread_frees_its_place(engine):
    engine.step = asyncio.Event()
    config = GatewayConfig(ordering="fcfs", max_in_flight=1, max_queue_len=1)
    async with Gateway(engine, config) as gw:
        running = await gw.submit("running", SP, request_id="a")
        task = asyncio.create_task(drain(running))
        await settle()
        queued = await gw.submit("queued", SP, request_id="b")
        assert gw.statistics().queued == 1
        await queued.aclose()  # never iterated: dequeued, its id free
        assert gw.statistics().queued == 0
        dropped = await gw.submit("dropped", SP, request_id="b")
        del dropped
        gc.collect()
        assert gw.statistics().queued == 0
        late = await gw.submit("late", SP, request_id="b")  # the queue has room again
        engine.step.set()
        await task
        await drain(late)
    assert engine.started == ["a", "b"]
    assert gw.statistics().outcomes == {"completed": 2, "cancelled": 2}


@pytest.mark.parametrize("how", ["generate", "submit"])
async def test_a_burst_an_idle_gateway_can_run_is_not_refused_by_a_short_queue(engine, how):
    config = GatewayConfig(max_in_flight=128, max_queue_len=10)
    async with Gateway(engine, config) as gw:
        if how == "generate":
            streams = [gw.generate(f"prompt {i}", SP) for i in range(40)]
        else:
            streams = await asyncio.gather(*(gw.submit(f"prompt {i}", SP) for i in range(40)))
        outs = await asyncio.gather(*(drain(s) for s in streams))
    assert all(o[-1].finished for o in outs)
    stats = gw.statistics()
    assert stats.refused == {} and stats.outcomes == {"completed": 40}


async def test_sampling_parameters_as_a_mapping_are_built_by_the_engine(engine):
    from prefixgate import InvalidRequest

    async with Gateway(engine) as gw:
        outs = await drain(gw.generate("hello", {"max_tokens": 3}))
        with pytest.raises(InvalidRequest, match="invalid sampling parameters"):
            gw.generate("hello", {"max_tokens": 3, "no_such_field": 1})
        with pytest.raises(InvalidRequest):
            gw.generate("hello", {"max_tokens": 0})
    assert outs[-1].finished and len(outs) == 3
