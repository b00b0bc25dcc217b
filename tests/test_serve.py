"""``prefixgate serve``'s HTTP front on fake engines: the OpenAI shapes, error mapping, SSE,
metrics, and cancellation when a client leaves. The real-vLLM checks are in test_serve_vllm.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixgate import (
    CanonicalizeConfig,
    FakeClock,
    Gateway,
    GatewayConfig,
    MonotonicClock,
    QueueFull,
    RateLimited,
)
from prefixgate.serve import METRICS, RetrySpread, ServeMetrics, create_app
from prefixgate.serve.cli import config_fields, gateway_config, parse_args, vllm_args
from prefixgate.serve.testing import running, sse_data
from prefixgate.testing import FakeEngine

PROMPT = "The shared system prompt, then a question."


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
def engine():
    return FakeEngine(block_size=4, max_model_len=256)


async def test_completion_reports_usage_with_the_engines_cached_tokens(engine):
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, client(create_app(gw)) as c:
        first = await c.post("/v1/completions",
                             json={"model": "fake-model", "prompt": PROMPT, "max_tokens": 3})
        again = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"][0]["finish_reason"] == "length"
    n = len(PROMPT.encode())
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # The second sees the first's full blocks, less the last token (always recomputed).
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 4 * 4
    assert gw.statistics().outcomes == {"completed": 2}


async def test_chat_streams_sse_chunks_then_usage_then_done(engine):
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, client(create_app(gw)) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_completion_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": PROMPT, "max_tokens": 2, "logprobs": 3}, 400, "logprobs"),   # not implemented: named
    ({"prompt": PROMPT, "n": 2}, 400, "n"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [PROMPT, PROMPT]}, 400, "prompt"),                         # batches
    ({"prompt": PROMPT, "model": "other"}, 404, "model"),
    ({"prompt": "   "}, 400, None),                                         # the gateway's InvalidRequest
    ({"prompt": PROMPT, "temperature": 0.5}, 400, None),                    # FakeEngine takes max_tokens only
])
async def test_invalid_input_is_a_4xx_in_openais_error_shape(engine, body, status, param):
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, client(create_app(gw)) as c:
        r = await c.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert engine.started == []


async def test_a_full_queue_is_a_429_with_retry_after_before_any_output(engine):
    engine.step = asyncio.Event()  # holds every request in the engine
    config = GatewayConfig(ingress="inline", ordering="fcfs", max_in_flight=1, max_queue_len=1)
    async with Gateway(engine, config) as gw, client(create_app(gw, min_retry_after=0.25)) as c:
        body = {"prompt": PROMPT, "max_tokens": 1}
        held = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
        while gw.statistics().queued + gw.statistics().running < 2:
            await asyncio.sleep(0)
        refused = await c.post("/v1/completions", json=body)
        engine.step.set()
        ok = await asyncio.gather(*held)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) >= 250
    assert [r.status_code for r in ok] == [200, 200]
    assert gw.statistics().refused == {"queue_full": 1}


async def test_shutting_down_is_a_503(engine):
    gw = Gateway(engine, GatewayConfig(ingress="inline"))
    async with gw, client(create_app(gw)) as c:
        await gw.aclose()
        r = await c.post("/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


async def test_a_queue_timeout_before_the_first_output_is_a_503_not_a_broken_stream(engine):
    clock = FakeClock()  # the gateway's: queue_timeout fires when the test moves it
    engine.step = asyncio.Event()
    config = GatewayConfig(ingress="inline", ordering="fcfs", max_in_flight=1, queue_timeout=5.0)
    async with Gateway(engine, config, clock=clock) as gw, client(create_app(gw)) as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}))
        queued = asyncio.create_task(c.post("/v1/completions", json={"prompt": PROMPT, "stream": True}))
        while gw.statistics().queued < 1:
            await asyncio.sleep(0)
        await clock.advance(6.0)
        timed_out = await queued
        engine.step.set()
        assert (await held).status_code == 200
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "queue_timeout"


async def test_an_engine_failure_after_the_first_output_ends_the_sse_stream_with_an_error_chunk():
    engine = FakeEngine(block_size=4, max_model_len=256, fail_after=1)
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, \
            client(create_app(gw, metrics=(meter := ServeMetrics(gw)))) as c:
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
    # The stream ended with an error, not a client leaving.
    assert not meter.registry.get_sample_value("prefixgate_client_disconnects_total", {"phase": "streaming"})
    events = sse_data(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error" and events[-2]["error"]["code"] == "engine_error"
    assert gw.statistics().outcomes == {"engine_error": 1}


async def test_models_health_and_ready(engine):
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, client(
            create_app(gw, model_name="tiny")) as c:
        models = (await c.get("/v1/models")).json()
        health, ready = await c.get("/health"), await c.get("/ready")
        wrong = await c.post("/v1/completions", json={"prompt": PROMPT, "model": "fake-model"})
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    assert health.status_code == ready.status_code == 200
    assert wrong.status_code == 404


async def test_ready_turns_503_when_the_one_engine_dies_or_reports_itself_unhealthy(engine):
    # One engine, in process: /ready follows Gateway.healthy, which reads the replica's death
    # (found by a request) and the engine's own health (VllmEngine: vLLM's errored flag).
    engine.die_after = 1
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, client(create_app(gw)) as c:
        assert (await c.get("/ready")).status_code == 200 and gw.healthy
        died = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        ready, health = await c.get("/ready"), await c.get("/health")
    assert died.status_code >= 500
    assert ready.status_code == 503 and ready.json() == {"status": "not_ready"} and not gw.healthy
    assert health.status_code == 200  # the process is up: a liveness probe must not restart it

    other = FakeEngine(block_size=4, max_model_len=256)
    async with Gateway(other, GatewayConfig(ingress="inline")) as gw, client(create_app(gw)) as c:
        other.healthy = False  # an engine that knows it is unhealthy, with no request sent
        assert (await c.get("/ready")).status_code == 503
        other.healthy = True
        assert (await c.get("/ready")).status_code == 200


async def test_ready_with_several_replicas_needs_one_that_can_serve():
    a, b = FakeEngine(block_size=4, max_model_len=256), FakeEngine(block_size=4, max_model_len=256)
    async with Gateway([a, b], GatewayConfig(ingress="inline")) as gw, client(create_app(gw)) as c:
        a.healthy = False
        assert (await c.get("/ready")).status_code == 200 and gw.healthy
        b.healthy = False
        assert (await c.get("/ready")).status_code == 503 and not gw.healthy


async def test_metrics_parse_and_every_documented_metric_is_present(engine):
    engine.step = asyncio.Event()
    config = GatewayConfig(ingress="inline", ordering="fcfs", max_in_flight=1, max_queue_len=1)
    async with Gateway(engine, config) as gw:
        app = create_app(gw)
        async with client(app) as c:
            body = {"prompt": "Some  text  with  doubled  spaces.", "max_tokens": 1}
            held = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
            while gw.statistics().queued + gw.statistics().running < 2:
                await asyncio.sleep(0)
            assert (await c.post("/v1/completions", json=body)).status_code == 429
            engine.step.set()
            await asyncio.gather(*held)
            r = await c.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in METRICS:
        assert name.removesuffix("_total") in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("prefixgate_requests_total", (("outcome", "completed"),))] == 2
    assert samples[("prefixgate_refusals_by_reason_total", (("reason", "queue_full"),))] == 1
    assert samples[("prefixgate_http_refused_total", (("outcome", "queue_full"),))] == 1
    assert samples[("prefixgate_canonicalized_requests_total", (("rule", "inner_spaces"),))] == 2  # accepted
    assert samples[("prefixgate_time_to_first_token_seconds_count", (("endpoint", "completions"),))] == 2
    assert samples[("prefixgate_queue_wait_seconds_count", ())] == 2
    assert samples[("prefixgate_tenant_in_flight", (("tenant", "_none"),))] == 0
    assert samples[("prefixgate_placements_total", (("replica", "replica-0"),))] == 2


async def wait_for(predicate) -> None:
    """Yields to the server until ``predicate()`` holds (the per-test timeout bounds it)."""
    while not predicate():
        await asyncio.sleep(0.005)


async def test_a_client_leaving_while_queued_frees_its_place_and_one_streaming_aborts():
    clock = FakeClock()  # the engine's: each output waits one virtual second
    engine = FakeEngine(block_size=4, max_model_len=256, clock=clock, output_time=1.0)
    config = GatewayConfig(ingress="inline", ordering="fcfs", max_in_flight=1, max_queue_len=1)
    async with Gateway(engine, config) as gw, running(create_app(gw, metrics=(meter := ServeMetrics(gw)))) \
            as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
        request = c.build_request("POST", "/v1/completions", json=body)
        opening = asyncio.create_task(c.send(request, stream=True))
        await wait_for(lambda: len(engine.started) == 1)
        await clock.advance(1.0)
        streaming = await opening  # headers come with the first output
        queued = asyncio.create_task(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}))
        await wait_for(lambda: gw.statistics().queued == 1)
        queued.cancel()  # the queued client leaves: its place is free again, the engine never saw it
        await wait_for(lambda: gw.statistics().queued == 0)
        assert gw.statistics().outcomes == {"cancelled": 1} and len(engine.started) == 1
        assert streaming.status_code == 200
        await streaming.aclose()  # the streaming client leaves: its engine request is aborted
        await wait_for(lambda: engine.aborted == engine.started[:1])
        late = asyncio.create_task(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}))
        while not late.done():
            await clock.advance(1.0)
            await asyncio.sleep(0.005)
    assert late.result().status_code == 200
    assert len(engine.started) == 2 and engine.aborted == engine.started[:1]
    assert gw.statistics().outcomes == {"cancelled": 2, "completed": 1}
    assert gw.statistics().running == gw.statistics().queued == 0
    left = {phase: meter.registry.get_sample_value("prefixgate_client_disconnects_total", {"phase": phase})
            for phase in ("queued", "streaming")}
    assert left == {"queued": 1, "streaming": 1}  # each client that left, once, in its phase


def test_gateway_config_from_flags_and_environment():
    options, fields, engine_args = parse_args(
        ["--port", "9000", "--max-queue-len", "50", "--queue-timeout", "none", "--model", "m",
         "--max-model-len", "64"],
        {"PREFIXGATE_MAX_QUEUE_LEN": "7", "PREFIXGATE_CANONICALIZE": "prose",
         "PREFIXGATE_REPLICA": "http://a:1,http://b:2", "PREFIXGATE_ISOLATE_TENANTS": "false"})
    assert options["port"] == 9000 and options["replica"] == ["http://a:1", "http://b:2"]
    assert engine_args == ["--model", "m", "--max-model-len", "64"]  # vLLM's, not --model-name
    config = gateway_config(fields)
    assert config.max_queue_len == 50 and config.queue_timeout is None  # the flag wins
    assert config.isolate_tenants is False and config.canonicalize == CanonicalizeConfig.named("prose")
    assert {"max_queue_len", "ordering", "placement", "kv_budget"} <= {n for n, _, _ in config_fields()}
    with pytest.raises(ValueError, match=r"GatewayConfig\.max_queue_len"):
        gateway_config({"max_queue_len": "many"})
    options, _, _ = parse_args(["--replica", "http://a:1", "--kv-events", "tcp://a:5557"],
                               {"PREFIXGATE_KV_EVENTS": "tcp://x:1,tcp://y:2"})
    assert options["kv_events"] == ["tcp://a:5557"]  # one per --replica; the flag wins
    assert parse_args([], {"PREFIXGATE_KV_EVENTS": "tcp://x:1,tcp://y:2"})[0]["kv_events"] == [
        "tcp://x:1", "tcp://y:2"]


def test_engine_sizes_serve_reads_for_remotes_still_reach_an_in_process_vllm():
    """``--max-num-seqs`` and ``--max-num-batched-tokens`` are serve's own flags (remote replicas
    do not report them); in process they are vLLM's too and must not be swallowed."""
    options, fields, engine_args = parse_args(
        ["--model", "m", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
         "--prefill-backlog-steps", "2"], {"PREFIXGATE_MAX_NUM_BATCHED_TOKENS": "999"})
    assert options["max_num_seqs"] == 8 and options["max_num_batched_tokens"] == 512  # the flag wins
    assert vllm_args(options, engine_args) == ["--model", "m", "--max-num-seqs", "8",
                                               "--max-num-batched-tokens", "512"]
    assert gateway_config(fields).prefill_backlog_steps == 2.0
    assert gateway_config({"prefill_backlog_steps": "none"}).prefill_backlog_steps is None
    options, _, engine_args = parse_args(["--model", "m"], {})
    assert vllm_args(options, engine_args) == ["--model", "m"]


