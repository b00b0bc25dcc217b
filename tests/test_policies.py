"""Orderings as first-class objects: a name, a class or an instance of ``OrderingPolicy``."""

from __future__ import annotations

import asyncio
import random

import pytest

from prefixgate import AutoClock, Gateway, GatewayConfig, OrderingPolicy, PrefixOrder, PriorityOrder, Ticket
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=1)


class LongestFirst:
    """A custom policy: the longest prompt first (then arrival order)."""

    circular = False

    def __init__(self) -> None:
        self.keyed: list[str] = []

    def sort_key(self, ticket: Ticket) -> tuple[int, int]:
        self.keyed.append(ticket.request_id)
        return (-len(ticket.prompt_token_ids), ticket.seq)


async def _dispatch_order(ordering: object, prompts: dict[str, str]) -> list[str]:
    engine = FakeEngine(block_size=4, max_model_len=256)
    engine.step = asyncio.Event()
    async with Gateway(engine, GatewayConfig(ordering=ordering, max_in_flight=1)) as gw:
        first = gw.generate("warm up the single slot", SP, request_id="first")
        task = asyncio.create_task(_drain(first))
        await run_until_idle()
        streams = [gw.generate(text, SP, request_id=rid) for rid, text in prompts.items()]
        tasks = [asyncio.create_task(_drain(s)) for s in streams]
        await run_until_idle()
        engine.step.set()
        await asyncio.gather(task, *tasks)
    return engine.started[1:]


async def _drain(stream):
    return [o async for o in stream]


PROMPTS = {"short": "a b", "long": "a b c d e f g h i j k l", "middle": "a b c d e f"}


async def test_an_ordering_instance_is_used_as_given():
    policy: OrderingPolicy = LongestFirst()  # structural: no base class needed
    order = await _dispatch_order(policy, PROMPTS)
    assert order == ["long", "middle", "short"]
    assert set(policy.keyed) >= {"short", "long", "middle"}  # this very instance keyed them


async def test_an_ordering_class_is_instantiated_per_gateway():
    assert await _dispatch_order(LongestFirst, PROMPTS) == ["long", "middle", "short"]
    assert await _dispatch_order("fcfs", PROMPTS) == ["short", "long", "middle"]


async def test_built_in_classes_work_as_names_do():
    assert await _dispatch_order(PriorityOrder(), PROMPTS) == await _dispatch_order("priority", PROMPTS)


NO_CIRCULAR = type("NoCircular", (), {"sort_key": lambda self, ticket: 0})


@pytest.mark.parametrize("bad", ["nearest", object(), 3, NO_CIRCULAR])
def test_what_is_not_an_ordering_policy_is_refused_at_config_time(bad):
    with pytest.raises(ValueError, match="ordering"):
        GatewayConfig(ordering=bad)


# -- honoured across tenants: tenant_order="global" ----------------------------------------------


async def _order_across_tenants(ordering: object, tenant_order: str,
                                requests: list[tuple[str, str, str, int]]) -> list[str]:
    """Dispatch order of ``(request id, tenant, prompt, priority)``, all queued, in this order,
    behind one running request of a third tenant."""
    engine = FakeEngine(block_size=4, max_model_len=256, step=asyncio.Event())
    config = GatewayConfig(ordering=ordering, tenant_order=tenant_order, max_in_flight=1)
    async with Gateway(engine, config) as gw:
        head = asyncio.create_task(_drain(gw.generate("holds the slot", SP, tenant="c",
                                                      request_id="head")))
        await run_until_idle()
        tasks = [asyncio.create_task(_drain(gw.generate(text, SP, tenant=tenant, request_id=rid,
                                                        priority=priority)))
                 for rid, tenant, text, priority in requests]
        await run_until_idle()
        engine.step.set()
        await asyncio.gather(head, *tasks)
    return engine.started[1:]


FREE_THEN_GOLD = [("a0", "free", "a zero", 5), ("a1", "free", "a one", 5), ("a2", "free", "a two", 5),
                  ("b0", "gold", "b zero", 0), ("b1", "gold", "b one", 0), ("b2", "gold", "b two", 0)]


async def test_global_priority_serves_another_tenants_urgent_requests_before_earlier_ones():
    order = await _order_across_tenants("priority", "global", FREE_THEN_GOLD)
    assert order == ["b0", "b1", "b2", "a0", "a1", "a2"]
    # The default interleaves tenants (fewest in flight first), priority only within each:
    assert await _order_across_tenants("priority", "fair", FREE_THEN_GOLD) == [
        "a0", "b0", "a1", "b1", "a2", "b2"]
    # A tenant's smallest key changes as requests join and leave its queue: the ranking follows.
    later_but_smaller = [("b0", "gold", "b zero", 3), ("a0", "free", "a zero", 1),
                         ("b1", "gold", "b one", 0)]
    assert await _order_across_tenants("priority", "global", later_but_smaller) == ["b1", "a0", "b0"]


