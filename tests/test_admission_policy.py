"""AdmissionPolicy: consulted before a request is queued, refusals raised before any engine
call and counted, every admitted request released exactly once with what it used; TokenBudget,
the built-in tokens-per-minute budget per tenant, on the gateway's (fake) clock."""

from __future__ import annotations

import asyncio
import logging

import pytest

from prefixgate import (
    AdmissionPolicy,
    AdmissionPolicyFailed,
    AdmissionRefused,
    FakeClock,
    Gateway,
    GatewayConfig,
    Outcome,
    Overloaded,
    QueueFull,
    Refusal,
    RetryableRejection,
    Ticket,
    TokenBudget,
    Usage,
)
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=2)


async def drain(stream):
    return [o async for o in stream]


def nothing_held(gw: Gateway) -> bool:
    stats = gw.statistics()
    return (stats.queued, stats.running, stats.reserved_blocks) == (0, 0, 0) and not gw._live


class Recorder:
    """Refuses tenant "blocked"; records every check and release."""

    def __init__(self) -> None:
        self.checked: list[str] = []
        self.released: list[tuple[str, Usage]] = []

    def check(self, ticket: Ticket, now: float) -> Refusal | None:
        self.checked.append(ticket.request_id)
        if ticket.tenant == "blocked":
            return Refusal("suspended", retry_after=30.0, message="tenant is suspended")
        return None

    def release(self, ticket: Ticket, usage: Usage, now: float) -> None:
        self.released.append((ticket.request_id, usage))


async def test_a_refusal_is_raised_by_submit_and_generate_before_any_engine_call():
    engine = FakeEngine()
    policy: AdmissionPolicy = Recorder()  # structural: no base class needed
    async with Gateway(engine, GatewayConfig(admission_policy=policy)) as gw:
        with pytest.raises(AdmissionRefused) as info:
            await gw.submit("hello", SP, tenant="blocked", request_id="s")
        assert isinstance(info.value, RetryableRejection)
        assert (info.value.reason, info.value.retry_after, str(info.value)) == (
            "suspended", 30.0, "tenant is suspended")
        stream = gw.generate("hello", SP, tenant="blocked", request_id="g")  # validated only
        with pytest.raises(AdmissionRefused):
            await drain(stream)  # refused at the first iteration
        assert engine.requests == [] and nothing_held(gw)
        stats = gw.statistics()
        assert stats.refused == {"admission_refused": 2}
        assert stats.rejected_reasons == {"suspended": 2}
        assert stats.requests == 0 and stats.outcomes == {}
        # Everything was freed: the same ids serve another tenant.
        await drain(await gw.submit("hello", SP, tenant="ok", request_id="s"))
        await drain(gw.generate("hello", SP, tenant="ok", request_id="g"))
    assert engine.started == ["s", "g"]
    assert [rid for rid, _ in policy.released] == ["s", "g"]  # only what it admitted


async def test_try_generate_is_refused_by_the_policy_too():
    engine = FakeEngine()
    async with Gateway(engine, GatewayConfig(admission_policy=Recorder)) as gw:  # a class
        with pytest.raises(AdmissionRefused):
            gw.try_generate("hello", SP, tenant="blocked")
        assert engine.requests == [] and nothing_held(gw)
        assert gw.statistics().refused == {"admission_refused": 1}
        await drain(gw.try_generate("hello", SP, tenant="ok"))
    assert len(engine.started) == 1


