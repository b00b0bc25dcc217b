"""The step-time fitter and the event-loop charge (issue 15): the fitter is tested, not the machine.

``benchmarks.fit_step_model`` reconstructs each step's context work from vLLM's per-step counts
and fits :class:`prefixgate.sim.StepTimeModel`; the simulator's own steps, whose terms are known
exactly, check both. The committed profiles must come back from their own synthetic data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess

import pytest

from benchmarks.engines import SIM_PROFILES, warm_batch_shapes
from benchmarks.fit_step_model import (
    Calibration,
    ContextTracker,
    LoopPhase,
    StepRecord,
    calibrate_sim,
    calibration_steps,
    fit,
    fit_loop_cost,
    measure_canon_cost,
    measure_engine_core,
    measure_loop_stretch,
    measure_shared,
    measure_text_cost,
    report,
    run_calibration,
)
from prefixgate.sim import LoopCost, LoopServer, SharedCore, SimClock, SimEngine, StepTimeModel
from prefixgate.testing import ByteTokenizer, FakeSamplingParams

COEFFICIENTS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota")
# A refit from synthetic steps must reproduce a committed profile to within this, per coefficient
# (relative), and to 1e-12 s absolute for coefficients that are 0.
TOLERANCE = 0.01


async def _plans_and_tracker(block_size: int, max_model_len: int) -> tuple[list[tuple[int, ...]],
                                                                           list[tuple[int, ...]]]:
    tracker = ContextTracker()
    exact: list[tuple[int, ...]] = []
    rebuilt: list[tuple[int, ...]] = []

    in_engine = 0

    def on_step(_start: float, _seconds: float, plan: object) -> None:
        # What vLLM reports: running + waiting after the step, and the requests it finished.
        nonlocal in_engine
        exact.append((plan.decode_context, plan.prefill_context, plan.new_requests,  # type: ignore[attr-defined]
                      plan.new_prompt_tokens, plan.decode_distinct))  # type: ignore[attr-defined]
        stats = sim.kv_stats()
        now = stats.running + stats.waiting
        finished = sum(r.finished for r, _ in plan.scheduled)  # type: ignore[attr-defined]
        rebuilt.append((*tracker.step(plan.prefill_tokens, plan.decode_seqs,  # type: ignore[attr-defined]
                                      now - in_engine + finished), tracker.decode_distinct))
        in_engine = now

    sim = SimEngine(block_size=block_size, num_blocks=64 * max_model_len // block_size, max_num_seqs=128,
                    max_num_batched_tokens=2048, max_model_len=max_model_len, on_step=on_step)
    cal = Calibration(prefill_prompts=12, decode_tokens=8)
    await run_calibration(sim, FakeSamplingParams, cal, vocab=3000, tracker=tracker)
    return exact, rebuilt


@pytest.mark.parametrize("block_size,max_model_len", [(128, 4096), (16, 16_384)])
async def test_the_tracker_rebuilds_each_steps_context_work_from_the_counts_vllm_reports(
        block_size: int, max_model_len: int) -> None:
    exact, rebuilt = await _plans_and_tracker(block_size, max_model_len)
    assert len(exact) > 50
    assert any(e[0] for e in exact) and any(e[1] for e in exact) and any(e[2] > 8 for e in exact)
    assert any(e[4] < e[0] // 4 for e in exact)  # decoders over one prefix: its blocks counted once
    mismatched = [(i, e, r) for i, (e, r) in enumerate(zip(exact, rebuilt, strict=True)) if e != r]
    assert not mismatched, mismatched[:5]


@pytest.mark.parametrize("size", sorted(SIM_PROFILES))
async def test_the_fit_reproduces_each_committed_profile_from_its_own_synthetic_steps(size: str) -> None:
    # The fitter fits the additive form (each step's arrivals on top of its prefill); a GPU
    # profile takes the same coefficients with StepTimeModel.overlap on.
    profile = SIM_PROFILES[size]
    model = StepTimeModel(*profile.step_time)
    truth = tuple(getattr(model, name) for name in COEFFICIENTS)
    records, _ = await calibrate_sim(Calibration(), truth, max_model_len=profile.max_model_len,
                                     block_size=profile.block_size)
    got = report(records, {})["fit"]
    for name, want in zip(COEFFICIENTS, truth, strict=True):
        assert got[name] == pytest.approx(want, rel=TOLERANCE, abs=1e-12), (size, name)


def test_the_fit_drops_a_step_slowed_by_a_neighbour_and_keeps_coefficients_non_negative() -> None:
    rows = [(0.002 + 1e-5 * p + 3e-4 * d, p, d) for p in (0, 512, 2048) for d in (1, 8, 64)]
    rows.append((0.5, 512, 8))  # the CPU stolen for half a second
    f = fit(rows)
    assert (f.alpha, f.beta, f.gamma) == pytest.approx((0.002, 1e-5, 3e-4), rel=1e-6)
    assert f.steps == len(rows) - 1
    g = fit([(0.001 - 1e-6 * p, p, 1) for p in (0, 100, 200, 300)])  # time falling with prefill
    assert min(g.alpha, g.beta, g.gamma) >= 0


def test_loop_costs_come_apart_into_per_request_per_output_per_token_and_the_gateways_excess() -> None:
    want = LoopCost(request=300e-6, output=20e-6, request_token=0.3e-6, prompt_token=0.5e-6,
                    gateway_request=100e-6, gateway_output=5e-6, gateway_token=0.1e-6)

    alone = 0.4e-6  # the tokenizer timed by itself: cheaper than among the frontend's work
    thread = 0.3e-6  # the gateway's ingress thread, per token (long prompts; short are inline)

    def phase(path: str, max_tokens: int, outputs_each: int, tokens: float,
              process: bool = True) -> LoopPhase:
        per = want.request + (outputs_each - 1) * want.output + tokens * want.request_token
        if path == "gateway":
            per += (want.gateway_request + (outputs_each - 1) * want.gateway_output
                    + tokens * want.gateway_token)
        if path == "text":
            per += tokens * want.prompt_token
        elsewhere = thread * tokens if path == "gateway" and tokens > 512 else 0.0
        return LoopPhase(path, 100, max_tokens, 100 * outputs_each, 100 * per, 1.0, tokens,
                         100 * (per + elsewhere) if process else 0.0)

    kinds = (("bare", 1, 1, 70.0), ("bare", 16, 12, 70.0), ("bare", 1, 1, 2100.0),
             ("gateway", 1, 1, 71.0), ("gateway", 16, 9, 71.0), ("gateway", 1, 1, 2090.0))
    phases = [phase(path, k, n, t) for path, k, n, t in kinds]
    text = [phase("text", 1, 1, 70.0), phase("text", 1, 1, 2100.0)]
    fitted = {k: v for k, v in dataclasses.asdict(want).items()
              if isinstance(v, float) and k not in ("char_part", "text_chars", "canon_request", "canon_char")}
    # (measure_text_cost's and measure_canon_cost's)
    # With text floods, prompt_token is their excess over bare; the ingress thread's cost is the
    # gateway floods' CPU outside the loop's thread (their number is set, not fitted).
    got = fit_loop_cost((phases + text) * 3, alone)
    assert got == pytest.approx({**fitted, "ingress_token": thread}, rel=1e-9)
    # Without either, both are the tokenizer's own cost.
    bare = [phase(path, k, n, t, process=False) for path, k, n, t in kinds]
    got = fit_loop_cost(bare * 3, alone)
    assert got == pytest.approx({**fitted, "prompt_token": alone, "ingress_token": alone}, rel=1e-9)


async def _finish_times(server: LoopServer, clock: SimClock,
                        jobs: dict[str, tuple[float, float]]) -> dict[str, float]:
    """When each job ``name: (arrives at, seconds of work)`` handed to ``server`` is done."""
    done: dict[str, float] = {}

    async def work(name: str, at: float, seconds: float) -> None:
        await clock.sleep(at)
        await server.spend(seconds)
        done[name] = clock.now()

    await asyncio.gather(*(work(name, at, seconds) for name, (at, seconds) in jobs.items()))
    return done


async def test_the_loop_runs_one_piece_of_work_at_a_time_in_arrival_order() -> None:
    clock = SimClock()
    loop = LoopServer(clock)
    done = await _finish_times(loop, clock, {"a": (0.0, 0.010), "b": (0.001, 0.005), "c": (0.030, 0.002),
                                             "free": (0.0, 0.0)})
    assert done == pytest.approx({"a": 0.010, "b": 0.015, "c": 0.032, "free": 0.0})
    assert loop.busy_seconds == pytest.approx(0.017)


async def test_a_pool_of_workers_runs_as_many_pieces_of_work_side_by_side_each_in_arrival_order() -> None:
    clock = SimClock()
    jobs = {"a": (0.0, 0.010), "b": (0.0, 0.004), "c": (0.001, 0.003), "d": (0.002, 0.001)}
    done = await _finish_times(LoopServer(clock, workers=2), clock, jobs)
    # a and b start at once; c waits for b's worker (free at 0.004), d for the next free one (c's).
    assert done == pytest.approx({"a": 0.010, "b": 0.004, "c": 0.007, "d": 0.008})
    with pytest.raises(ValueError, match="at least one worker"):
        LoopServer(clock, workers=0)


async def test_threads_on_a_shared_core_split_it_while_both_have_work() -> None:
    from prefixgate.sim import CoreThread, SharedCore

    clock = SimClock()
    core = SharedCore(clock)
    loop, ingress = core.thread(), core.thread()

    async def work(thread: CoreThread, at: float, seconds: float) -> float:
        await clock.sleep(at)
        await thread.spend(seconds)
        return clock.now()

    # ingress: 10 ms then 10 ms queued at 0; the loop: 2 ms at 1 ms, 4 ms at 20 ms.
    # 0-1 ms ingress alone (1 ms done); 1-5 ms both at half speed (loop's 2 ms done at 5 ms,
    # ingress at 3 ms); 5-12 ms ingress alone finishes its first job; 12-20 ms its second runs
    # alone (8 ms of 10); 20-24 ms both (2 ms each: ingress done at 24); the loop's last 2 ms alone.
    done = await asyncio.gather(work(ingress, 0.0, 0.010), work(ingress, 0.0, 0.010),
                                work(loop, 0.001, 0.002), work(loop, 0.020, 0.004))
    assert done == pytest.approx([0.012, 0.024, 0.005, 0.026])
    # Each thread's CPU time, its share while both ran: the CPU was never busier than one.
    assert loop.busy_between(0.0, 0.030) == pytest.approx(0.006)
    assert ingress.busy_between(0.0, 0.030) == pytest.approx(0.020)
    assert loop.busy_seconds == pytest.approx(0.006) and ingress.busy_seconds == pytest.approx(0.020)
    # Alone, a thread has the core: FIFO, as LoopServer.
    solo = SharedCore(clock).thread()
    start = clock.now()
    await solo.spend(0.003)
    assert clock.now() - start == pytest.approx(0.003)


async def test_a_client_sees_its_first_token_only_once_the_busy_loop_has_read_it() -> None:
    from benchmarks.engines import SimFactory
    from benchmarks.harness import run_arm
    from benchmarks.workloads import make_trace
    from prefixgate.testing import ByteTokenizer

    # Ten requests at once, each 50 ms of tokenizing on the loop: the first ones reach the engine
    # early, but their first outputs queue behind the others' tokenizing, as on a real loop.
    cost = {"request": 0.001, "output": 0.001, "prompt_token": 0.050 / 72}
    trace = make_trace("W1", "sim", seed=0, tokenizer=ByteTokenizer(),
                       overrides={"groups": 2, "per_group": 5, "prefix_tokens": 64, "suffix_tokens": 8,
                                  "max_tokens": 2})
    running = await SimFactory("sim", ByteTokenizer(), loop_cost=cost).start(caching=True, kv_cap_tokens=None)
    run = await run_arm("B1", 0, trace, running)
    first = min(r.first_output - r.arrival for r in run.records if r.first_output is not None)
    assert first >= 0.9 * len(trace.requests) * 0.050


async def test_through_ingress_workers_a_request_is_queued_only_once_a_worker_has_prepared_it() -> None:
    from benchmarks.engines import SimFactory
    from benchmarks.harness import run_arm
    from benchmarks.workloads import make_trace
    from prefixgate.testing import ByteTokenizer

    trace = make_trace("W1", "sim", seed=0, tokenizer=ByteTokenizer(),
                       overrides={"groups": 2, "per_group": 4, "prefix_tokens": 64, "suffix_tokens": 8,
                                  "max_tokens": 2})
    tokens = [len(ByteTokenizer().encode(r.prompt)) for r in trace.requests]
    spans = {}
    for workers in (0, 1, 4):
        cost = {"request": 1e-4, "ingress_token": 1e-3, "ingress_workers": workers}
        running = await SimFactory("sim", ByteTokenizer(), loop_cost=cost).start(caching=True,
                                                                                 kv_cap_tokens=None)
        run = await run_arm("L", 0, trace, running)
        assert all(r.outcome == "completed" for r in run.records)
        spans[workers] = max(r.finished for r in run.records) - run.start
    assert spans[1] >= sum(tokens) * 1e-3  # one worker prepares every prompt in turn
    assert spans[0] < spans[4] < spans[1]  # four share the work; none charges nothing


async def test_the_gateway_stamps_a_burst_arrival_at_the_call_before_its_ingress() -> None:
    from benchmarks.engines import SimFactory
    from benchmarks.harness import run_arm
    from benchmarks.workloads import make_trace
    from prefixgate.testing import ByteTokenizer

    # As the real gateway does: the arrival is stamped when generate() is called, and the ingress
    # worker's time is part of the queue wait. Stamped after it, one burst's arrivals would
    # spread over the whole ingress, and the aging bound (which reads that spread) would fire.
    trace = make_trace("W1", "sim", seed=0, tokenizer=ByteTokenizer(),
                       overrides={"groups": 2, "per_group": 4, "prefix_tokens": 64, "suffix_tokens": 8,
                                  "max_tokens": 2})
    tokens = [len(ByteTokenizer().encode(r.prompt)) for r in trace.requests]
    cost = {"request": 1e-4, "ingress_token": 1e-3, "ingress_workers": 1}
    running = await SimFactory("sim", ByteTokenizer(), loop_cost=cost).start(caching=True, kv_cap_tokens=None)
    run = await run_arm("L", 0, trace, running)
    waits = [r.queue_wait for r in run.records]
    assert all(w is not None for w in waits)
    assert max(waits) >= sum(tokens) * 1e-3  # the last one prepared waited for every prompt
    assert run.gateway["aged_dispatches"] == 0


@pytest.mark.parametrize("bad", [-1e-6, float("inf"), float("nan"), True])
def test_a_loop_cost_must_be_a_finite_non_negative_number(bad: float) -> None:
    with pytest.raises(ValueError, match=r"LoopCost\.output"):
        LoopCost(output=bad)


async def test_the_harness_charges_the_loop_per_request_and_per_output_bare_and_through_the_gateway() -> None:
    from benchmarks.engines import SimFactory
    from benchmarks.harness import run_arm
    from benchmarks.workloads import make_trace
    from prefixgate.testing import ByteTokenizer

    cost = {"request": 0.010, "output": 0.001, "prompt_token": 0.0, "gateway_request": 0.005,
            "gateway_output": 0.0005}
    trace = make_trace("W1", "sim", seed=0, tokenizer=ByteTokenizer(),
                       overrides={"groups": 2, "per_group": 5, "prefix_tokens": 64, "suffix_tokens": 8,
                                  "max_tokens": 4})
    spans = {}
    for charged in (False, True):
        factory = SimFactory("sim", ByteTokenizer(), loop_cost=cost, charge_loop=charged)
        for arm in ("B1", "L"):
            running = await factory.start(caching=True, kv_cap_tokens=None)
            run = await run_arm(arm, 0, trace, running)
            assert all(r.outcome == "completed" for r in run.records)
            spans[arm, charged] = max(r.finished for r in run.records) - run.start
    n = len(trace.requests)
    # The burst's requests queue on the loop: at least n requests' work, and the last request's
    # further outputs after it (a lagging client gets a stream's outputs merged, as from vLLM).
    assert spans["B1", True] >= n * 0.010 + 3 * 0.001
    assert spans["L", True] >= n * 0.015 + 3 * 0.0015
    assert spans["B1", False] < n * 0.010 and spans["L", False] < n * 0.015


def test_calibration_steps_end_at_the_last_step_the_tracker_knew_work_for() -> None:
    known = [StepRecord(0.01, 512, 0, None, 0, 131072, 1, 512), StepRecord(0.01, 0, 1, None, 513)]
    floods = [StepRecord(0.002, 64, 0), StepRecord(0.003, 0, 30)]  # no context, no arrivals
    assert calibration_steps(known + floods) == known
    assert calibration_steps(known) == known


async def test_warming_batch_shapes_runs_one_step_of_every_size_once() -> None:
    sizes: list[int] = []
    sim = SimEngine(block_size=16, num_blocks=256, max_model_len=1024,
                    on_step=lambda _t, _s, plan: sizes.append(plan.prefill_tokens))
    await warm_batch_shapes(sim, FakeSamplingParams, 40)
    assert sorted(size for size in sizes if size) == list(range(1, 41))



@pytest.mark.parametrize("per_char", [0.0, 2e-7])
def test_measure_text_cost_reads_back_a_cost_that_goes_with_characters(per_char: float) -> None:
    # A tokenizer of words whose time is 1 us a token plus `per_char` a character, on a clock
    # that only it moves: the two styles' costs per token give the character part back.
    spent = [0.0]

    class Words:
        def encode(self, text: str, **_: object) -> list[int]:
            ids = [len(w) for w in text.split()]
            spent[0] += 1e-6 * len(ids) + per_char * len(text)
            return ids

    got = measure_text_cost(Words(), texts=4, words=300, rounds=2, cpu=lambda: spent[0])
    expected = per_char * got["text_chars"] / (1e-6 + per_char * got["text_chars"])
    assert got["char_part"] == pytest.approx(expected, abs=1e-9)
    assert got["prose_chars"] != pytest.approx(got["text_chars"], rel=0.02)  # two styles to fit through
    cost = LoopCost(char_part=got["char_part"], text_chars=got["text_chars"])
    assert cost.text_scale(round(got["text_chars"] * 1000), 1000) == pytest.approx(1.0, rel=1e-3)
    prose = cost.text_scale(round(got["prose_chars"] * 1000), 1000)
    assert prose == pytest.approx(got["prose_token_s"] / got["mixed_token_s"], rel=1e-3)


@pytest.mark.parametrize(("step", "seq", "token", "prefill", "wait"),
                         [(6e-4, 1e-5, 1e-7, 5e-8, 3e-3), (1e-3, 0.0, 2e-7, 0.0, 0.0)])
async def test_measure_engine_core_recovers_the_simulators_engine_core(step: float, seq: float, token: float,
                                                                       prefill: float, wait: float) -> None:
    # The fitter is tested, not the machine: the simulator's engine core runs its own work on the
    # core it shares with a loop that the measurement keeps busy (30 ms at a time, so the loop
    # almost always has more queued than the engine core waits), and the measurement must read
    # its CPU terms back from that thread's CPU seconds and its wait from the steps' stretch.
    records: list[StepRecord] = []
    sim = SimEngine(block_size=16, num_blocks=4096, max_model_len=4096, max_num_batched_tokens=2048,
                    step_time=StepTimeModel(alpha=0.002, beta=4e-6, gamma=5e-5, eta=3e-7, shared_step=step,
                                            core_seq=seq, core_token=token, core_prefill=prefill,
                                            core_wait=wait),
                    on_step=lambda _t, seconds, plan: records.append(StepRecord(seconds, plan.prefill_tokens,
                                                                                plan.decode_seqs)))
    core = SharedCore(sim.clock)
    sim.core_thread, loop = core.thread(), core.thread()
    got, phases = await measure_engine_core(sim, FakeSamplingParams, lambda: loop.spend(0.030), vocab=3000,
                                            records=records, core_cpu=lambda: sim.core_thread.busy_seconds,
                                            settle=0.0, now=sim.clock.now)
    assert got["shared_step"] == pytest.approx(step, rel=0.02)
    assert got["core_seq"] == pytest.approx(seq, rel=0.02, abs=1e-9)
    assert got["core_token"] == pytest.approx(token, rel=0.02, abs=1e-11)
    assert got["core_prefill"] == pytest.approx(prefill, rel=0.02, abs=1e-11)
    assert got["core_wait"] == pytest.approx(wait, rel=0.1, abs=1e-5)
    assert len(phases) == 16 and all(p["steps"] for p in phases)


@pytest.mark.parametrize("shared", [0.0, 0.3, 0.8])
async def test_measure_shared_recovers_the_simulators_shared_core(shared: float) -> None:
    # The fitter is tested, not the machine: on the simulator, a loop kept busy stretches each
    # step by `shared`, and the burst measurement must read that back.
    sim = SimEngine(block_size=16, num_blocks=4096, max_model_len=4096, max_num_batched_tokens=2048,
                    step_time=StepTimeModel(alpha=0.002, beta=4e-6, gamma=5e-5, shared=shared))
    loop = LoopServer(sim.clock)
    sim.shared_cpus = (loop,)
    got, walls = await measure_shared(sim, FakeSamplingParams, lambda: loop.spend(0.0015), vocab=3000,
                                      now=sim.clock.now)
    assert got == pytest.approx(shared, abs=0.03)
    assert [w["busy_s"] / w["idle_s"] for w in walls] == pytest.approx([1 + shared] * 6, abs=0.03)



async def test_measure_loop_stretch_reads_the_loops_wall_over_its_cpu_time() -> None:
    # Deterministic clocks: each prompt tokenized costs the loop 1 ms of CPU and 1.5 ms of wall
    # (the engine core took the rest); sending and serving cost none of either.
    clock = {"wall": 0.0, "cpu": 0.0}

    class Tokenizer(ByteTokenizer):
        def encode(self, text: str, **kwargs: object) -> list[int]:
            clock["wall"] += 0.0015
            clock["cpu"] += 0.001
            return super().encode(text)

    sim = SimEngine(block_size=16, num_blocks=4096, max_model_len=8192)
    got, rounds = await measure_loop_stretch(sim, FakeSamplingParams, Tokenizer(), clients=4, prompt_words=50,
                                             wall=lambda: clock["wall"], cpu=lambda: clock["cpu"])
    assert got == pytest.approx(0.5)
    assert [r["cpu_s"] for r in rounds] == pytest.approx([0.004] * 3)


_PIN_CHECK = """
import json, os, subprocess, sys
from benchmarks.engines import keep_off_worker_cores, release_cores
cpus = sorted(os.sched_getaffinity(0))
print(json.dumps({"none": keep_off_worker_cores()}))  # no child bound to fewer cores yet
# Stand-ins for vLLM's processes: a "worker" bound to one core, an "engine core" left free.
worker = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}))
other = subprocess.Popen(["sleep", "30"])
got = keep_off_worker_cores()
seen = {"got": sorted(got), "self": sorted(os.sched_getaffinity(0)),
        "other": sorted(os.sched_getaffinity(other.pid)), "worker": sorted(os.sched_getaffinity(worker.pid))}
