"""The block ledger and KV admission: a stateful Hypothesis machine plus exact stories."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixgate import Gateway, GatewayConfig, KvStats, Overloaded
from prefixgate.admission import Admission, BlockLedger
from prefixgate.chains import ChainRefs
from prefixgate.clock import FakeClock
from prefixgate.testing import FakeEngine, FakeSamplingParams, run_until_idle


class _T:
    """A stand-in ticket: the ledger only needs identity and a request id."""

    def __init__(self, i: int) -> None:
        self.request_id = f"t{i}"


_CHAINS = [tuple(f"{c}{j}" for j in range(6)) for c in "abc"]  # three prefix chains of keys
_CHAINS += [("a0", "a1", "a2", "x3", "x4", "x5"), ("a0", "y1", "y2", "y3", "y4", "y5")]  # forks of a


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve / release / cancel / engine-stat updates against a model of the ledger in
    which a shared block is held while any ticket holding it is."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 64
        self.ledger = BlockLedger(self.capacity)
        self.clock = FakeClock()
        self.stats: KvStats | None = None
        self.admission = Admission(self.ledger, block_size=4, output_reserve=1.0,
                                   default_output_tokens=4, watermark_blocks=2, stats_max_age=1.0,
                                   kv_stats=lambda: self.stats, clock=self.clock)
        self.model: dict[int, tuple[tuple[str, ...], int]] = {}
        self.tickets = [_T(i) for i in range(12)]

    def _model_reserved(self, model: dict[int, tuple[tuple[str, ...], int]]) -> int:
        shared = {key for keys, _ in model.values() for key in keys}
        return len(shared) + sum(private for _, private in model.values())

    @rule(i=st.integers(0, 11), chain=st.integers(0, 4), depth=st.integers(0, 6),
          private=st.integers(0, 30))
    def reserve(self, i, chain, depth, private):
        t, shared = self.tickets[i], _CHAINS[chain][:depth]
        after = {**self.model, -1: (shared, private)}
        added = self._model_reserved(after) - self._model_reserved(self.model)
        assert self.ledger.need(shared, private) == added
        after = {**self.model, i: (shared, private)}
        if i in self.model or added > self.ledger.free:
            with pytest.raises(ValueError):
                self.ledger.reserve(t, shared, private)
        else:
            if not self.model:
                self.admission.busy_since = self.clock.now()  # what Admission.reserve does
            assert self.ledger.reserve(t, shared, private) == added
            self.model = after

    @rule(i=st.integers(0, 11))
    def release(self, i):  # also what a cancellation does; a second release frees nothing
        before = self._model_reserved(self.model)
        self.model.pop(i, None)
        assert self.ledger.release(self.tickets[i]) == before - self._model_reserved(self.model)

    @rule(free=st.integers(0, 64), age=st.floats(0, 3))
    def engine_reports(self, free, age):
        self.stats = KvStats(time=self.clock.now() - age, total_blocks=64, free_blocks=free)

    @rule(seconds=st.floats(0, 2))
    def time_passes(self, seconds):
        self.clock._now += seconds

    @precondition(lambda self: self.stats is not None)
    @rule(blocks=st.integers(1, 70))
    def fit_decision_is_safe(self, blocks):
        reason = self.admission.blocked_reason(blocks)
        if not self.model:
            assert reason is None  # an idle engine always takes one request
        elif reason is None:
            assert blocks <= self.ledger.free - 2
            assert blocks <= self.stats.free_blocks - 2
            # Fresh: reported within max_age of now, or of when the engine last became busy.
            assert self.clock.now() - max(self.stats.time, self.admission.busy_since) <= 1.0

    @invariant()
    def reserved_plus_free_is_capacity(self):
        assert self.ledger.reserved + self.ledger.free == self.capacity
        assert self.ledger.reserved == self._model_reserved(self.model)
        assert 0 <= self.ledger.free <= self.capacity and len(self.ledger) == len(self.model)
        held = {key for keys, _ in self.model.values() for key in keys}
        assert set(self.ledger._shared._tree.index) == held  # the key index is exact


TestLedger = LedgerMachine.TestCase


def test_chain_refs_hold_each_key_once_until_the_last_chain_through_it_is_released():
    refs = ChainRefs()
    assert refs.hold("a", "abcd") == 4 and refs.hold("b", "abxy") == 2 and refs.hold("c", "") == 0
    assert refs.size == 6 and len(refs) == 3 and "a" in refs
    assert refs.held("abcz") == 3 and refs.held("qx") == 0  # keys stand for their prefix
    with pytest.raises(ValueError, match="already holds"):
        refs.hold("a", "ab")
    assert refs.release("a") == 2 and refs.held("abcd") == 2 and refs.held("abxy") == 4
    assert refs.release("a") == 0 and refs.release("c") == 0  # released, or held nothing
    assert refs.release("b") == 4 and refs.size == 0 and len(refs) == 0


class _Req:
    def __init__(self, tokens: int, max_tokens: int | None, keys: str, block: int = 16) -> None:
        self.request_id = keys
        self.num_prompt_tokens, self.max_tokens = tokens, max_tokens
        self.block_hashes = tuple(keys[: tokens // block])
        self.cacheable_blocks = (tokens - 1) // block


def test_need_counts_unreserved_prompt_blocks_and_output_reserve():
    adm = Admission(BlockLedger(100), block_size=16, output_reserve=0.5, default_output_tokens=64,
                    watermark_blocks=0, stats_max_age=1.0, kv_stats=lambda: None, clock=FakeClock())
    a = _Req(100, 40, "abcdefg")  # 6 full blocks, all cacheable; 4 tokens + 20 reserved private
    assert adm.need(a) == 8  # ceil((100 + 20) / 16)
    assert adm.reserve(a) == 8
    b = _Req(100, None, "abcdefg")  # a sibling: its 6 prompt blocks are held by a already
    assert adm.need(b) == 3  # ceil((4 + 32) / 16)
    assert adm.reserve(b) == 3 and adm.ledger.reserved == 11
    assert adm.need(_Req(100, 40, "abcXYZ")) == 2 + 3 + 0  # shares blocks a, b, c only
    assert adm.ledger.release(a) == 2  # a's private blocks; the prefix stays with b
    assert adm.ledger.reserved == 9 and adm.need(_Req(100, 40, "abcdefg")) == 2
    assert adm.ledger.release(b) == 9 and adm.ledger.reserved == 0
    # A prompt of exactly 6 blocks: its last full block is recomputed, so it is private.
    exact = _Req(96, 0, "abcdef")
    assert adm.split(exact) == (("a", "b", "c", "d", "e"), 1)


def test_wait_estimate_learns_how_much_longer_requests_really_wait():
    clock = FakeClock()
    adm = Admission(BlockLedger(100), block_size=16, output_reserve=1.0, default_output_tokens=16,
                    watermark_blocks=0, stats_max_age=1.0, kv_stats=lambda: None, clock=clock)
    for _ in range(3):  # 2 completions over 2 s: 1 per s
        adm.drain.record()
        clock._now += 1.0
    clock._now -= 1.0
    assert adm.raw_wait(3) == pytest.approx(4.0) and adm.estimated_wait(3) == pytest.approx(4.0)
    for i in range(7):  # too few samples: no correction yet
        adm.observe_wait(1.0 + i, 3.0 * (1.0 + i))
    assert adm.wait_correction == 1.0
    adm.observe_wait(2.0, 6.0)
    assert adm.wait_correction == pytest.approx(3.0)
    assert adm.estimated_wait(3) == pytest.approx(12.0)
    for _ in range(64):  # the window slides: later requests wait as predicted
        adm.observe_wait(1.0, 1.0)
    assert adm.wait_correction == pytest.approx(1.0)
    for _ in range(64):
        adm.observe_wait(1.0, 100.0)
    assert adm.wait_correction == 8.0  # clamped


def _engine(blocks: int) -> FakeEngine:
    return FakeEngine(block_size=4, num_blocks=blocks, step=asyncio.Event())


async def test_requests_wait_for_blocks_and_run_when_they_free():
    engine = _engine(blocks=21)  # each request below needs ceil((18 + 8) / 4) = 7 blocks
    sp = FakeSamplingParams(max_tokens=8)
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", kv_watermark=0))
    tasks = [asyncio.create_task(_drain(gw.generate(f"{i} distinct request", sp))) for i in range(4)]
    await _spin()
    stats = gw.statistics()
    assert (stats.running, stats.queued, stats.reserved_blocks, stats.blocked) == (3, 1, 21, "kv_reserved")
    engine.step.set()
    await asyncio.gather(*tasks)
    assert gw.statistics().reserved_blocks == 0 and gw.statistics().completed == 4


async def test_stale_engine_stats_stop_dispatch_and_fail_fast():
    clock = FakeClock()
    engine = _engine(blocks=100)
    engine.set_kv_stats(KvStats(time=0.0, total_blocks=100, free_blocks=100))
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", stats_max_age=1.0), clock=clock)
    first = asyncio.create_task(_drain(gw.generate("first request", FakeSamplingParams(4))))
    await _spin()
    await clock.advance(5)  # the engine stops reporting while a request is in flight
    second = asyncio.create_task(_drain(gw.generate("second request", FakeSamplingParams(4))))
    await _spin()
    assert gw.statistics().blocked == "kv_stats_stale" and gw.statistics().queued == 1
    with pytest.raises(Overloaded) as info:
        await _drain(gw.generate("third request", FakeSamplingParams(4)))
    assert info.value.reason == "kv_stats_stale"
    engine.set_kv_stats(KvStats(time=clock.now(), total_blocks=100, free_blocks=90))
    engine.step.set()
    await asyncio.gather(first, second)
    assert gw.statistics().outcomes == {"completed": 2}


async def test_stats_from_an_idle_engine_do_not_hold_back_a_burst():
    """vLLM reports only when it steps: after an idle spell its last stats are old but true."""
    clock = FakeClock()
    engine = _engine(blocks=100)
    engine.set_kv_stats(KvStats(time=0.0, total_blocks=100, free_blocks=100))
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", stats_max_age=1.0), clock=clock)
    await clock.advance(60)
    tasks = [asyncio.create_task(_drain(gw.generate(f"{i} burst", FakeSamplingParams(2))))
             for i in range(5)]
    await _spin()
    assert gw.statistics().running == 5 and gw.statistics().blocked is None
    engine.step.set()
    await asyncio.gather(*tasks)


async def test_try_generate_dispatches_now_or_raises_with_retry_after():
    engine = _engine(blocks=12)  # each prompt needs ceil((16 + 8) / 4) = 6 blocks
    sp = FakeSamplingParams(max_tokens=8)
    gw = Gateway(engine, GatewayConfig(kv_watermark=0))
    assert gw.can_admit("a" * 16, sp)
    first = gw.try_generate("a" * 16, sp)
    assert first.ticket.state.value == "running"
    assert gw.can_admit("b" * 16, sp)
    second = gw.try_generate("b" * 16, sp)
    assert not gw.can_admit("c" * 16, sp)
    with pytest.raises(Overloaded) as info:
        gw.try_generate("c" * 16, sp)
    assert info.value.reason == "kv_reserved" and info.value.retry_after > 0
    assert gw.statistics().rejected_reasons == {"kv_reserved": 1}
    await second.aclose()  # never iterated: its reservation is returned
    assert gw.can_admit("c" * 16, sp)
    engine.step.set()
    assert (await _drain(first))[-1].finished
    assert gw.statistics().reserved_blocks == 0


async def test_overloaded_when_the_predicted_wait_exceeds_the_bound():
    engine = FakeEngine(block_size=4, num_blocks=1000)
    clock = FakeClock()
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", max_in_flight=1, max_queue_wait=2.0),
                 clock=clock)
    tasks = await _warm_then_hold(gw, engine, clock)
    # r0 runs; r1, r2 wait. Drain rate: 2 completions over the 3 s since the first = 2/3 per s,
    # so r3, third in line, would wait (2 + 1) / (2/3) = 4.5 s > 2 s: retry in 2.5 s.
    with pytest.raises(Overloaded) as info:
        await _drain(gw.generate("r3", FakeSamplingParams(1)))
    assert info.value.reason == "predicted_wait" and info.value.retry_after == pytest.approx(2.5)
    engine.step.set()
    await asyncio.gather(*tasks[:3])


async def test_predicted_wait_counts_requests_queued_inside_the_engine():
    """In flight beyond max_num_seqs means waiting in the engine's queue: once our own queue
    holds requests, a new arrival waits behind both."""
    engine = FakeEngine(block_size=4, num_blocks=1000, max_num_seqs=1)
    clock = FakeClock()
    gw = Gateway(engine, GatewayConfig(ordering="fcfs", max_queue_wait=2.0), clock=clock)
    tasks = await _warm_then_hold(gw, engine, clock)
    stats = gw.statistics()
    # Window 2 x max_num_seqs: r0 runs, r1 waits in the engine, r2 in the gateway.
    assert (stats.running, stats.queued, stats.blocked) == (2, 1, "max_in_flight")
    # r3 would wait behind r2 and r1: (2 + 1) / (2/3) = 4.5 s > 2 s (r2 alone: 3 s, retry 1 s).
    with pytest.raises(Overloaded) as info:
        await _drain(gw.generate("r3", FakeSamplingParams(1)))
    assert info.value.reason == "predicted_wait" and info.value.retry_after == pytest.approx(2.5)
    engine.step.set()
    await asyncio.gather(*tasks)
    assert gw.statistics().outcomes == {"completed": 6}


async def _warm_then_hold(gw, engine, clock, held: int = 3) -> list[asyncio.Task]:
    """Three completions one second apart (drain rate 2/3 per s by the time the next arrive),
    then ``held`` requests r0, r1, … that the engine holds until ``engine.step`` is set."""
    for t in (0.0, 1.0, 2.0):
        await _drain(gw.generate(f"warm {t}", FakeSamplingParams(1)))
        await clock.advance(1.0)
    engine.step = asyncio.Event()
    tasks = [asyncio.create_task(_drain(gw.generate(f"r{i}", FakeSamplingParams(1))))
             for i in range(held)]
    await _spin()
    return tasks


async def _drain(stream):
    return [o async for o in stream]


async def _spin(n: int = 0) -> None:
    await run_until_idle()


async def test_stats_late_because_the_event_loop_was_busy_do_not_count_as_a_silent_engine():
    """News from an in-process engine waits for the loop: when the loop itself was late, stats as
    old as its lateness are not stale. When the loop was free and the engine said nothing, they
    are (real clock: the loop's lateness is measured while requests are in flight)."""
    import time

    def gateway():
        engine = _engine(blocks=100)
        engine.set_kv_stats(KvStats(time=time.monotonic(), total_blocks=100, free_blocks=100))
        return engine, Gateway(engine, GatewayConfig(ordering="fcfs", stats_max_age=0.2))

    for loop_busy in (True, False):
        engine, gw = gateway()
        first = asyncio.create_task(_drain(gw.generate("first request", FakeSamplingParams(4))))
        await _spin()  # dispatched: the engine now has work and the loop's heartbeat runs
        engine.set_kv_stats(KvStats(time=time.monotonic(), total_blocks=100, free_blocks=90))
        if loop_busy:
            time.sleep(0.5)  # the loop is held: the heartbeat is late by as much
        else:
            await asyncio.sleep(0.5)  # the loop is free; the engine reports nothing
        second = asyncio.create_task(_drain(gw.generate("second request", FakeSamplingParams(4))))
        await _spin()
        stats = gw.statistics()
        if loop_busy:
            assert stats.running == 2 and stats.blocked is None
        else:
            assert stats.running == 1 and stats.blocked == "kv_stats_stale"
        engine.step.set()
        engine.set_kv_stats(KvStats(time=time.monotonic(), total_blocks=100, free_blocks=90))
        await asyncio.gather(first, second)
        await gw.aclose()