async def test_every_admitted_request_is_released_once_whatever_ends_it():
    engine = FakeEngine(step=asyncio.Event())
    policy = Recorder()
    config = GatewayConfig(ordering="fcfs", admission_policy=policy, max_in_flight=1, max_queue_len=1)
    async with Gateway(engine, config) as gw:
        running = asyncio.create_task(drain(gw.generate("runs", SP, request_id="ran")))
        await run_until_idle()
        with pytest.raises(Overloaded):  # admitted by the policy, refused for want of a slot
            gw.try_generate("no slot", SP, request_id="busy")
        queued = await gw.submit("waits", SP, request_id="left")
        with pytest.raises(QueueFull):  # admitted by the policy, refused by the queue after it
            await gw.submit("no room", SP, request_id="full")
        with pytest.raises(Overloaded):  # refused before the policy: one is queued ahead
            gw.try_generate("no slot", SP, request_id="ahead")
        await queued.aclose()  # gave up while queued
        engine.step.set()
        await running
        assert nothing_held(gw)
    released = dict(policy.released)
    assert sorted(policy.checked) == sorted(released) == ["busy", "full", "left", "ran"]
    assert len(policy.released) == 4  # once each
    assert released["ran"] == Usage(Outcome.COMPLETED, True, 4, 2)
    assert released["left"] == Usage(Outcome.CANCELLED, False, 5, None)
    assert released["full"] == Usage(Outcome.QUEUE_FULL, False, 7, None)
    assert released["busy"] == Usage(Outcome.OVERLOADED, False, 7, None)


class Broken:
    """Raises on the prompt "boom"; its release raises on the prompt "bang"."""

    def check(self, ticket: Ticket, now: float) -> Refusal | None:
        if list(ticket.prompt_token_ids) == [b + 2 for b in b"boom"]:
            raise RuntimeError("policy bug")
        return None

    def release(self, ticket: Ticket, usage: Usage, now: float) -> None:
        if list(ticket.prompt_token_ids) == [b + 2 for b in b"bang"]:
            raise KeyError("release bug")


async def test_a_policy_that_raises_gives_a_clear_error_and_loses_nothing(caplog):
    engine = FakeEngine(step=asyncio.Event())
    async with Gateway(engine, GatewayConfig(admission_policy=Broken(), max_in_flight=1)) as gw:
        others = [asyncio.create_task(drain(gw.generate(f"other {i}", SP, request_id=f"o{i}")))
                  for i in range(3)]
        await run_until_idle()
        with pytest.raises(AdmissionPolicyFailed, match=r"Broken\.check raised on b1") as info:
            await gw.submit("boom", SP, request_id="b1")
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(AdmissionPolicyFailed):
            await drain(gw.generate("boom", SP, request_id="b2"))
        assert gw.statistics().queued == 2  # the others still wait, untouched
        engine.step.set()
        assert [len(o) for o in await asyncio.gather(*others)] == [2, 2, 2]
        with caplog.at_level(logging.ERROR, logger="prefixgate.policies"):
            assert len(await drain(gw.generate("bang", SP, request_id="b3"))) == 2
        assert "Broken.release raised on b3" in caplog.text
        await drain(gw.generate("still serving", SP))
        stats = gw.statistics()
        assert nothing_held(gw)
    assert stats.refused == {"policy_failed": 2}
    assert stats.outcomes == {"completed": 5}
    assert "b1" not in engine.started and "b2" not in engine.started


async def test_a_policy_answer_that_is_not_a_refusal_is_a_policy_failure():
    class Sloppy(Broken):
        def check(self, ticket, now):
            return "no"

    async with Gateway(FakeEngine(), GatewayConfig(admission_policy=Sloppy())) as gw:
        with pytest.raises(AdmissionPolicyFailed, match="must return None or a Refusal"):
            await gw.submit("hello", SP)


# -- TokenBudget -------------------------------------------------------------------------------


async def test_a_token_budget_refuses_a_spent_tenant_and_refills_with_time():
    clock = FakeClock()
    engine = FakeEngine()
    budget = TokenBudget(tokens_per_minute=600, burst=100)  # 10 tokens a second, 100 at once
    sp = FakeSamplingParams(max_tokens=10)
    prompt = "x" * 40  # 40 tokens + 10 output: each request costs 50
    async with Gateway(engine, GatewayConfig(admission_policy=budget), clock=clock) as gw:
        await drain(await gw.submit(prompt, sp, tenant="a"))
        await drain(await gw.submit(prompt, sp, tenant="a"))
        with pytest.raises(AdmissionRefused) as info:
            await gw.submit(prompt, sp, tenant="a")
        assert info.value.reason == "token_budget" and info.value.retry_after == pytest.approx(5.0)
        await drain(await gw.submit(prompt, sp, tenant="b"))  # budgets are per tenant
        await clock.advance(4.0)
        with pytest.raises(AdmissionRefused) as info:
            await gw.submit(prompt, sp, tenant="a")
        assert info.value.retry_after == pytest.approx(1.0)
        await clock.advance(1.0)
        await drain(await gw.submit(prompt, sp, tenant="a"))
        stats = gw.statistics()
    assert stats.refused == {"admission_refused": 2} and stats.rejected_reasons == {"token_budget": 2}
    assert len(engine.started) == 4


