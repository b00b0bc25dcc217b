"""SimEngine as stories of exact block ids, in the manner of vLLM's test_prefix_caching.py.

Block size 4 throughout the scheduler stories; block 0 is the null block, so the first block a
request gets is 1. A finished request frees its blocks tail first: unhashed (partial) blocks go
to the front of the free queue, hashed ones to the back, so its tail is evicted before its head.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from prefixgate.clock import Clock
from prefixgate.engine import Engine, EngineRequest
from prefixgate.errors import InvalidRequest, PromptTooLong
from prefixgate.keys import BlockHash, Namespace
from prefixgate.sim import SimClock, SimEngine, StepTimeModel
from prefixgate.sim.scheduler import BlockPool, SimRequest, SimScheduler, Status
from prefixgate.testing import FakeSamplingParams

NS = Namespace("sim")


def core(*, num_blocks: int = 11, budget: int = 64, max_num_seqs: int = 16,
         max_model_len: int | None = None) -> SimScheduler:
    return SimScheduler(block_size=4, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=budget,
                        max_model_len=max_model_len or (num_blocks - 1) * 4)


def req(rid: str, prompt: list[int], max_tokens: int = 1, namespace: Namespace = NS) -> SimRequest:
    return SimRequest(rid, tuple(prompt), max_tokens, namespace, block_size=4)


def step(s: SimScheduler) -> list[tuple[str, int]]:
    plan = s.schedule()
    s.update(plan)
    return [(r.request_id, n) for r, n in plan.scheduled]


# -- the block pool ---------------------------------------------------------------------------


def test_pool_starts_with_every_block_but_the_null_block_free_in_id_order():
    pool = BlockPool(6)
    assert pool.free_queue() == (1, 2, 3, 4, 5)
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.num_free == 3
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)


def test_pool_frees_unhashed_blocks_to_the_front_and_hashed_ones_to_the_back():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_block(1, BlockHash(11))
    pool.cache_block(2, BlockHash(12))
    pool.free_blocks(blocks[::-1])  # a request frees tail first: 3 (partial), 2, 1
    assert pool.free_queue() == (3, 4, 5, 6, 7, 2, 1)
    assert pool.longest_hit([BlockHash(11), BlockHash(12)], 2) == [1, 2]


def test_pool_evicts_a_cached_block_when_it_is_reallocated():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, BlockHash(5))
    pool.free_blocks([b])
    assert pool.longest_hit([BlockHash(5)], 1) == [1]
    assert pool.get_new_blocks(2) == [2, 1]
    assert pool.longest_hit([BlockHash(5)], 1) == []
    assert pool.evictions == 1


def test_pool_keeps_duplicate_blocks_and_serves_the_oldest():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, BlockHash(9))
    pool.cache_block(b, BlockHash(9))  # vLLM does not de-duplicate identical blocks
    assert pool.longest_hit([BlockHash(9)], 1) == [a]
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # reallocates 3, then a: a's entry goes, b's stays
    assert pool.longest_hit([BlockHash(9)], 1) == [b]


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, BlockHash(1))
    pool.free_blocks([b])
    assert pool.count_evictable([b]) == 1
    pool.touch([b])
    pool.touch([b])
    assert (pool.ref_count(b), pool.free_queue()) == (2, (2, 3))
    pool.free_blocks([b])
    pool.free_blocks([b])
    assert pool.free_queue() == (2, 3, 1)


def test_reset_forgets_hashes_only_when_nothing_is_held():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, BlockHash(1))
    assert not pool.reset()
    pool.free_blocks([b])
    assert pool.reset()
    assert pool.longest_hit([BlockHash(1)], 1) == [] and pool.num_cached() == 0
    assert pool.free_queue() == (2, 3, 1)  # the order stays; only hashes go


# -- the scheduler: hits, sharing, eviction -----------------------------------------------------


def test_a_repeat_hits_every_full_block_but_the_one_holding_the_last_token():
    s = core()
    a = req("a", list(range(10)))  # blocks: [0-3] [4-7] [8-9 partial]
    s.add_request(a)
    assert step(s) == [("a", 10)]
    assert a.status is Status.FINISHED and a.num_cached_tokens == 0
    assert s.pool.free_queue() == (3, 4, 5, 6, 7, 8, 9, 10, 2, 1)  # tail first: 3, then 2, 1

    b = req("b", list(range(10)))
    s.add_request(b)
    plan = s.schedule()
    assert b.blocks == [1, 2, 3] and b.num_cached_tokens == 8
    assert plan.scheduled == ((b, 2),) and plan.prefill_tokens == 2
    s.update(plan)

    c = req("c", list(range(8)))  # exactly two blocks: the last token is recomputed
    s.add_request(c)
    s.schedule()
    assert c.num_cached_tokens == 4 and c.blocks[0] == 1
    assert (s.prefix_queries, s.prefix_hits) == (28, 12)


def test_requests_scheduled_in_the_same_step_share_blocks_registered_at_allocation():
    s = core()
    a, b = req("a", [*range(8), 100]), req("b", [*range(8), 200])
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 9), ("b", 1)]
    assert a.blocks == [1, 2, 3] and b.blocks == [1, 2, 4]
    assert b.num_cached_tokens == 8
    assert (s.pool.ref_count(1), s.pool.ref_count(2), s.pool.ref_count(3)) == (2, 2, 1)


def test_a_finished_prompt_is_evicted_tail_first():
    s = core(num_blocks=8)  # 7 usable blocks
    a = req("a", list(range(12)))  # three full blocks, all registered
    s.add_request(a)
    step(s)
    assert a.blocks == [] and s.pool.free_queue() == (4, 5, 6, 7, 3, 2, 1)

    d = req("d", list(range(100, 121)))  # 21 tokens: six blocks, the last two from a's tail
    s.add_request(d)
    s.schedule()
    assert d.blocks == [4, 5, 6, 7, 3, 2]
    assert s.pool.evictions == 2
    s.abort("d")

    a2 = req("a2", list(range(12)))
    s.add_request(a2)
    s.schedule()
    assert a2.num_cached_tokens == 4  # only a's head block survived


def test_output_blocks_are_cached_once_all_their_tokens_are_computed():
    s = core()
    a = req("a", [1, 2, 3, 4, 5, 6], max_tokens=7)
    s.add_request(a)
    while not a.finished:
        step(s)
    # 6 prompt + 6 computed output tokens = three full blocks; the 7th output is never computed.
    follow_up = req("f", [1, 2, 3, 4, 5, 6, *([7] * 7), 99])
    s.add_request(follow_up)
    s.schedule()
    assert follow_up.num_cached_tokens == 12


def test_a_prefix_longer_than_the_token_budget_is_chunked_and_its_siblings_wait_then_hit():
    s = core(budget=8)
    a, b = req("a", [*range(14), 100]), req("b", [*range(14), 200])
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    assert [(r.request_id, n) for r, n in first.scheduled] == [("a", 8)]  # no budget left for b
    assert a.blocks == [1, 2] and b.status is Status.WAITING
    s.update(first)
    assert a.num_output == 0  # a partial prefill samples nothing

    second = s.schedule()
    assert [(r.request_id, n) for r, n in second.scheduled] == [("a", 7), ("b", 1)]
    assert a.blocks == [1, 2, 3, 4] and b.blocks == [1, 2, 3, 5]
    assert b.num_cached_tokens == 12 and second.prefill_tokens == 8
    s.update(second)
    assert a.finished and not b.finished

    assert step(s) == [("b", 2)]
    assert b.finished


def test_max_num_seqs_caps_the_running_requests():
    s = core(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", [i] * 5, max_tokens=2))
    assert step(s) == [("r0", 5), ("r1", 5)]
    assert step(s) == [("r0", 1), ("r1", 1)]
    assert step(s) == [("r2", 5)]


def test_preemption_frees_the_last_running_request_and_its_hit_stays_as_first_scheduled():
    s = core(num_blocks=7)  # 6 usable blocks
    a = req("a", list(range(7)), max_tokens=3)
    b = req("b", list(range(100, 105)), max_tokens=4)
    c = req("c", list(range(200, 207)), max_tokens=3)
    for r in (a, b, c):
        s.add_request(r)
    assert step(s) == [("a", 7), ("b", 5), ("c", 7)]
    assert (a.blocks, b.blocks, c.blocks) == ([1, 2], [3, 4], [5, 6])
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]  # c's second block is now full: registered

    # a's next token needs a third block; none is free, so c (last running) is preempted.
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 1)]
    assert plan.preempted == 1 and s.num_preemptions == 1
    assert c.status is Status.PREEMPTED and c.blocks == [] and list(s.waiting) == [c]
    assert a.blocks == [1, 2, 6]  # c freed tail first (6, 5); a took 6 and evicted its hash
    s.update(plan)
    assert a.finished and s.pool.free_queue() == (6, 5, 2, 1)  # a's unhashed tail block first

    # c comes back: its first block (5) survived in the free queue, its second did not.
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 1), ("c", 5)]
    assert c.blocks == [5, 6, 2]
    assert c.num_cached_tokens == 0  # fixed when c was first scheduled, as vLLM reports it
    assert s.prefix_queries == 19 and s.prefix_hits == 0  # resumed requests are not counted
    s.update(plan)
    while s.has_work():
        step(s)
    assert s.pool.num_free == 6 and c.num_output == 3


def test_a_step_that_preempts_admits_no_waiting_request():
    s = core(num_blocks=5, max_model_len=16)  # 4 usable blocks
    a = req("a", list(range(7)), max_tokens=9)
    b = req("b", list(range(100, 107)), max_tokens=9)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    s.add_request(req("tiny", [1], max_tokens=1))
    plan = s.schedule()
    assert plan.preempted == 1 and [r.request_id for r, _ in plan.scheduled] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "tiny"]


def test_abort_frees_blocks_tail_first_and_forgets_the_request():
    s = core()
    a = req("a", list(range(9)), max_tokens=5)
    s.add_request(a)
    step(s)
    assert s.abort("a") is a and a.status is Status.ABORTED
    assert s.pool.free_queue() == (3, 4, 5, 6, 7, 8, 9, 10, 2, 1)
    assert s.abort("a") is None and not s.has_work()


def test_a_cache_salt_or_lora_namespaces_every_block():
    s = core()
    for rid, ns in (("plain", NS), ("salted", Namespace("sim", tenant="t")),
                    ("lora", Namespace("sim", lora="l")), ("salted2", Namespace("sim", tenant="t"))):
        r = req(rid, list(range(9)), namespace=ns)
        s.add_request(r)
        step(s)
        assert r.num_cached_tokens == (8 if rid == "salted2" else 0), rid


# -- the engine on its virtual clock ------------------------------------------------------------


async def collect(sim: SimEngine, rid: str, prompt: list[int], max_tokens: int | None = 1, *,
                  delay: float = 0.0, **kw) -> list:
    if delay:
        await sim.clock.sleep(delay)
    return [out async for out in sim.generate(
        EngineRequest(rid, prompt, FakeSamplingParams(max_tokens), **kw))]


def small_sim(**kw) -> SimEngine:
    args = dict(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=32,
                step_time=StepTimeModel(alpha=1.0, beta=0.1, gamma=0.01))
    args.update(kw)
    return SimEngine(**args)


def test_sim_engine_is_an_engine_and_its_clock_a_clock():
    sim = SimEngine()
    assert isinstance(sim, Engine) and isinstance(sim.clock, Clock)
    assert (sim.block_size, sim.num_blocks, sim.max_model_len, sim.model_name) == (16, 4095, 32768, "sim")
    assert sim.kv_stats() is None and sim.num_preemptions == 0


async def test_steps_take_model_time_and_outputs_are_cumulative():
    steps = []
    sim = small_sim(on_step=lambda start, seconds, plan: steps.append(
        (start, seconds, plan.prefill_tokens, plan.decode_seqs)))
    outs = await collect(sim, "r", list(range(10)), max_tokens=3)
    assert steps == [(0.0, 2.0, 10, 0), (2.0, 1.01, 0, 1), (3.01, 1.01, 0, 1)]
    assert [o.outputs[0].token_ids for o in outs] == [(7,), (7, 7), (7, 7, 7)]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].prompt_token_ids == tuple(range(10))
    # prefill 10 tokens: 1 + 0.1 * 10; then two decode steps of 1 + 0.01
    assert sim.clock.now() == pytest.approx(2.0 + 2 * 1.01)


async def test_delta_and_final_only_output_kinds():
    @dataclass(frozen=True)
    class Kind:
        name: str

    @dataclass(frozen=True)
    class Params:
        max_tokens: int
        output_kind: Kind

    sim = small_sim()
    delta = [o async for o in sim.generate(EngineRequest("d", [1, 2], Params(3, Kind("DELTA"))))]
    assert [o.outputs[0].token_ids for o in delta] == [(7,), (7,), (7,)]
    final = [o async for o in sim.generate(EngineRequest("f", [1, 2], Params(3, Kind("FINAL_ONLY"))))]
    assert len(final) == 1 and final[0].outputs[0].token_ids == (7, 7, 7)


async def test_concurrent_arrivals_at_one_instant_share_the_first_step():
    sim = small_sim()

    async def late_submitter():
        for _ in range(50):  # a long chain of plain yields: virtual time must wait for it
            await asyncio.sleep(0)
        assert sim.clock.now() == 0.0
        return await collect(sim, "late", [*range(8), 2])

    _, late = await asyncio.gather(collect(sim, "first", [*range(8), 1]), late_submitter())
    assert late[-1].num_cached_tokens == 8  # scheduled in the same step, after "first"
    assert sim.kv_stats().steps == 1


async def test_the_same_trace_gives_the_same_outputs_and_times():
    async def run() -> list:
        sim = small_sim(num_blocks=20, max_model_len=64)
        rng = random.Random(7)
        prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]

        async def client(i: int):
            outs = await collect(sim, f"r{i}", [*rng.choice(prefixes), i], max_tokens=rng.randrange(1, 9),
                                 delay=rng.expovariate(2.0) * i)
            return sim.clock.now(), outs[-1].num_cached_tokens, len(outs)

        results = await asyncio.gather(*(client(i) for i in range(40)))
        return [results, sim.kv_stats(), sim.num_preemptions]

    first, second = await run(), await run()
    assert first == second
    assert first[2] > 0  # the 20-block pool forced preemptions: determinism covers them too


async def test_the_engine_goes_idle_with_no_task_left_behind():
    sim = small_sim()

    def own_tasks() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if (frame := t.get_coro().cr_frame) is not None
                and frame.f_locals.get("self") in (sim, sim.clock)]

    stream = sim.generate(EngineRequest("r", [1, 2, 3], FakeSamplingParams(2)))
    await stream.__anext__()
    assert len(own_tasks()) == 2  # the step loop and the clock's driver
    async for _ in stream:
        pass
    await sim.clock.sleep(0)  # a barrier: the step loop finds no work and exits
    await asyncio.sleep(0.01)  # block (on a real timer) so the driver sees the loop idle and exits
    assert own_tasks() == [] and repr(sim.clock).endswith("pending=0)")


async def test_two_simulations_share_one_event_loop_without_disturbing_each_other():
    async def alone() -> tuple[float, int]:
        sim = small_sim()
        outs = await collect(sim, "r", list(range(10)), max_tokens=5)
        return sim.clock.now(), outs[-1].num_cached_tokens

    reference = await alone()
    assert await asyncio.gather(alone(), alone()) == [reference, reference]


async def test_clock_wakes_sleepers_in_deadline_order_and_ignores_cancelled_ones():
    clock = SimClock(start=10.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float):
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    doomed = asyncio.ensure_future(clock.sleep(100.0))
    tasks = [asyncio.ensure_future(sleeper(n, s)) for n, s in (("b", 2.0), ("a", 1.0), ("c", 2.0))]
    await asyncio.sleep(0)
    doomed.cancel()
    await asyncio.gather(*tasks)
    assert woke == [("a", 11.0), ("b", 12.0), ("c", 12.0)]
    await asyncio.sleep(0)
    assert clock.now() == 12.0  # the cancelled 100 s sleep never moved time


async def test_kv_stats_count_evictable_blocks_as_free_and_accumulate():
    sim = small_sim(num_blocks=21, max_model_len=64)  # 20 usable blocks
    seen = []

    async def watch():
        async for out in sim.generate(EngineRequest("a", list(range(9)), FakeSamplingParams(3))):
            seen.append((out.finished, sim.kv_stats()))

    await watch()
    during = seen[0][1]
    assert during.total_blocks == 20 and during.running == 1 and during.steps == 1
    assert during.free_blocks == 17  # a holds 3 of 20 usable blocks
    assert during.time == pytest.approx(1.9)
    after = sim.kv_stats()
    assert after.free_blocks == 20 and after.running == 0 and after.usage == 0.0  # cached, evictable
    assert (after.prefix_queries, after.prefix_hits) == (9, 0)
    await collect(sim, "b", list(range(9)))
    assert (sim.kv_stats().prefix_queries, sim.kv_stats().prefix_hits) == (18, 8)


async def test_abort_ends_the_stream_and_frees_the_blocks():
    sim = small_sim(num_blocks=21, max_model_len=64)
    outs = []
    async for out in sim.generate(EngineRequest("a", list(range(9)), FakeSamplingParams(50))):
        outs.append(out)
        if len(outs) == 2:
            await sim.abort("a")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sim.scheduler.pool.num_free == 20 and not sim.scheduler.has_work()


async def test_closing_the_stream_early_aborts_the_request():
    sim = small_sim()
    stream = sim.generate(EngineRequest("a", list(range(9)), FakeSamplingParams(50)))
    await stream.__anext__()
    await stream.aclose()
    await sim.clock.sleep(10)
    assert not sim.scheduler.has_work() and sim.scheduler.pool.num_free == 63


async def test_reset_prefix_cache_refuses_while_blocks_are_held_then_drops_every_hit():
    sim = small_sim()
    stream = sim.generate(EngineRequest("a", list(range(9)), FakeSamplingParams(3)))
    await stream.__anext__()
    assert not await sim.reset_prefix_cache()
    async for _ in stream:
        pass
    assert await sim.reset_prefix_cache()
    assert (await collect(sim, "b", list(range(9))))[-1].num_cached_tokens == 0


async def test_prompt_logprobs_skip_the_cache_and_its_statistics():
    @dataclass(frozen=True)
    class Params:
        max_tokens: int = 1
        prompt_logprobs: int | None = 1

    sim = small_sim()
    await collect(sim, "a", list(range(9)))
    check = sim.check_sampling_params(Params())
    assert not check.reads_cache
    outs = [o async for o in sim.generate(EngineRequest("b", list(range(9)), Params()))]
    assert outs[-1].num_cached_tokens == 0 and sim.kv_stats().prefix_queries == 9


async def test_invalid_requests_are_refused():
    sim = small_sim()
    for bad in (None, object(), FakeSamplingParams(0)):
        with pytest.raises(InvalidRequest):
            sim.check_sampling_params(bad)
    assert sim.check_sampling_params(FakeSamplingParams(None)).max_tokens is None
    with pytest.raises(InvalidRequest):
        await collect(sim, "empty", [])
    with pytest.raises(PromptTooLong):
        await collect(sim, "long", [1] * 128)
    outs = await collect(sim, "fill", [1] * 120, max_tokens=None)
    assert len(outs[-1].outputs[0].token_ids) == 8  # max_tokens None: up to max_model_len
    stream = sim.generate(EngineRequest("dup", [1, 2], FakeSamplingParams(5)))
    await stream.__anext__()
    with pytest.raises(InvalidRequest):
        await collect(sim, "dup", [1, 2])
    await stream.aclose()
    with pytest.raises(ValueError):
        SimEngine(block_size=16, num_blocks=8, max_model_len=1024)
    with pytest.raises(ValueError):
        StepTimeModel(alpha=-1.0, beta=0.0, gamma=0.0)


def test_with_overlap_arrivals_cost_only_what_outlasts_the_prefill_compute():
    model = dict(alpha=1e-3, beta=1e-5, gamma=1e-4, zeta=2e-3, eta=1e-6)
    added, overlapped = StepTimeModel(**model), StepTimeModel(**model, overlap=True)
    # A burst of 4 arrivals (4 x 2 ms + 4k tokens x 1 us = 12 ms) beside a 2048-token prefill
    # (20.48 ms): hidden when they overlap, added when they do not.
    burst = dict(new_requests=4, new_prompt_tokens=4096)
    assert overlapped.seconds(2048, 0, **burst) == pytest.approx(1e-3 + 20.48e-3)
    assert added.seconds(2048, 0, **burst) == pytest.approx(1e-3 + 32.576e-3)
    # One arrival joining 64 decodes with no prefill to hide behind costs all of its work.
    assert overlapped.seconds(0, 64, new_requests=1, new_prompt_tokens=2000) == pytest.approx(
        1e-3 + 6.4e-3 + 4e-3)
    assert overlapped.seconds(0, 64) == added.seconds(0, 64)
    with pytest.raises(ValueError):
        StepTimeModel(overlap=1)  # type: ignore[arg-type]


async def test_a_frontend_busy_on_the_engine_cores_cpu_lengthens_steps_by_the_shared_part():
    from prefixgate.sim import LoopServer

    async def step_seconds(shared: float, backlogs: tuple[float, ...]) -> list[float]:
        seconds: list[float] = []
        sim = SimEngine(block_size=16, num_blocks=64, max_model_len=256,
                        step_time=StepTimeModel(alpha=0.010, beta=0.0, gamma=0.0, shared=shared),
                        on_step=lambda _t, s, _p: seconds.append(s))
        cpus = [LoopServer(sim.clock) for _ in backlogs]
        sim.shared_cpus = cpus
        work = [asyncio.ensure_future(cpu.spend(b)) for cpu, b in zip(cpus, backlogs, strict=True)]
        await sim.clock.sleep(0)  # the work is queued before the first step starts
        await collect(sim, "r", [1, 2, 3], max_tokens=3)
        await asyncio.gather(*work)
        return seconds

    # 3 steps of 10 ms; a CPU with 20 ms queued is busy for all of the first (15 ms with half
    # of it added), the first 5 ms of the second, none of the third.
    assert await step_seconds(0.5, (0.020,)) == pytest.approx([0.015, 0.0125, 0.010])
    assert await step_seconds(0.5, (1.0, 1.0)) == pytest.approx([0.020] * 3)  # each busy CPU adds its share
    assert await step_seconds(0.0, (1.0,)) == pytest.approx([0.010] * 3)  # no shared core: no cost
    assert await step_seconds(0.5, ()) == pytest.approx([0.010] * 3)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="shared"):
            StepTimeModel(shared=bad)


async def test_a_gateway_on_the_simulator_predicts_its_hits():
    from prefixgate import Gateway, GatewayConfig

    sim = SimEngine(block_size=16, num_blocks=256, max_model_len=1024)
    async with Gateway(sim, GatewayConfig(isolate_tenants=False), clock=sim.clock) as gw:

        async def ask(i: int):
            stream = gw.generate("You are a helpful assistant. " * 8 + f"Question {i}?",
                                 FakeSamplingParams(4), request_id=f"q{i}")
            async for _ in stream:
                pass
            return stream.predicted_hit_tokens, stream.cached_tokens

        results = await asyncio.gather(*(ask(i) for i in range(6)))
    assert all(predicted == cached for predicted, cached in results)
    assert results[0] == (0, 0) and results[1][1] > 0


async def test_the_engine_cores_part_of_a_step_takes_turns_with_the_frontend_on_their_core():
    from prefixgate.sim import SharedCore

    async def step_seconds(loop_work: float) -> tuple[list[float], float]:
        seconds: list[float] = []
        sim = SimEngine(block_size=16, num_blocks=64, max_model_len=256,
                        step_time=StepTimeModel(alpha=0.010, beta=0.0, gamma=0.0, shared=0.4),
                        on_step=lambda _t, s, _p: seconds.append(s))
        core = SharedCore(sim.clock)
        sim.core_thread, loop = core.thread(), core.thread()
        work = asyncio.ensure_future(loop.spend(loop_work))
        await sim.clock.sleep(0)
        await collect(sim, "r", [1, 2, 3], max_tokens=3)
        await work
        return seconds, loop.busy_between(0.0, 1.0)

    # Alone, a step is its 4 ms on the core and 6 ms waiting for the worker.
    assert (await step_seconds(0.0))[0] == pytest.approx([0.010] * 3)
    # With the loop busy throughout, the engine core's 4 ms take 8 ms: 1 + shared as long.
    steps, busy = await step_seconds(1.0)
    assert steps == pytest.approx([0.014] * 3)
    # The loop lost the core for half of those 8 ms, 12 ms in all, and not while the worker ran.
    assert busy == pytest.approx(1.0 - 0.012)


async def test_the_engine_core_waits_for_its_core_only_while_the_frontend_has_work_there():
    from prefixgate.sim import SharedCore

    async def step_seconds(loop_work: float, **terms: float) -> list[float]:
        seconds: list[float] = []
        sim = SimEngine(block_size=16, num_blocks=64, max_model_len=256,
                        step_time=StepTimeModel(alpha=0.010, beta=0.0, gamma=0.0, **terms),
                        on_step=lambda _t, s, _p: seconds.append(s))
        core = SharedCore(sim.clock)
        sim.core_thread, loop = core.thread(), core.thread()
        work = asyncio.ensure_future(loop.spend(loop_work))
        await sim.clock.sleep(0)
        await collect(sim, "r", [1, 2, 3], max_tokens=3)
        await work
        return seconds

    terms = {"shared_step": 0.002, "core_wait": 0.003}
    assert await step_seconds(0.0, **terms) == pytest.approx([0.010] * 3)
    # Busy throughout: 2 ms of its own at half speed, 8 ms of the worker's, then 3 ms for the core.
    assert await step_seconds(1.0, **terms) == pytest.approx([0.015] * 3)
    # 5 ms of loop work: 2 of it beside the engine core's own 2 ms, the rest done alone by 7 ms,
    # so when the worker is done at 12 ms the core is free and nothing is waited for.
    assert await step_seconds(0.005, **terms) == pytest.approx([0.012, 0.010, 0.010])
    # Its own work grows with the step's decoding sequences and the prompt tokens taken in.
    busy = await step_seconds(1.0, core_seq=0.001, core_token=0.0005)
    assert busy == pytest.approx([0.0115, 0.011, 0.011])  # 3 tokens in; then one sequence decoding
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="core_wait"):
            StepTimeModel(core_wait=bad)


async def test_the_output_processor_reads_each_steps_outputs_on_the_loop_before_the_client_sees_them():
    from prefixgate.sim import LoopServer

    sim = SimEngine(block_size=16, num_blocks=64, max_model_len=256,
                    step_time=StepTimeModel(alpha=0.010, beta=0.0, gamma=0.0))
    loop = LoopServer(sim.clock)
    sim.output_cpu, sim.output_cost = loop, 0.002
    seen: list[float] = []
    outputs = sim.generate(EngineRequest("r", [1, 2, 3], FakeSamplingParams(3)))
    async for _ in outputs:
        seen.append(sim.clock.now())
    # Each step's output reaches the client 2 ms after the step, while the engine steps on.
    assert seen == pytest.approx([0.012, 0.022, 0.032])
    assert loop.busy_seconds == pytest.approx(0.006)
    # Two requests with an output in one step: the processor reads both before either sees it.
    seen.clear()

    async def one(rid: str) -> None:
        async for _ in sim.generate(EngineRequest(rid, [5, 6, 7], FakeSamplingParams(1))):
            seen.append(sim.clock.now())

    start = sim.clock.now()
    await asyncio.gather(one("a"), one("b"))
    assert [t - start for t in seen] == pytest.approx([0.014, 0.014])


def test_kappa_counts_a_shared_prefixs_kv_once_per_step():
    model = StepTimeModel(alpha=1e-3, beta=0.0, gamma=0.0, delta=1e-6, kappa=2e-6)
    # 4 decoders of 1,000 tokens, 900 of them a prefix they share: 4,000 read, 1,300 distinct.
    assert model.seconds(0, 4, decode_context=4000, decode_distinct=1300) == pytest.approx(
        1e-3 + 4e-3 + 2.6e-3)
    assert model.seconds(0, 4, decode_context=4000) == pytest.approx(1e-3 + 4e-3 + 8e-3)


def test_the_plan_counts_blocks_that_decoders_share_once():
    core = SimScheduler(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=512,
                        max_model_len=128, enable_caching=True)
    prefix = list(range(100, 116))  # 4 full blocks
    core.add_request(req("r0", [*prefix, 0, 0], max_tokens=8))
    plans = [core.schedule()]
    core.update(plans[0])  # its prefix is cached: the others' hit it
    for i in (1, 2):
        core.add_request(req(f"r{i}", [*prefix, i, i], max_tokens=8))
    while core.has_work():
        plan = core.schedule()
        plans.append(plan)
        core.update(plan)
    decodes = [p for p in plans if p.decode_seqs == 3]
    assert decodes
    for p in decodes:  # each reads the 16 shared tokens and its own; the 16 are counted once
        assert p.decode_distinct == p.decode_context - 2 * 16
    assert all(p.decode_distinct == p.decode_context for p in plans if p.decode_seqs == 1)