async def test_serve_refuses_kv_events_that_do_not_pair_with_the_replicas():
    from prefixgate.serve.cli import serve

    options, _, _ = parse_args(["--replica", "http://a:1", "--replica", "http://b:2",
                                "--kv-events", "tcp://a:5557"], {})
    with pytest.raises(SystemExit, match="one endpoint per --replica"):
        await serve(options, GatewayConfig(), [])
    options, _, _ = parse_args(["--replica", "http://a:1", "--kv-events", "tcp://a:5557",
                                "--kv-events-replay", "tcp://a:5558",
                                "--kv-events-replay", "tcp://b:5558"], {})
    with pytest.raises(SystemExit, match="one endpoint per --kv-events"):
        await serve(options, GatewayConfig(), [])
    assert parse_args([], {"PREFIXGATE_KV_EVENTS_REPLAY": "tcp://x:2,tcp://y:3"})[0]["kv_events_replay"] == [
        "tcp://x:2", "tcp://y:3"]


async def test_retry_after_honoured_by_the_openai_client_gets_nine_in_ten_admitted():
    """Overload through HTTP: 32 clients at once against room for 6 (2 running, 4 queued). The
    refused get 429s whose Retry-After the openai client sleeps before retrying (5 retries)."""
    openai = pytest.importorskip("openai")
    engine = FakeEngine(block_size=4, max_model_len=256, clock=MonotonicClock(), output_time=0.01)
    config = GatewayConfig(ingress="inline", ordering="fcfs", max_in_flight=2, max_queue_len=4)
    async with Gateway(engine, config) as gw, running(create_app(gw, model_name="m")) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=5)

        async def one(i: int) -> bool:
            try:
                await client.completions.create(model="m", prompt=f"{PROMPT} {i}", max_tokens=3)
            except openai.RateLimitError:
                return False
            return True

        ok = await asyncio.gather(*(one(i) for i in range(32)))
        await client.close()
    stats = gw.statistics()
    assert stats.refused.get("queue_full", 0) >= 10  # it was overloaded: many 429s were sent
    assert sum(ok) >= 0.9 * len(ok), (sum(ok), dict(stats.refused))
    assert stats.outcomes == {"completed": sum(ok)}