async def test_under_global_priority_a_tenant_whose_urgent_request_left_ranks_by_what_is_left():
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    config = GatewayConfig(ordering="priority", tenant_order="global", max_in_flight=1)
    async with Gateway(engine, config) as gw:
        head = asyncio.create_task(_drain(gw.generate("holds the slot", SP, request_id="head")))
        await run_until_idle()
        urgent = await gw.submit("b zero", SP, tenant="gold", request_id="b0", priority=0)
        rest = [asyncio.create_task(_drain(gw.generate(text, SP, tenant=t, request_id=rid,
                                                       priority=p)))
                for rid, t, text, p in [("b1", "gold", "b one", 7), ("a0", "free", "a zero", 3)]]
        await run_until_idle()
        await urgent.aclose()  # leaves the queue unserved
        engine.step.set()
        await asyncio.gather(head, *rest)
    assert engine.started == ["head", "a0", "b1"]


async def test_a_custom_ordering_instance_is_honoured_across_tenants():
    policy = LongestFirst()
    requests = [("a-short", "a", "a b", 0), ("b-long", "b", "a b c d e f g h i j k l", 0),
                ("a-long", "a", "a b c d e f g h i j k", 0), ("b-short", "b", "z", 0),
                ("a-mid", "a", "a b c d e f", 0)]
    order = await _order_across_tenants(policy, "global", requests)
    assert order == ["b-long", "a-long", "a-mid", "a-short", "b-short"]
    assert set(policy.keyed) >= {rid for rid, *_ in requests}  # this very instance keyed them


async def test_under_global_priority_the_aging_bound_still_lets_a_cold_request_through():
    """Tenant "gold" sends a priority-0 request every second, each before the running one ends;
    tenant "free"'s priority-9 request, alone, would never have the smallest key. Aging looks
    at the oldest request of all tenants and sends it once newer requests have overtaken it and
    it has waited over max_wait_factor × the median wait."""
    clock = AutoClock()
    engine = FakeEngine(block_size=4, clock=clock, output_time=1.0)  # one request per second
    config = GatewayConfig(ordering="priority", tenant_order="global", max_in_flight=1,
                           max_wait_factor=2.0, min_aging_wait=0.5)
    async with Gateway(engine, config, clock=clock) as gw:
        tasks = [asyncio.create_task(_drain(gw.generate("gold 0", SP, tenant="gold",
                                                        request_id="g0")))]
        await run_until_idle()
        cold = gw.generate("free and cold", SP, tenant="free", request_id="cold", priority=9)
        tasks.append(asyncio.create_task(_drain(cold)))
        for i in range(1, 8):
            tasks.append(asyncio.create_task(_drain(gw.generate(f"gold {i}", SP, tenant="gold",
                                                                request_id=f"g{i}"))))
            await clock.sleep(1.0)
        await asyncio.gather(*tasks)
        aged = gw.statistics().aged_dispatches
    # t=1: g1 (arrived with cold, not newer) goes; t=2: g2 (newer) overtakes it; the waits so
    # far are 1 s, so the bound is 2 × 1 s and at t=3 cold (waited 3 s) goes before g3.
    assert engine.started[:4] == ["g0", "g1", "g2", "cold"]
    assert cold.ticket.dispatched_at - cold.ticket.arrival == 3.0 and aged == 1


@pytest.mark.parametrize("bad", [{"tenant_order": "round_robin"},
                                 {"tenant_order": "global"},  # with the default, circular "prefix"
                                 {"tenant_order": "global", "ordering": PrefixOrder()}])
def test_global_order_is_validated_at_config_time(bad):
    with pytest.raises(ValueError, match=r"GatewayConfig\.(tenant_order|ordering)"):
        GatewayConfig(**bad)


@pytest.mark.parametrize("seed", range(6))
async def test_global_priority_dispatches_in_key_order_over_tenants_whatever_joins_and_leaves(seed):
    """Random tenants and priorities join behind a held slot, some leave while queued: once the
    slot frees, what is left goes in (priority, arrival) order across all tenants."""
    rng = random.Random(seed)
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    config = GatewayConfig(ordering="priority", tenant_order="global", max_in_flight=1,
                           min_aging_wait=1e9)  # no aging: the keys alone decide
    async with Gateway(engine, config) as gw:
        head = asyncio.create_task(_drain(gw.generate("holds the slot", SP, request_id="head")))
        await run_until_idle()
        streams, expected = [], []
        for i in range(40):
            priority = rng.randrange(4)
            stream = await gw.submit(f"request {i}", SP, tenant=f"t{rng.randrange(5)}",
                                     request_id=f"r{i}", priority=priority)
            streams.append(stream)
            expected.append((priority, i))
            if rng.random() < 0.3:  # an earlier one leaves the queue
                j = rng.randrange(len(streams))
                if expected[j] is not None:
                    await streams[j].aclose()
                    expected[j] = None
        tasks = [asyncio.create_task(_drain(s)) for s, e in zip(streams, expected, strict=True)
                 if e is not None]
        engine.step.set()
        await asyncio.gather(head, *tasks)
    assert engine.started[1:] == [f"r{i}" for _, i in sorted(e for e in expected if e is not None)]