release_cores()
seen["released"] = sorted(os.sched_getaffinity(0))
seen["other_released"] = sorted(os.sched_getaffinity(other.pid))
# A second engine: the processes the first pinning moved (here "other") are not workers.
print(json.dumps(seen))
print(json.dumps({"again": sorted(keep_off_worker_cores())}))
release_cores()
for p in (worker, other):
    p.kill()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity and two cores")
def test_the_frontend_and_its_other_children_move_off_the_cores_a_child_is_bound_to() -> None:
    import json
    import sys
    from pathlib import Path

    # In a process of its own: this one may have a test engine's processes below it.
    out = subprocess.run([sys.executable, "-c", _PIN_CHECK], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=60).stdout.splitlines()
    cpus = sorted(os.sched_getaffinity(0))
    assert json.loads(out[0]) == {"none": None}
    assert json.loads(out[1]) == {"got": cpus[1:], "self": cpus[1:], "other": cpus[1:],
                                  "worker": cpus[:1], "released": cpus, "other_released": cpus}
    assert json.loads(out[2]) == {"again": cpus[1:]}


def test_measure_canon_cost_reads_back_what_editing_adds_per_prompt_and_per_character() -> None:
    # Canonicalization on a clock only it moves: a scan of 2 ns a character for every text, and
    # for a text it edits 30 us more plus 4 ns a character. The fit gives the second part back.
    from prefixgate.canonicalize import canonicalize_text

    spent = [0.0]

    def canon(text: str) -> object:
        out = canonicalize_text(text)
        spent[0] += 2e-9 * len(text) + ((30e-6 + 4e-9 * len(text)) if out.changed else 0.0)
        return out

    got = measure_canon_cost(ByteTokenizer(), texts=3, sizes=(80, 400), rounds=2, cpu=lambda: spent[0],
                             canon=canon)
    # (an edited text's scan covers the few characters its edits add or remove: within 1%)
    assert got["canon_request"] == pytest.approx(30e-6, rel=0.01)
    assert got["canon_char"] == pytest.approx(4e-9, rel=0.01)
    assert got["canon_chars"][1] > 3 * got["canon_chars"][0]  # two sizes to fit through
    cost = LoopCost(canon_request=got["canon_request"], canon_char=got["canon_char"])
    assert cost.canon_cost(1000) == pytest.approx(34e-6, rel=0.01)


