"""Gateway behaviour on FakeEngine: ingress validation, keys on tickets, prediction, statistics."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate import (
    EngineDead,
    EngineError,
    Gateway,
    GatewayConfig,
    InvalidRequest,
    Outcome,
    PromptTooLong,
    QueueFull,
    QueueTimeout,
    Rule,
    ShuttingDown,
)
from prefixgate.testing import FakeClock, FakeEngine, FakeSamplingParams, run_until_idle

SP = FakeSamplingParams(max_tokens=2)


async def drain(stream):
    return [out async for out in stream]


@pytest.fixture
def engine():
    return FakeEngine(block_size=4, max_model_len=64)


async def test_generate_streams_engine_outputs_unchanged(engine):
    async with Gateway(engine) as gw:
        outs = await drain(gw.generate("hello world", SP, request_id="r1"))
    assert [o.finished for o in outs] == [False, True]
    assert outs[-1].request_id == "r1"
    assert list(engine.requests[0].prompt_token_ids) == engine.tokenizer.encode("hello world")


async def test_whitespace_noise_is_canonicalized_before_keying(engine):
    async with Gateway(engine) as gw:
        a = gw.generate("shared system prompt.\nQ1", SP)
        # One trailing space: two before a non-blank line are a Markdown hard break, kept by safe.
        b = gw.generate("shared  system prompt. \r\nQ2", SP)
        assert a.ticket.block_hashes[:5] == b.ticket.block_hashes[:5]
        assert not a.ticket.canonicalized and b.ticket.canonicalized
        await drain(a)
        await drain(b)
        stats = gw.statistics()
    assert b.cached_tokens == b.predicted_hit_tokens == 20
    assert stats.canonicalized == 1 and stats.chars_removed == 3
    assert stats.predicted_hit_tokens == stats.engine_cached_tokens == 20
    assert stats.completed == 2 and stats.requests == 2


async def test_rule_sets_by_name_and_what_each_rule_changed_is_counted(engine):
    async with Gateway(engine, GatewayConfig(canonicalize="prose")) as gw:
        await drain(gw.generate("shared\tsystem prompt.  \r\nQ1", SP))
        await drain(gw.generate("clean prompt", SP))
        await drain(gw.generate("a  b \u00a0 c", SP))
        rules = gw.statistics().canonicalize_rules
    assert rules["newlines"].requests == 1 and rules["newlines"].chars_removed == 1
    assert rules["tabs"].requests == 1 and rules["unicode_spaces"].requests == 1
    assert rules["inner_spaces"].requests == 1 and set(rules) <= {r.value for r in Rule}
    assert sum(r.chars_removed for r in rules.values()) == gw.statistics().chars_removed
    with pytest.raises(ValueError, match="safe"):
        GatewayConfig(canonicalize="lowercase")


async def test_canonicalization_can_be_switched_off(engine):
    from prefixgate import CanonicalizeConfig

    async with Gateway(engine, GatewayConfig(canonicalize=CanonicalizeConfig.off())) as gw:
        s = gw.generate("a  b", SP)
    assert list(s.ticket.prompt_token_ids) == engine.tokenizer.encode("a  b")


@pytest.mark.parametrize(("prompt", "error", "match"), [
    ("", InvalidRequest, "empty"),
    (b"\xff\xfe not utf-8", InvalidRequest, "UTF-8"),
    ("lone \udc80 surrogate", InvalidRequest, "surrogate"),
    ([], InvalidRequest, "non-empty"),
    ([{"content": "no role"}], InvalidRequest, "role"),
    (12345, InvalidRequest, "got int"),
    ("x" * 64, PromptTooLong, "64 tokens"),
    ("x" * 10_000, PromptTooLong, "characters"),
])
async def test_bad_prompts_raise_typed_errors_before_queueing(engine, prompt, error, match):
    async with Gateway(engine) as gw:
        with pytest.raises(error, match=match):
            gw.generate(prompt, SP)
        stats = gw.statistics()
    assert engine.started == [] and stats.requests == 0 and stats.queued == 0
    assert sum(stats.refused.values()) == 1


async def test_prompt_too_long_says_how_long(engine):
    async with Gateway(engine, GatewayConfig(max_prompt_tokens=10)) as gw:
        with pytest.raises(PromptTooLong) as info:
            gw.generate("y" * 11, SP)
    assert (info.value.num_tokens, info.value.limit) == (11, 10)
    assert info.value.outcome is Outcome.TOO_LONG


@pytest.mark.parametrize("kwargs", [
    {"tenant": ""}, {"tenant": 7}, {"request_id": ""}, {"priority": "high"},
])
async def test_bad_request_fields_are_invalid(engine, kwargs):
    async with Gateway(engine) as gw:
        with pytest.raises(InvalidRequest):
            gw.generate("ok", SP, **kwargs)


async def test_bad_sampling_params_are_invalid(engine):
    async with Gateway(engine) as gw:
        with pytest.raises(InvalidRequest, match="FakeSamplingParams"):
            gw.generate("ok", ["max_tokens", 3])  # neither its params object nor a mapping
        with pytest.raises(InvalidRequest, match=">= 1"):
            gw.generate("ok", FakeSamplingParams(max_tokens=0))


async def test_unknown_tenant_is_refused_when_tenants_are_listed(engine):
    async with Gateway(engine, GatewayConfig(known_tenants=frozenset({"acme"}))) as gw:
        await drain(gw.generate("ok", SP, tenant="acme"))
        with pytest.raises(InvalidRequest, match="unknown tenant 'evil'"):
            gw.generate("ok", SP, tenant="evil")


async def test_tenants_do_not_share_cache_unless_configured(engine):
    prompt = "a shared prompt of some length"
    async with Gateway(engine) as gw:
        for tenant in ("a", "b", "a"):
            await drain(s := gw.generate(prompt, SP, tenant=tenant))
            assert s.cached_tokens == s.predicted_hit_tokens
        assert [r.cache_salt is not None for r in engine.requests] == [True] * 3
        assert engine.requests[0].cache_salt != engine.requests[1].cache_salt
        assert s.cached_tokens == 28  # the second request of tenant "a"
    shared = FakeEngine(block_size=4)
    async with Gateway(shared, GatewayConfig(isolate_tenants=False)) as gw:
        await drain(gw.generate(prompt, SP, tenant="a"))
        await drain(s := gw.generate(prompt, SP, tenant="b"))
    assert s.cached_tokens == 28 and shared.requests[1].cache_salt is None


async def test_chat_messages_use_the_template_and_canonicalize_content(engine):
    msgs = [{"role": "system", "content": "Be  brief. "}, {"role": "user", "content": "hi"}]
    async with Gateway(engine) as gw:
        s = gw.generate(msgs, SP)
        await drain(s)
    text = engine.tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert text == "<system>Be brief.\n<user>hi\n<assistant>"
    assert s.ticket.canonicalized


async def test_duplicate_live_request_id_is_refused(engine):
    engine.step = asyncio.Event()
    async with Gateway(engine) as gw:
        first = gw.generate("one", SP, request_id="same")
        task = asyncio.create_task(drain(first))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequest, match="already in use"):
            gw.generate("two", SP, request_id="same")
        engine.step.set()
        await task
        await drain(gw.generate("three", SP, request_id="same"))  # free again once finished


async def test_queue_is_bounded_and_fcfs_with_an_in_flight_window(engine):
    engine.step = asyncio.Event()
    config = GatewayConfig(ordering="fcfs", max_in_flight=1, max_queue_len=2)
    async with Gateway(engine, config) as gw:
        # What still waits after the dispatch decision counts, not same-tick arrivals: r0 runs,
        # r1 and r2 wait, r3 is refused.
        streams = [gw.generate(f"prompt {i}", SP, request_id=f"r{i}") for i in range(4)]
        tasks = [asyncio.create_task(drain(s)) for s in streams]
        await run_until_idle()
        assert gw.statistics().running == 1 and gw.statistics().queued == 2
        with pytest.raises(QueueFull) as info:
            await tasks[3]
        assert info.value.reason == "queue_full" and info.value.retry_after > 0
        engine.step.set()
        await asyncio.gather(*tasks[:3])
    assert engine.started == ["r0", "r1", "r2"]
    assert gw.statistics().refused == {"queue_full": 1}


async def test_queue_timeout_evicts_a_waiting_request(engine):
    engine.step = asyncio.Event()
    clock = FakeClock()
    config = GatewayConfig(ordering="fcfs", max_in_flight=1, queue_timeout=5.0)
    async with Gateway(engine, config, clock=clock) as gw:
        running = asyncio.create_task(drain(gw.generate("first", SP)))
        waiting = asyncio.create_task(drain(gw.generate("second", SP)))
        await run_until_idle()
        await clock.advance(4.9)
        assert not waiting.done()
        await clock.advance(0.2)
        with pytest.raises(QueueTimeout):
            await waiting
        engine.step.set()
        await running
    assert gw.statistics().outcomes == {"queue_timeout": 1, "completed": 1}


async def test_engine_failure_mid_stream_is_an_engine_error(engine):
    engine.fail_after = 1
    async with Gateway(engine) as gw:
        s = gw.generate("boom", FakeSamplingParams(max_tokens=3))
        got = []
        with pytest.raises(EngineError, match="failed"):
            async for out in s:
                got.append(out)
    assert len(got) == 1 and gw.statistics().outcomes == {"engine_error": 1}


async def test_engine_death_fails_this_request_and_all_later_ones(engine):
    engine.die_after = 1
    async with Gateway(engine) as gw:
        with pytest.raises(EngineDead):
            await drain(gw.generate("x", FakeSamplingParams(max_tokens=3)))
        with pytest.raises(EngineDead):
            gw.generate("y", SP)


async def test_engine_refusal_surfaces_as_invalid_request(engine):
    engine.refuse = "Token id 99999 is out of vocabulary"
    async with Gateway(engine) as gw:
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await drain(gw.generate("x", SP))
    assert gw.statistics().outcomes == {"invalid": 1}


async def test_closing_ends_queued_requests_and_refuses_new_ones(engine):
    engine.step = asyncio.Event()
    gw = Gateway(engine, GatewayConfig(max_in_flight=1))
    running = asyncio.create_task(drain(gw.generate("a", SP)))
    queued = asyncio.create_task(drain(gw.generate("b", SP)))
    await asyncio.sleep(0)
    closing = asyncio.create_task(gw.aclose())
    await asyncio.sleep(0)
    with pytest.raises(ShuttingDown):
        await queued
    with pytest.raises(ShuttingDown):
        gw.generate("c", SP)
    engine.step.set()
    await running
    await closing
    assert gw.statistics().outcomes == {"shutting_down": 1, "completed": 1}


async def test_output_blocks_are_mirrored_for_the_next_turn():
    engine = FakeEngine(block_size=4)
    async with Gateway(engine) as gw:
        first = gw.generate("turn one", FakeSamplingParams(max_tokens=9))
        outs = await drain(first)
        follow = list(first.ticket.prompt_token_ids) + list(outs[-1].outputs[0].token_ids)
        # FakeEngine caches prompt+output blocks like vLLM; the mirror must predict the hit.
        assert gw._replica.mirror.match(
            __import__("prefixgate").block_hashes(follow, 4, first.ticket.namespace)) == 4


def test_repr_is_one_line_and_readable(engine):
    gw = Gateway(engine)
    assert repr(gw).startswith("Gateway(engine=") and "\n" not in repr(gw)