async def test_a_token_budget_settles_on_the_tokens_really_used():
    clock = FakeClock()
    engine = FakeEngine(max_model_len=48, step=asyncio.Event())
    budget = TokenBudget(tokens_per_minute=60, burst=200)
    config = GatewayConfig(admission_policy=budget, max_in_flight=1, max_queue_len=1)
    prompt = "x" * 40
    async with Gateway(engine, config, clock=clock) as gw:
        # Charged 40 + 20; the context leaves room for 8 output tokens: 48 used, 12 come back.
        first = asyncio.create_task(drain(gw.generate(prompt, FakeSamplingParams(20), tenant="a")))
        await run_until_idle()
        assert budget.level("a", clock.now()) == 140
        waiting = await gw.submit(prompt, FakeSamplingParams(5), tenant="a")  # charged 45
        assert budget.level("a", clock.now()) == 95
        with pytest.raises(QueueFull):  # charged 45, refused by the queue: all 45 come back
            await gw.submit(prompt, FakeSamplingParams(5), tenant="a")
        assert budget.level("a", clock.now()) == 95
        await waiting.aclose()  # never reached the engine: all 45 come back
        assert budget.level("a", clock.now()) == 140
        engine.step.set()
        await first
        assert budget.level("a", clock.now()) == 152
    assert budget.level("b", 0.0) == 200 and "tenants=1" in repr(budget)


async def test_a_request_larger_than_the_burst_waits_for_a_full_bucket_then_goes_into_debt():
    budget = TokenBudget(tokens_per_minute=60, burst=50)
    clock = FakeClock()
    engine = FakeEngine()
    async with Gateway(engine, GatewayConfig(admission_policy=budget), clock=clock) as gw:
        big = FakeSamplingParams(max_tokens=70)  # 10 + 70 = 80 > burst
        await drain(await gw.submit("y" * 10, big, tenant="a"))  # a full bucket lets it go
        assert budget.level("a", clock.now()) == -30
        with pytest.raises(AdmissionRefused) as info:
            await gw.submit("y" * 10, big, tenant="a")
        assert info.value.retry_after == pytest.approx(80.0)  # until the bucket is full again


def test_token_budget_and_refusal_and_config_are_validated():
    for bad in ({"tokens_per_minute": 0}, {"tokens_per_minute": 10, "burst": -1},
                {"tokens_per_minute": float("inf")}, {"tokens_per_minute": 10, "max_tenants": 0}):
        with pytest.raises(ValueError, match="TokenBudget"):
            TokenBudget(**bad)
    for reason, retry_after in (("", 1.0), ("x", -1.0), ("x", float("nan"))):
        with pytest.raises(ValueError, match="Refusal"):
            Refusal(reason, retry_after)
    for bad in (object(), "token_budget", TokenBudget.charge):
        with pytest.raises(ValueError, match=r"GatewayConfig\.admission_policy"):
            GatewayConfig(admission_policy=bad)


def test_token_budget_forgets_full_buckets_beyond_max_tenants():
    budget = TokenBudget(tokens_per_minute=60, burst=10, max_tenants=2)

    class T:
        max_tokens = 1
        num_prompt_tokens = 4

        def __init__(self, tenant):
            self.tenant = tenant

    for tenant, now in (("a", 0.0), ("b", 9.0), ("c", 10.0)):
        assert budget.check(T(tenant), now) is None  # each charged 5 of 10
    # At t=10 "a" has refilled (1 a second): forgotten, a fresh bucket equals it; "b" has not.
    assert sorted(budget._buckets, key=str) == ["b", "c"]