def test_report_charges_the_engine_cores_measured_cpu_in_place_of_shared_and_records_its_wait() -> None:
    core = {"shared_step": 6e-4, "core_seq": 1.4e-5, "core_token": 2e-7, "core_prefill": 3e-7,
            "core_wait": 3e-3}
    records = [StepRecord(0.002 + 1e-6 * p, p, 1) for p in (0, 100, 300, 700, 1500)]
    fitted = report(records, {"engine": "vllm-cpu", "shared": 0.35, "engine_core": core})
    assert fitted["fit"]["shared"] == 0.0 and fitted["fit"]["core_wait"] == 0.0
    assert {k: fitted["fit"][k] for k in ("shared_step", "core_seq", "core_token", "core_prefill")} == {
        k: core[k] for k in ("shared_step", "core_seq", "core_token", "core_prefill")}
    assert fitted["engine_core"]["core_wait"] == 3e-3  # recorded as measured
    # Without the engine core's measurement, `shared` is charged as measured.
    assert report(records, {"engine": "vllm-cpu", "shared": 0.35})["fit"]["shared"] == 0.35


async def test_the_harness_charges_canonicalizations_edits_where_the_prompt_is_prepared() -> None:
    from benchmarks.engines import SimFactory
    from benchmarks.harness import run_arm
    from benchmarks.workloads import make_trace
    from prefixgate.canonicalize import canonicalize_text

    # W3's whitespace noise on every request: each one canonicalization edits costs the ingress
    # worker 50 ms more, far more than the engine's steps; the clean trace's cost nothing more.
    spans = {}
    changed = 0
    for noise in (0.0, 1.0):
        trace = make_trace("W3", "sim", seed=0, tokenizer=ByteTokenizer(),
                           overrides={"groups": 2, "per_group": 4, "prefix_tokens": 64, "suffix_tokens": 8,
                                      "max_tokens": 2, "noise_p": noise})
        changed = sum(canonicalize_text(r.prompt).changed for r in trace.requests)
        assert changed == (0 if noise == 0.0 else changed)
        for canon in (0.0, 5e-2):
            cost = {"request": 1e-4, "ingress_token": 1e-6, "ingress_workers": 1, "canon_request": canon}
            running = await SimFactory("sim", ByteTokenizer(), loop_cost=cost).start(caching=True,
                                                                                       kv_cap_tokens=None)
            run = await run_arm("L", 0, trace, running)
            assert all(r.outcome == "completed" for r in run.records)
            spans[noise, canon] = max(r.finished for r in run.records) - run.start
    assert changed >= 2
    # One worker prepares them in turn: the last waits for every edited prompt's extra.
    assert spans[1.0, 5e-2] >= changed * 5e-2
    assert spans[1.0, 0.0] < changed * 5e-2
    assert spans[0.0, 5e-2] == pytest.approx(spans[0.0, 0.0])
