"""Orderings as first-class objects: a name, a class or an instance of ``OrderingPolicy``."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate import Gateway, GatewayConfig, OrderingPolicy, PriorityOrder, Ticket
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
