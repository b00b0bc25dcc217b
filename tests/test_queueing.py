"""Ordering: prefix grouping, the aging bound (deterministic, fake clock), tenant fairness, rates."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate import Gateway, GatewayConfig, RateLimited
from prefixgate.config import TenantLimits
from prefixgate.testing import FakeClock, FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=1)



async def drain(stream):
    return [o async for o in stream]


def tile(docs: int, questions: int) -> list[tuple[str, str]]:
    """(doc, prompt) in tile order: d0q0, d1q0, …, d0q1, d1q1, … (adversarial for LRU)."""
    return [(f"d{d}", f"document {d} " * 6 + f"question {q}") for q in range(questions)
            for d in range(docs)]


async def run_order(ordering: str, prompts: list[str], **config) -> list[str]:
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    engine.step.set()
    gw = Gateway(engine, GatewayConfig(ordering=ordering, max_in_flight=1, **config))
    await asyncio.gather(*(drain(gw.generate(p, SP, request_id=f"r{i}")) for i, p in enumerate(prompts)))
    order = [int(rid[1:]) for rid in engine.started]
    return [prompts[i] for i in order]


async def test_prefix_ordering_dispatches_siblings_together():
    trace = tile(docs=4, questions=3)
    order = await run_order("prefix", [p for _, p in trace], min_aging_wait=60)
    docs = [p.split()[1] for p in order]
    runs = [docs[i] for i in range(len(docs)) if i == 0 or docs[i] != docs[i - 1]]
    assert len(runs) == 4 and sorted(runs) == ["0", "1", "2", "3"]  # each doc's questions adjacent


async def test_fcfs_keeps_arrival_order():
    trace = tile(docs=3, questions=2)
    assert await run_order("fcfs", [p for _, p in trace]) == [p for _, p in trace]


async def test_priority_ordering_runs_lower_priority_values_first():
    engine = FakeEngine(step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(ordering="priority", max_in_flight=1))
    tasks = [asyncio.create_task(drain(gw.generate(f"p{i}", SP, request_id=f"r{i}", priority=pr)))
             for i, pr in enumerate([5, 1, 3, 0])]
    await run_until_idle()
    engine.step.set()
    await asyncio.gather(*tasks)
    assert engine.started == ["r3", "r1", "r2", "r0"]


async def resident_order(resident: bool, cold: str, **config) -> list[str]:
    """The dispatch order of a blocker, then three cold groups and a newest request whose
    prefix is resident in the engine (``resident``: a request loaded it first), one at a time."""
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=1, min_aging_wait=60, **config),
                 clock=FakeClock())
    warm = "resident doc " * 4
    engine.step.set()
    if resident:
        await drain(gw.generate(warm + "first", SP, request_id="warm"))
    engine.step.clear()
    blocker = asyncio.create_task(drain(gw.generate("blocker " * 3, SP, request_id="blocker")))
    await run_until_idle()
    rest = [asyncio.create_task(drain(gw.generate(f"{cold} {i} " * 6, SP, request_id=f"cold{i}")))
            for i in range(3)]
    rest.append(asyncio.create_task(drain(gw.generate(warm + "second", SP, request_id="hot"))))
    await run_until_idle()
    engine.step.set()
    await asyncio.gather(blocker, *rest)
    return [r for r in engine.started if r != "warm"]


async def test_prefix_ordering_returns_to_a_resident_prefix_after_a_group_ends():
    assert (await resident_order(True, "cold"))[1] == "hot"  # newest, but its prefix is resident


async def test_with_prefer_resident_off_the_walk_alone_decides():
    """``prefer_resident=False`` (several gateways in front of the same engines): a waiting
    request whose prefix the engine holds goes when the walk comes to it, as if it did not."""
    walk = await resident_order(False, "topic")
    assert await resident_order(True, "topic", prefer_resident=False) == walk
    assert (await resident_order(True, "topic"))[1] == "hot" != walk[1]  # the preference would go to it


async def test_a_prefix_the_engine_reports_stored_after_its_request_arrived_goes_next():
    """Another gateway's request loaded a prefix (the mirror learns it from the engine's cache
    events) that a request here, queued cold behind more than the oldest few, shares: it goes
    at the next group end, not when the walk comes to it; the watch on it is dropped once
    nothing waits."""
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=1, min_aging_wait=60),
                 clock=FakeClock())
    gw._scheduler.mirror.followed = True  # as a CacheFollower sets it (the fake publishes no events)
    blocker = asyncio.create_task(drain(gw.generate("blocker " * 3, SP, request_id="blocker")))
    await run_until_idle()
    rest = [asyncio.create_task(drain(gw.generate(f"aaa topic {i} " * 6, SP, request_id=f"cold{i}")))
            for i in range(12)]
    rest.append(asyncio.create_task(drain(gw.generate("zzz shared doc " * 4 + "question", SP,
                                                      request_id="hot"))))
    await run_until_idle()
    hot = gw._live["hot"]
    assert gw._scheduler._watch  # queued cold: watched
    gw._scheduler.mirror.learn(None, hot.block_hashes[:hot.cacheable_blocks])  # as a cache event
    engine.step.set()
    await asyncio.gather(blocker, *rest)
    assert engine.started[:2] == ["blocker", "hot"]  # the walk alone would take it last ("zzz")
    assert gw._scheduler._watch == {}


async def test_the_watch_forgets_requests_that_leave_unlearned():
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=1), clock=FakeClock())
    gw._scheduler.mirror.followed = True
    tasks = [asyncio.create_task(drain(gw.generate(f"doc {i} " * 6, SP, request_id=f"r{i}")))
             for i in range(4)]
    await run_until_idle()
    assert sum(len(w) for w in gw._scheduler._watch.values()) == 3  # the first went at once
    tasks[2].cancel()
    await run_until_idle()
    assert sum(len(w) for w in gw._scheduler._watch.values()) == 2
    engine.step.set()
    await asyncio.gather(*tasks[:2], tasks[3])
    assert gw._scheduler._watch == {}
    off = Gateway(FakeEngine(block_size=4), GatewayConfig(prefer_resident=False))
    assert off._scheduler.mirror.learned == []  # nothing to watch for
    unfollowed = Gateway(FakeEngine(block_size=4, step=asyncio.Event()), GatewayConfig(max_in_flight=1))
    left = [asyncio.create_task(drain(unfollowed.generate(f"doc {i} " * 6, SP))) for i in range(3)]
    await run_until_idle()
    assert unfollowed._scheduler._watch == {}  # without cache events the mirror cannot learn
    for t in left:
        t.cancel()
    await run_until_idle()


async def test_a_sibling_that_joins_after_its_group_was_left_goes_at_the_next_group_end():
    """The walk left the resident group (another group started since); a sibling that joins
    then, newer than the oldest few waiting, still goes first when a group ends: it would
    otherwise wait for the walk to come round, and by then the engine may have evicted it."""
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=2, min_aging_wait=60))
    warm = "resident doc " * 4
    first = [asyncio.create_task(drain(gw.generate(warm + "first", SP, request_id="warm"))),
             asyncio.create_task(drain(gw.generate("other group " * 6, SP, request_id="other")))]
    await run_until_idle()
    assert engine.started == ["warm", "other"]
    cold = [asyncio.create_task(drain(gw.generate(f"cold {i} " * 6, SP, request_id=f"cold{i}")))
            for i in range(10)]
    await run_until_idle()
    hot = asyncio.create_task(drain(gw.generate(warm + "second", SP, request_id="hot")))
    await run_until_idle()
    engine.step.set()
    await asyncio.gather(*first, *cold, hot)
    assert engine.started[2] == "hot"  # newest of eleven waiting, but its group is resident


async def test_aging_bound_is_deterministic_with_a_fake_clock():
    """A cold request that the prefix policy keeps passing over (a hot sibling is always
    waiting) goes first at the first decision where newer requests have overtaken it and its
    wait exceeds max(min_aging_wait, max_wait_factor × median recent wait)."""
    clock = FakeClock()
    engine = FakeEngine(block_size=4, clock=clock, output_time=1.0)  # one request per second
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=1, max_wait_factor=2.0,
                                       min_aging_wait=0.5), clock=clock)
    hot = "hot shared prefix " * 3
    tasks = [asyncio.create_task(drain(gw.generate(hot + "q0", SP, request_id="q0")))]
    await run_until_idle()
    cold = gw.generate("zzz cold and alone " * 2, SP, request_id="cold")
    tasks.append(asyncio.create_task(drain(cold)))
    for i in range(1, 8):  # a hot sibling arrives each second, just before the running one ends
        tasks.append(asyncio.create_task(drain(gw.generate(hot + f"q{i}", SP, request_id=f"q{i}"))))
        await run_until_idle()
        await clock.advance(1.0)
        await run_until_idle()
    await clock.advance(5.0)
    await asyncio.gather(*tasks)
    wait = cold.ticket.dispatched_at - cold.ticket.arrival
    # t=1: q1 (arrived with cold, not newer) goes; t=2: q2 (newer) overtakes; hot waits are 1 s,
    # so the bound is 2 × 1 s and at t=3 cold (waited 3 s) goes before q3.
    assert engine.started[:4] == ["q0", "q1", "q2", "cold"]
    assert wait == 3.0 and gw._scheduler.aged_dispatches >= 1
    bound = 2.0 * 1.0  # max_wait_factor × median of the waits before it (0, 1, 1 s)
    assert bound < wait <= bound + 1.0  # the first decision after the bound


async def test_a_burst_is_ordered_by_the_policy_without_aging():
    """Requests that arrive together do not overtake each other, however long the burst drains."""
    clock = FakeClock()
    engine = FakeEngine(block_size=4, clock=clock, output_time=1.0)
    gw = Gateway(engine, GatewayConfig(ordering="prefix", max_in_flight=1, min_aging_wait=0.5),
                 clock=clock)
    prompts = [f"document {d} " * 4 + f"question {q}" for q in range(3) for d in range(4)]
    tasks = [asyncio.create_task(drain(gw.generate(p, SP))) for p in prompts]
    for _ in range(14):
        await run_until_idle()
        await clock.advance(1.0)
    await asyncio.gather(*tasks)
    assert gw._scheduler.aged_dispatches == 0


async def test_a_noisy_tenant_cannot_take_the_whole_window():
    engine = FakeEngine(step=asyncio.Event())
    config = GatewayConfig(ordering="fcfs", max_in_flight=4,
                           tenants={"noisy": TenantLimits(max_in_flight_share=0.5)})
    gw = Gateway(engine, config)
    noisy = [asyncio.create_task(drain(gw.generate(f"n{i}", SP, tenant="noisy", request_id=f"n{i}")))
             for i in range(10)]
    await run_until_idle()
    quiet = [asyncio.create_task(drain(gw.generate(f"q{i}", SP, tenant="quiet", request_id=f"q{i}")))
             for i in range(2)]
    await run_until_idle()
    assert engine.started[:4] == ["n0", "n1", "n2", "n3"]  # alone, noisy may use the window
    engine.step.set()
    await asyncio.gather(*noisy, *quiet)
    # As soon as slots free, the quiet tenant (fewest in flight) goes first.
    assert engine.started[4:6] == ["q0", "q1"]


async def test_a_tenant_at_its_share_waits_while_another_is_served():
    """The share is of the engine's max_num_seqs and holds while another tenant has requests
    in flight, even when none of them waits in the gateway (they would wait in the engine)."""
    engine = FakeEngine(max_num_seqs=4, step=asyncio.Event())  # window 8; share base 4
    config = GatewayConfig(ordering="fcfs", tenants={"noisy": TenantLimits(max_in_flight_share=0.5)})
    gw = Gateway(engine, config)
    quiet = asyncio.create_task(drain(gw.generate("q0", SP, tenant="quiet", request_id="q0")))
    await run_until_idle()
    noisy = [asyncio.create_task(drain(gw.generate(f"n{i}", SP, tenant="noisy", request_id=f"n{i}")))
             for i in range(6)]
    await run_until_idle()
    stats = gw.statistics()
    assert (stats.running, stats.queued, stats.blocked) == (3, 4, "tenant_share")
    assert engine.started == ["q0", "n0", "n1"]
    engine.step.set()
    await asyncio.gather(quiet, *noisy)
    assert gw.statistics().outcomes == {"completed": 7}


async def test_siblings_do_not_ride_past_another_tenant():
    """Riders and aging choose within the tenant fairness picked, not ahead of it."""
    engine = FakeEngine(block_size=4, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig(max_in_flight=2))  # prefix ordering
    group = [asyncio.create_task(drain(gw.generate("shared document " * 6 + f"question {i}", SP,
                                                   tenant="a", request_id=f"a{i}")))
             for i in range(5)]
    other = asyncio.create_task(drain(gw.generate("something else entirely", SP, tenant="b",
                                                  request_id="b0")))
    await run_until_idle()
    assert engine.started == ["a0", "b0"]  # not a0, a1 (a rider), a2, a3
    assert gw.statistics().blocked == "max_in_flight"
    engine.step.set()
    await asyncio.gather(*group, other)
    assert engine.started[2:] == ["a1", "a2", "a3", "a4"]  # alone again: siblings in a row


async def test_one_tenant_may_use_twice_max_num_seqs():
    engine = FakeEngine(block_size=4, max_num_seqs=2, step=asyncio.Event())
    gw = Gateway(engine, GatewayConfig())
    tasks = [asyncio.create_task(drain(gw.generate(f"request {i}", SP, tenant="a")))
             for i in range(6)]
    await run_until_idle()
    assert gw.statistics().running == 4 and gw.statistics().queued == 2
    engine.step.set()
    await asyncio.gather(*tasks)


async def test_tenant_rate_limit_paces_the_blocking_path_and_refuses_the_non_blocking_one():
    clock = FakeClock()
    engine = FakeEngine()
    gw = Gateway(engine, GatewayConfig(tenants={"acme": TenantLimits(rate=2)}), clock=clock)
    tasks = [asyncio.create_task(drain(gw.generate(f"a{i}", SP, tenant="acme", request_id=f"a{i}")))
             for i in range(5)]
    await run_until_idle()
    assert len(engine.started) == 2
    assert gw.statistics().queued == 3  # waiting for the rate counts as queued
    with pytest.raises(RateLimited) as info:
        gw.try_generate("x", SP, tenant="acme")
    # Behind 3 waiters at one slot per 0.5 s (the first at 0.5 s): its own slot comes at 2.0 s.
    assert info.value.retry_after == pytest.approx(2.0)
    await clock.advance(1.0)
    await run_until_idle()
    assert len(engine.started) == 4
    await clock.advance(1.0)
    await asyncio.gather(*tasks)
    assert len(engine.started) == 5
    await drain(gw.generate("other tenants are not limited", SP, tenant="zeta"))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"GatewayConfig\.ordering must be one of"):
        GatewayConfig(ordering="lifo")
    with pytest.raises(ValueError, match="kv_budget"):
        GatewayConfig(kv_budget=0)
    with pytest.raises(ValueError, match=r"TenantLimits\.max_in_flight_share"):
        TenantLimits(max_in_flight_share=2)
    with pytest.raises(ValueError, match=r"GatewayConfig\.tenants"):
        GatewayConfig(tenants={"a": 3})