def test_retry_spread_tells_a_burst_to_come_back_one_place_apart():
    now = [100.0]
    spread = RetrySpread(4, max_delay=3.0, now=lambda: now[0])
    full = QueueFull("full", retry_after=1.0, reason="queue_full")
    assert [spread.delay(full) for _ in range(3)] == [1.0, 1.25, 1.5]
    assert spread.delay(RateLimited("tenant", retry_after=0.5, reason="rate_limited")) == 0.5  # its own
    assert [spread.delay(full) for _ in range(8)][-4:] == [2.75, 3.0, 3.0, 3.0]  # capped
    now[0] = 200.0  # the horizon is past: back to the gateway's own estimate
    assert spread.delay(full) == 1.0


async def test_a_client_leaving_a_non_streamed_request_while_it_runs_aborts_it():
    clock = FakeClock()  # the engine's: each output waits one virtual second
    engine = FakeEngine(block_size=4, max_model_len=256, clock=clock, output_time=1.0)
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw, running(create_app(gw)) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as c:
        waiting = asyncio.create_task(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}))
        await wait_for(lambda: len(engine.started) == 1)
        await clock.advance(1.0)  # its first output: a non-streamed response still waits for the last
        await wait_for(lambda: gw.statistics().running == 1)
        waiting.cancel()  # the client leaves mid-generation
        await wait_for(lambda: engine.aborted == engine.started)
        await wait_for(lambda: gw.statistics().running == 0)
    assert gw.statistics().outcomes == {"cancelled": 1}


