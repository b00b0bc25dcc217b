"""Ingress off the event loop: worker processes and threads give the same tickets as inline."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prefixgate import CanonicalizeConfig, Gateway, GatewayConfig, InvalidRequest, PromptTooLong
from prefixgate.ingress_pool import ProcessIngressPool, ThreadIngressPool
from prefixgate.testing import FakeSamplingParams, NullEngine

TOKENIZER = AutoTokenizer.from_pretrained(str(Path(__file__).parent / "fixtures" / "tiny-llama"))
SP = FakeSamplingParams(max_tokens=1)
DOC = "A shared system prompt with  doubled spaces, a tab\there and a CRLF\r\n" * 40


async def _drain(stream) -> list:
    return [o async for o in stream]


async def _tickets(ingress: str, prompts: list[str], **config) -> tuple[list, object]:
    engine = NullEngine(tokenizer=TOKENIZER, max_model_len=4096)
    async with Gateway(engine, GatewayConfig(ingress=ingress, **config)) as gw:
        pool = gw._pool
        streams = [gw.generate(p, SP) for p in prompts]
        await asyncio.gather(*(_drain(s) for s in streams))
        stats = gw.statistics()
    return [s.ticket for s in streams], (pool, stats)


@pytest.mark.parametrize(("ingress", "kind"), [("processes", ProcessIngressPool),
                                               ("threads", ThreadIngressPool)])
async def test_a_pool_prepares_exactly_what_inline_ingress_does(ingress, kind):
    prompts = [DOC + f"question {i}?" for i in range(12)] + ["short prompt"]
    config = {"canonicalize": CanonicalizeConfig.named("prose", roles={"system": "safe"})}
    inline, (_, inline_stats) = await _tickets("inline", prompts, **config)
    pooled, (pool, stats) = await _tickets(ingress, prompts, **config)
    assert isinstance(pool, kind) and pool.prepared == 12  # the short one is prepared inline
    for a, b in zip(inline, pooled, strict=True):
        assert list(a.prompt_token_ids) == list(b.prompt_token_ids)
        assert a.block_hashes == b.block_hashes and a.canonicalized == b.canonicalized
        assert a.canonical_rules == b.canonical_rules
    assert stats.canonicalize_rules == inline_stats.canonicalize_rules


async def test_errors_only_tokenizing_reveals_come_at_the_first_output():
    engine = NullEngine(tokenizer=TOKENIZER, max_model_len=1024)
    async with Gateway(engine, GatewayConfig(ingress="processes")) as gw:
        stream = gw.generate("word " * 3000, SP)  # under the character bound, over 1,023 tokens
        assert stream.ticket is None
        with pytest.raises(PromptTooLong) as info:
            async for _ in stream:
                pass
        assert info.value.num_tokens > 1023
        with pytest.raises(InvalidRequest):
            gw.generate("", SP)  # what needs no tokenizer is still refused at the call
        assert gw.statistics().refused == {"too_long": 1, "invalid": 1}
        assert gw._live == {}


async def test_a_huge_prompt_goes_to_the_bulk_worker_through_a_file_it_deletes(tmp_path, monkeypatch):
    import prefixgate.ingress_pool as ingress_pool

    spilled: list[str] = []
    spill = ingress_pool._spill

    def recording_spill(text: str) -> str:
        spilled.append(spill(text))
        return spilled[-1]

    monkeypatch.setattr(ingress_pool, "_spill", recording_spill)
    prompts = [DOC * 2 + "a long question?", DOC + "a short one?"]
    inline, _ = await _tickets("inline", prompts)
    pooled, (pool, _) = await _tickets("processes", prompts, ingress_bulk_chars=len(DOC) + 100)
    assert pool.prepared == 2 and len(spilled) == 1  # only the long one went through a file
    for a, b in zip(inline, pooled, strict=True):
        assert list(a.prompt_token_ids) == list(b.prompt_token_ids)
        assert a.block_hashes == b.block_hashes and a.canonicalized == b.canonicalized
    assert not Path(spilled[0]).exists()  # the worker deleted it


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
async def test_the_bulk_worker_is_held_still_while_ordinary_prompts_are_prepared_but_never_for_long():
    from prefixgate.ingress_pool import _Pauser

    proc = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        pauser = _Pauser(max_pause=0.3)
        pauser.job_started(proc.pid, ordinary_busy=True)  # a huge prompt arrives amid others
        await asyncio.sleep(0.05)
        assert _state(proc.pid) == "T"
        pauser.resume()  # the ordinary ones are done
        await asyncio.sleep(0.05)
        assert _state(proc.pid) == "S"
        pauser.pause()  # more arrive: held again, for what is left of its 0.3 s
        await asyncio.sleep(0.05)
        assert _state(proc.pid) == "T"
        await asyncio.sleep(0.4)  # ordinary work never stops: it goes on anyway
        assert _state(proc.pid) == "S" and 0.25 < pauser.paused < 0.45
        pauser.pause()  # its budget is spent: no more pauses for this job
        await asyncio.sleep(0.05)
        assert _state(proc.pid) == "S" and pauser.pauses == 2
        pauser.job_ended()
        pauser.job_started(proc.pid, ordinary_busy=True)  # the next job has a budget again
        await asyncio.sleep(0.05)
        assert _state(proc.pid) == "T"
        pauser.job_ended()
        await asyncio.sleep(0.05)
        assert _state(proc.pid) == "S"
    finally:
        proc.kill()
        await proc.wait()
