"""Safe by default: no request can hang the gateway, every error is typed and on time.

One section per failure found at 4b29cb3 (issue "Safe by default"): oversized requests, hung
or dead engines, starvation under prefix ordering, unbounded state, wrong or late errors, retry
hints, and key namespaces. Each test failed there and passes now.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass

import pytest

import prefixgate.dispatch as dispatch_module
from prefixgate import (
    EngineError,
    Gateway,
    GatewayConfig,
    InvalidRequest,
    Namespace,
    Overloaded,
    QueueFull,
    RateLimited,
    ShuttingDown,
    block_hashes,
)
from prefixgate.config import TenantLimits
from prefixgate.errors import EngineStalled, RequestTooLarge, UsageError
from prefixgate.sim import SimEngine, StepTimeModel
from prefixgate.testing import FakeClock, FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=2)


async def drain(stream):
    return [o async for o in stream]


async def spin(n: int = 0) -> None:
    await run_until_idle()


def nothing_held(gw: Gateway) -> bool:
    s = gw.statistics()
    return s.queued == 0 and s.running == 0 and s.reserved_blocks == 0 and gw._live == {}


# -- 1. oversized requests ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1, 0, 0.5, True, "3"])
async def test_max_tokens_that_vllm_cannot_serve_are_invalid_at_the_call(bad):
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest, match="max_tokens"):
            gw.generate("hello", FakeSamplingParams(max_tokens=bad))
        assert nothing_held(gw) and gw.statistics().refused == {"invalid": 1}


async def test_a_huge_max_tokens_is_served_as_vllm_does_capped_at_the_context():
    engine = FakeEngine(block_size=4, num_blocks=64, max_model_len=64)
    async with Gateway(engine) as gw:
        stream = gw.generate("a short prompt", FakeSamplingParams(max_tokens=10**9))
        outs = await drain(stream)
        other = await drain(gw.generate("next request", SP))
        assert outs[-1].finished and other[-1].finished
        assert len(outs[-1].outputs[0].token_ids) == 64 - len("a short prompt")
        assert nothing_held(gw) and gw.statistics().completed == 2


async def test_without_max_tokens_the_ledger_reserves_up_to_the_context():
    engine = FakeEngine(block_size=4, num_blocks=64, max_model_len=64)
    async with Gateway(engine) as gw:
        ticket = gw.generate("0123456789", FakeSamplingParams(max_tokens=None)).ticket
        shared, private = gw._replica.admission.split(ticket)
    assert len(shared) == 2 and private == math.ceil((10 - 8 + 64 - 10) / 4)


async def test_what_can_never_fit_is_refused_with_the_limit_and_nothing_behind_it_hangs():
    # 4096-token model, block 16, kv_budget 0.5: the gateway reserves at most 128 blocks; a
    # 100-token prompt with 2,500 output tokens needs 163.
    engine = FakeEngine(block_size=16, num_blocks=256, max_model_len=4096, step=asyncio.Event())
    async with Gateway(engine, GatewayConfig(kv_budget=0.5)) as gw:
        first = asyncio.create_task(drain(gw.generate("x" * 40, FakeSamplingParams(max_tokens=8))))
        await spin()
        with pytest.raises(RequestTooLarge) as info:
            gw.generate("y" * 100, FakeSamplingParams(max_tokens=2500))
        assert info.value.limit == 128 and info.value.blocks == 163 and "at most 128" in str(info.value)
        queued = [asyncio.create_task(drain(gw.generate(f"q{i} " * 10, FakeSamplingParams(max_tokens=8))))
                  for i in range(3)]
        engine.step.set()
        await asyncio.gather(first, *queued)
        assert gw.statistics().completed == 4 and gw.statistics().refused == {"too_large": 1}
        assert nothing_held(gw)


async def test_a_reservation_that_fails_fails_only_its_own_request():
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    async with Gateway(engine, GatewayConfig(ordering="fcfs", max_in_flight=1)) as gw:
        ledger = gw._replica.admission.ledger
        reserve = ledger.reserve

        def flaky(ticket, shared, private):
            if ticket.request_id == "bad":
                raise ValueError("injected")
            return reserve(ticket, shared, private)

        ledger.reserve = flaky
        running = asyncio.create_task(drain(gw.generate("running one", SP, request_id="run")))
        await spin()
        bad = asyncio.create_task(drain(gw.generate("the bad one", SP, request_id="bad")))
        good = asyncio.create_task(drain(gw.generate("a good one", SP, request_id="good")))
        await spin()
        engine.step.set()  # "run" completes; the pump inside its release meets "bad"
        done_run, done_good = await asyncio.gather(running, good)
        with pytest.raises(EngineError, match="injected"):
            await bad
        assert done_run[-1].finished and done_good[-1].finished
        stats = gw.statistics()
        assert stats.outcomes == {"completed": 2, "engine_error": 1} and nothing_held(gw)


# -- 2. hung or dead engines --------------------------------------------------------------------


async def test_a_stalled_engine_fails_every_request_in_flight_within_the_stall_timeout():
    engine = FakeEngine(step=asyncio.Event())  # never produces an output
    async with Gateway(engine, GatewayConfig(stall_timeout=0.2)) as gw:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(drain(gw.generate(f"p{i}", SP))) for i in range(8)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineStalled) for r in results)
        assert time.monotonic() - t0 < 1.0
        assert set(engine.aborted) == {r.request_id for r in engine.requests}
        assert nothing_held(gw) and gw.statistics().outcomes == {"engine_error": 8}


async def test_aclose_with_a_timeout_ends_every_stream_of_a_hung_engine():
    engine = FakeEngine(step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(stall_timeout=None, max_in_flight=4))
    tasks = [asyncio.create_task(drain(gw.generate(f"p{i}", SP))) for i in range(8)]
    await spin()
    t0 = time.monotonic()
    await gw.aclose(timeout=0.2)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert time.monotonic() - t0 < 1.0
    assert all(isinstance(r, ShuttingDown) for r in results)
    assert nothing_held(gw)
    with pytest.raises(ShuttingDown):
        gw.generate("after close", SP)


@pytest.mark.parametrize("abort", ["hangs", "raises"])
async def test_aclose_is_bounded_and_does_not_raise_when_abort_misbehaves(abort, monkeypatch):
    monkeypatch.setattr(dispatch_module, "ABORT_TIMEOUT", 0.1)
    engine = _BadAbort(step=asyncio.Event(), mode=abort)
    gw = Gateway(engine, GatewayConfig(stall_timeout=None))
    tasks = [asyncio.create_task(drain(gw.generate(f"p{i}", SP))) for i in range(4)]
    await spin()
    t0 = time.monotonic()
    await gw.aclose(timeout=0.1)  # must neither hang nor raise
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert time.monotonic() - t0 < 1.0
    assert all(isinstance(r, ShuttingDown) for r in results) and nothing_held(gw)


@dataclass(slots=True)
class _BadAbort(FakeEngine):
    mode: str = "hangs"

    async def abort(self, request_id: str) -> None:
        if self.mode == "hangs":
            await asyncio.Event().wait()
        raise RuntimeError("abort failed")


@dataclass(slots=True)
class _Cancelling(FakeEngine):
    async def generate(self, request):  # type: ignore[override]
        raise asyncio.CancelledError()
        yield  # pragma: no cover


async def test_a_dead_engine_fails_queued_requests_at_once():
    engine = FakeEngine(die_after=0, step=asyncio.Event())
    engine.step.set()
    async with Gateway(engine, GatewayConfig(max_in_flight=1)) as gw:
        tasks = [asyncio.create_task(drain(gw.generate(f"p{i}", SP))) for i in range(5)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(type(r).__name__ == "EngineDead" for r in results)
        assert len(engine.started) == 1  # the queued four never reached the dead engine
        assert nothing_held(gw)


# -- 3. starvation under prefix ordering ----------------------------------------------------------


async def _flood(seconds: float) -> tuple[float, float]:
    """A flood of identical prompts (an endless group of riders) at 1.25x the simulated
    engine's capacity, and one different prompt at t = 0.5 s: (its wait, the flood's median)."""
    engine = SimEngine(block_size=16, num_blocks=4096, max_num_seqs=8,
                       step_time=StepTimeModel(alpha=0.01, beta=0.0, gamma=0.0))
    clock = engine.clock
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=8), clock=clock)
    sp = FakeSamplingParams(max_tokens=10)  # 8 requests per 0.1 s: 80 req/s
    flood = "the same shared system prompt and question " * 8
    streams, tasks = [], []

    async def send(prompt: str) -> None:
        stream = gw.generate(prompt, sp)
        streams.append(stream)
        await drain(stream)

    t, odd = 0.0, None
    while t < seconds:
        if odd is None and t >= 0.5:
            odd = gw.generate("a different prompt entirely " * 8, sp)
            tasks.append(asyncio.ensure_future(drain(odd)))
        tasks.append(asyncio.ensure_future(send(flood)))
        await clock.sleep(1 / 100)  # 100 req/s
        t += 1 / 100
    await asyncio.gather(*tasks)
    waits = sorted(s.ticket.dispatched_at - s.ticket.arrival for s in streams)
    assert odd is not None
    return odd.ticket.dispatched_at - odd.ticket.arrival, waits[len(waits) // 2]


async def test_aging_holds_even_against_an_endless_group_of_riders():
    short_wait, short_median = await _flood(8.0)
    long_wait, long_median = await _flood(24.0)
    assert short_median > 0.5  # the flood waits: riders would pass the odd request forever
    assert short_wait <= 2.0 * short_median and long_wait <= 2.0 * long_median
    assert abs(long_wait - short_wait) <= 0.1 * short_wait  # does not grow with the flood


# -- 4. bounded state ---------------------------------------------------------------------------


async def test_per_tenant_state_is_forgotten_when_tenants_go_idle():
    config = GatewayConfig(default_tenant_limits=TenantLimits(rate=1000.0, max_in_flight_share=0.5))
    async with Gateway(FakeEngine(max_num_seqs=8), config) as gw:
        for batch in range(5):
            await asyncio.gather(*(drain(gw.generate("hi", SP, tenant=f"t{batch}-{i}"))
                                   for i in range(1000)))
            assert gw._scheduler.tenants == {}
        assert len(gw._dispatch.throttles) <= gw._dispatch.throttles.max_entries == 4096
        assert len(gw._ingress._roots) <= 4096 and len(gw._ingress._salts) <= 4096
        assert gw.statistics().completed == 5000


# -- 5. wrong or late errors ----------------------------------------------------------------------


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": True}],
    [{"role": "user", "content": [{"type": "text", "text": 7}]}],
    [{"role": "x" * 10_000_000, "content": "hi"}],
    [{"role": "user", "name": "n" * 10_000_000, "content": "hi"}],
    [{"role": "user", "name": 5, "content": "hi"}],
])
async def test_malformed_chat_messages_are_invalid_at_the_call(messages):
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest):
            gw.generate(messages, SP)


@pytest.mark.parametrize("field", ["tenant", "request_id"])
async def test_lone_surrogates_in_names_are_invalid_at_the_call(field):
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest, match="surrogate"):
            gw.generate("hi", SP, **{field: "bad \udc80 name"})


@pytest.mark.parametrize("blank", [" ", "\n\n", "\u00a0\u00a0", "\u2028", "\u200b", "\ufeff",
                                   " \t\u3000\u200b"])
async def test_blank_prompts_are_invalid(blank):
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest, match=r"blank|empty"):
            gw.generate(blank, SP)


async def test_a_request_id_is_taken_from_the_call_until_the_stream_ends():
    async with Gateway(FakeEngine()) as gw:
        first = gw.generate("one", SP, request_id="dup")
        with pytest.raises(InvalidRequest, match="in use"):
            gw.generate("two", SP, request_id="dup")  # the first is not even iterated yet
        await drain(first)
        await drain(gw.generate("three", SP, request_id="dup"))  # free again
        closed = gw.generate("four", SP, request_id="dup2")
        await closed.aclose()
        await drain(gw.generate("five", SP, request_id="dup2"))


async def test_an_engine_that_raises_cancelled_error_is_an_engine_error_for_the_caller():
    async with Gateway(_Cancelling()) as gw:
        with pytest.raises(EngineError, match="cancelled"):
            await drain(gw.generate("hi", SP))
        assert nothing_held(gw)


async def test_iterating_one_stream_from_two_tasks_is_a_usage_error():
    engine = FakeEngine(step=asyncio.Event())
    async with Gateway(engine) as gw:
        stream = gw.generate("hi", SP)
        first = asyncio.create_task(stream.__anext__())
        await spin()
        with pytest.raises(UsageError, match="another task"):
            await stream.__anext__()
        engine.step.set()
        await first
        await drain(stream)


async def test_a_gateway_used_from_another_event_loop_or_thread_says_so():
    gw = Gateway(FakeEngine())
    await drain(gw.generate("bind to this loop", SP))
    errors: list[BaseException] = []

    def other_thread() -> None:
        async def use() -> None:
            gw.generate("from elsewhere", SP)

        try:
            asyncio.run(use())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], UsageError)
    with pytest.raises(UsageError):
        _call_without_loop(gw)  # a plain thread: no event loop at all


def _call_without_loop(gw: Gateway) -> None:
    result: list[BaseException] = []

    def run() -> None:
        try:
            gw.generate("sync call", SP)
        except BaseException as e:
            result.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(5)
    raise result[0]


# -- 6. retry hints -------------------------------------------------------------------------------


async def test_queue_full_retry_after_is_the_predicted_wait_of_the_queue():
    clock = FakeClock()
    engine = FakeEngine(clock=clock, output_time=0.5)
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", max_in_flight=1, max_queue_len=4), clock=clock)
    tasks = []
    for i in range(6):  # let completions establish a drain rate of 1 per second
        tasks.append(asyncio.create_task(drain(gw.generate(f"warm {i}", SP))))
        await spin()
        await clock.advance(1.0)
    await asyncio.gather(*tasks)
    tasks = [asyncio.create_task(drain(gw.generate("fill 0", SP)))]
    await spin()  # it runs; the next four wait
    tasks += [asyncio.create_task(drain(gw.generate(f"fill {i}", SP))) for i in range(1, 5)]
    await spin()
    with pytest.raises(QueueFull) as info:
        await drain(gw.generate("one too many", SP))
    assert info.value.retry_after >= 3.0  # four queued ahead at about one per second
    for _ in range(8):
        await clock.advance(1.0)
    await asyncio.gather(*tasks)


async def test_try_generate_refused_as_overloaded_keeps_the_tenants_rate_slot():
    engine = FakeEngine(step=asyncio.Event())
    config = GatewayConfig(max_in_flight=1, default_tenant_limits=TenantLimits(rate=1.0))
    async with Gateway(engine, config) as gw:
        held = gw.try_generate("holds the only slot", SP, tenant="a")
        with pytest.raises(Overloaded):
            gw.try_generate("refused: no slot", SP, tenant="b")
        await held.aclose()
        ok = gw.try_generate("b's rate is intact", SP, tenant="b")
        with pytest.raises(RateLimited):
            gw.try_generate("over b's rate", SP, tenant="b")
        await ok.aclose()


# -- 7. key namespaces ----------------------------------------------------------------------------


def test_namespace_fields_cannot_run_into_each_other():
    a = Namespace("m", lora="a", tenant="b\x1fc")
    b = Namespace("m", lora="a\x1fb", tenant="c")
    c = Namespace("m", lora=None, tenant="")
    d = Namespace("m", lora="", tenant=None)
    ids = list(range(8))
    keys = {block_hashes(ids, 4, ns)[0] for ns in (a, b, c, d)}
    assert len(keys) == 4