@pytest.mark.parametrize("leave", ["disconnect at the headers", "send fails at the headers"])
async def test_a_streamed_request_is_aborted_when_the_client_leaves_before_any_event(leave):
    # Driven as an ASGI server would, so the client can leave at the one moment between the
    # first output (the handler waits for it) and the first event: the disconnect arrives as
    # the headers go out, or sending them raises (a connection reset). The events' generator
    # never runs in either; the request must still be cancelled and its engine request aborted.
    engine = FakeEngine(block_size=4, max_model_len=256, clock=MonotonicClock(), output_time=0.01)
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw:
        meter = ServeMetrics(gw)
        app = create_app(gw, metrics=meter)
        body = b'{"prompt": "hello there", "max_tokens": 2000, "stream": true}'
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
                 "headers": [(b"content-type", b"application/json"), (b"host", b"test")]}
        gone = asyncio.Event()
        bodies = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[str] = []

        async def receive() -> dict:
            if bodies:
                return bodies.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message["type"])
            if message["type"] == "http.response.start":
                if leave.startswith("send fails"):
                    raise OSError("connection reset by peer")
                gone.set()

        try:
            await asyncio.wait_for(app(scope, receive, send), 10)
        except OSError:
            assert leave.startswith("send fails")
        assert sent[0] == "http.response.start"
        assert engine.aborted == engine.started and len(engine.started) == 1
        stats = gw.statistics()
        assert stats.outcomes == {"cancelled": 1} and stats.running == 0 and stats.queued == 0
        left = meter.registry.get_sample_value("prefixgate_client_disconnects_total", {"phase": "streaming"})
        assert left == 1  # counted once, as a client that left while streaming
