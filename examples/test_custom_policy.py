"""Tests of the example policy, as a user would write them: a FakeEngine that holds requests
until released, so the queue builds up and the dispatch order can be read off the engine.
``run_until_idle()`` lets every request go as far as it can (no ``sleep(0)`` spins)."""

from __future__ import annotations

import asyncio

import pytest

from examples.custom_policy import ShortestJobFirst
from prefixgate import Gateway, GatewayConfig
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle


async def _order(requests: list[tuple], tenant_order: str = "fair") -> list[str]:
    """Dispatch order of ``(request id, prompt, max_tokens[, tenant])`` queued behind one running
    request."""
    engine = FakeEngine(block_size=4, max_model_len=512)
    engine.step = asyncio.Event()
    config = GatewayConfig(ordering=ShortestJobFirst, tenant_order=tenant_order, max_in_flight=1)
    async with Gateway(engine, config) as gw:

        async def run(stream):
            return [o async for o in stream]

        head = asyncio.create_task(run(gw.generate("occupies the only slot", FakeSamplingParams(4),
                                                   request_id="head")))
        await run_until_idle()  # head is dispatched and holds the slot
        tasks = [asyncio.create_task(run(gw.generate(p, FakeSamplingParams(n), request_id=rid,
                                                     tenant=tenant[0] if tenant else None)))
                 for rid, p, n, *tenant in requests]
        await run_until_idle()  # every request is queued
        engine.step.set()
        await asyncio.gather(head, *tasks)
    return engine.started[1:]


async def test_short_jobs_go_first():
    order = await _order([("long", "a " * 40, 64), ("short", "a b", 2), ("mid", "a " * 10, 16)])
    assert order == ["short", "mid", "long"]


async def test_with_a_global_tenant_order_short_jobs_go_first_across_tenants():
    jobs = [("x-long", "a " * 40, 64, "x"), ("x-mid", "a " * 10, 16, "x"), ("y-short", "a b", 2, "y"),
            ("y-longer", "b " * 45, 64, "y")]
    assert await _order(jobs, "global") == ["y-short", "x-mid", "x-long", "y-longer"]
    # By default tenants take turns; the policy orders each one's own queue.
    assert await _order(jobs) == ["x-mid", "y-short", "x-long", "y-longer"]


async def test_equal_jobs_go_in_arrival_order():
    assert await _order([("first", "x y z", 8), ("second", "x y z", 8)]) == ["first", "second"]


def test_a_request_without_max_tokens_counts_the_default_output():
    policy = ShortestJobFirst(default_output=100)

    class T:  # the fields sort_key reads
        prompt_token_ids = [1] * 10
        block_hashes = (7,)
        seq = 0
        max_tokens = None

    assert policy.sort_key(T())[0] == 110
    with pytest.raises(ValueError):
        ShortestJobFirst(default_output=0)
