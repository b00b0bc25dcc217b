"""The benchmark harness on SimEngine: JSON schema, accounting, arm order, metrics, CLI pieces."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from benchmarks.engines import SimFactory
from benchmarks.harness import gateway_config, run_arm, run_benchmark, run_calibration
from benchmarks.metrics import ArmRun, RequestRecord, arm_metrics
from benchmarks.run import format_table
from benchmarks.workloads import make_trace
from prefixgate import CanonicalizeConfig
from prefixgate.testing import ByteTokenizer

TINY = {"groups": 2, "per_group": 3, "prefix_tokens": 64, "suffix_tokens": 8, "max_tokens": 2}
ARM_KEYS = {"req_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "hit_rate", "prefill_tokens",
            "preemptions", "rejected", "errored", "completed", "offered", "max_queue_wait_s", "repeats"}


def sim_factory() -> SimFactory:
    return SimFactory("sim", ByteTokenizer())  # block 16, the GPU profile


def tiny_trace(workload: str = "W1", **overrides: Any):
    return make_trace(workload, "sim", seed=0, tokenizer=ByteTokenizer(), overrides={**TINY, **overrides})


def assert_accounted(result: dict[str, Any]) -> None:
    for arm, m in result["arms"].items():
        for rep in m["repeats"]:
            assert rep["completed"] + rep["rejected"] + rep["errored"] == rep["offered"], arm
            assert rep["offered"] == result["params"]["requests"], arm


async def test_w1_smoke_schema_and_accounting():
    trace = tiny_trace()
    result = await run_benchmark(trace, sim_factory(), repeats=2)
    json.dumps(result, allow_nan=False)  # JSON-ready
    assert {"workload", "engine", "vllm_version", "params", "ceiling", "arms", "ratios"} <= set(result)
    assert (result["workload"], result["engine"], result["vllm_version"]) == ("W1", "sim", None)
    assert {"hit_rate", "min_prefill_tokens"} <= set(result["ceiling"])
    assert list(result["arms"]) == ["B0", "B1", "L", "O"]
    for m in result["arms"].values():
        assert set(m) >= ARM_KEYS
        assert len(m["repeats"]) == 2
        assert m["completed"] == 6 and m["errored"] == 0
    assert {"L_over_B1_req_per_s", "kappa"} <= set(result["ratios"])
    assert_accounted(result)
    arms, ceil = result["arms"], result["ceiling"]
    assert arms["B0"]["hit_rate"] == 0.0
    for m in arms.values():  # no arm beats the ceiling
        assert m["cached_tokens"] <= ceil["hit_tokens"]
    assert arms["O"]["cached_tokens"] == ceil["hit_tokens"]
    assert arms["L"]["max_queue_wait_s"] is not None and arms["B1"]["max_queue_wait_s"] is None
    assert result["ratios"]["kappa"] is not None
    table = format_table(result)
    assert "ceiling" in table and "kappa" in table


async def test_warm_up_runs_go_to_the_engine_but_not_into_the_results():
    trace = tiny_trace()
    seen: list[str] = []
    factory = sim_factory()
    start = factory.start

    async def start_and_watch(**kwargs):
        running = await start(**kwargs)
        generate = running.engine.generate

        def watched(request):
            seen.append(request.request_id)
            return generate(request)

        running.engine.generate = watched
        return running

    factory.start = start_and_watch  # type: ignore[method-assign]
    result = await run_benchmark(trace, factory, arms=["B1", "O"], repeats=2, warmup=1)
    n = len(trace.requests)
    assert result["params"]["warmup"] == 1
    assert all(len(m["repeats"]) == 2 and m["completed"] == n for m in result["arms"].values())
    assert len(seen) == 2 * 3 * n  # per arm: one warm-up run, then two measured ones
    assert sum("-r-100-" in rid for rid in seen) == 2 * n


async def test_w3_canonicalization_recovers_the_meant_sharing():
    trace = tiny_trace("W3", noise_p=1.0, prefix_tokens=160, per_group=4)
    # The prose rule set undoes all of W3's noise (safe, the default, keeps tabs and hard breaks).
    result = await run_benchmark(trace, sim_factory(), arms=["B1", "L", "O"], repeats=1,
                                 gateway_overrides={"canonicalize": "prose"})
    assert_accounted(result)
    arms = result["arms"]
    assert arms["L"]["hit_rate"] > arms["B1"]["hit_rate"]
    assert arms["L"]["cached_tokens"] == arms["O"]["cached_tokens"] == result["ceiling"]["hit_tokens"]
    assert arms["L"]["prefill_tokens"] == result["ceiling"]["min_prefill_tokens"]
    assert result["ratios"]["kappa"] == pytest.approx(1.0)
    assert arms["L"]["gateway"][0]["canonicalized"] == len(trace.requests)


async def test_w3_without_canonicalization_loses_it():
    trace = tiny_trace("W3", noise_p=1.0, prefix_tokens=160, per_group=4)
    result = await run_benchmark(trace, sim_factory(), arms=["B1", "L"], repeats=1,
                                 gateway_overrides={"canonicalize.enabled": False})
    assert result["params"]["gateway_config"]["canonicalize"]["enabled"] is False
    assert result["arms"]["L"]["cached_tokens"] < result["ceiling"]["hit_tokens"]


class RecordingFactory:
    """A SimFactory that may run one engine at a time, like real vLLM, and logs what it does."""

    name = "sim"
    vllm_version = None
    concurrent_engines = False

    def __init__(self) -> None:
        self.inner = sim_factory()
        self.log: list[str] = []

    def tokenizer(self) -> Any:
        return self.inner.tokenizer()

    async def start(self, *, caching: bool, kv_cap_tokens: int | None) -> Any:
        running = await self.inner.start(caching=caching, kv_cap_tokens=kv_cap_tokens)
        log, engine, close = self.log, running.engine, running.close
        live = [True]
        log.append(f"start {'on' if caching else 'off'}")
        generate = engine.generate

        def logged_generate(request: Any) -> Any:
            assert live[0], "request sent to a closed engine"
            arm = request.request_id.split("-")[0]
            if not log or log[-1] != arm:
                log.append(arm)
            return generate(request)

        async def logged_close() -> None:
            live[0] = False
            log.append(f"close {'on' if caching else 'off'}")
            await close()

        engine.generate = logged_generate
        running.close = logged_close
        return running


async def test_one_engine_at_a_time_runs_b0_first_then_the_rest_interleaved():
    f = RecordingFactory()
    result = await run_benchmark(tiny_trace(), f, repeats=2)
    assert f.log == ["start off", "B0", "close off", "start on",
                     "B1", "L", "O", "B1", "L", "O", "close on"]
    assert "B0 repeats" in result["params"]["schedule"]
    assert_accounted(result)


async def test_concurrent_engines_interleave_all_arms():
    f = RecordingFactory()
    f.concurrent_engines = True
    await run_benchmark(tiny_trace(), f, repeats=2)
    runs = [e for e in f.log if not e.startswith(("start", "close"))]
    assert runs == ["B0", "B1", "L", "O", "B0", "B1", "L", "O"]


async def test_poisson_at_a_multiple_of_measured_capacity():
    trace = tiny_trace("W4", kv_cap_tokens=16_400)  # a cap must still fit one max_model_len sequence
    assert trace.arrivals.pending
    result = await run_benchmark(trace, sim_factory(), repeats=1)
    params = result["params"]
    assert params["rate"] == pytest.approx(params["capacity_req_per_s"] * 2.0)
    assert params["engine_on"]["num_gpu_blocks"] == 1025  # ceil(16400 / 16), as vLLM's override
    assert_accounted(result)


async def test_closed_loop_arrivals():
    trace = tiny_trace(arrival="closed", concurrency=2)
    result = await run_benchmark(trace, sim_factory(), arms=["B1", "L"], repeats=1)
    assert_accounted(result)
    assert result["arms"]["L"]["completed"] == len(trace.requests)


async def test_w0_calibration_reports_rates():
    trace = make_trace("W0", "sim", tokenizer=ByteTokenizer(), overrides={
        "calib_prompts": 2, "calib_prompt_tokens": 256, "calib_short_prompts": 4,
        "calib_short_tokens": 16, "calib_short_max_tokens": 8})
    result = await run_calibration(trace, sim_factory())
    assert set(result["arms"]) == {"B1-prefill", "B1-decode"}
    assert result["calibration"]["prefill_tok_per_s"] > 0
    assert result["calibration"]["decode_tok_per_s"] > 0


async def test_w5_and_unknown_arms_are_refused():
    with pytest.raises(ValueError, match="W5"):
        await run_benchmark(tiny_trace("W5"), sim_factory())
    with pytest.raises(ValueError, match="arms"):
        await run_benchmark(tiny_trace(), sim_factory(), arms=["B2"])


def test_arm_metrics_from_records():
    done = [RequestRecord(arrival=a, first_output=f, finished=e, prompt_tokens=100, cached_tokens=c,
                          output_tokens=4, outcome="completed")
            for a, f, e, c in [(0.0, 1.0, 2.0, 0), (0.0, 2.0, 4.0, 64), (1.0, 4.0, 5.0, 96)]]
    records = (*done, RequestRecord(arrival=0.0, finished=0.5, outcome="rejected"),
               RequestRecord(arrival=0.0, finished=0.5, outcome="errored", error="boom"))
    m = arm_metrics(ArmRun("L", 0, 0.0, records, preemptions=3))
    assert m["req_per_s"] == pytest.approx(3 / 5.0)
    assert (m["ttft_p50_s"], m["ttft_p99_s"], m["e2e_p99_s"]) == (2.0, 3.0, 4.0)
    assert m["hit_rate"] == pytest.approx(160 / 300)
    assert (m["prefill_tokens"], m["preemptions"]) == (140, 3)
    assert (m["offered"], m["completed"], m["rejected"], m["errored"]) == (5, 3, 1, 1)
    assert m["max_queue_wait_s"] is None


def test_gateway_config_overrides():
    config = gateway_config("W1", {"canonicalize.inner_spaces": False, "max_queue_len": 7})
    assert config.canonicalize == CanonicalizeConfig(inner_spaces=False)
    assert config.max_queue_len == 7
    with pytest.raises(ValueError, match="unknown GatewayConfig field"):
        gateway_config("W1", {"colour": "blue"})


async def test_plot_writes_a_png(tmp_path):
    from benchmarks.plot import plot

    result = await run_benchmark(tiny_trace(), sim_factory(), repeats=1)
    out = tmp_path / "fig.png"
    plot([result, result], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_patient_clients_give_up_and_are_counted():
    trace = tiny_trace(arrival="poisson", rate=50.0, max_tokens=64)
    trace = dataclasses.replace(trace, requests=tuple(
        dataclasses.replace(r, tenant="impatient" if i % 2 else "patient")
        for i, r in enumerate(trace.requests)))
    running = await sim_factory().start(caching=True, kv_cap_tokens=None)
    run = await run_arm("L", 0, trace, running, patience={"impatient": 1e-4})
    m = arm_metrics(run)
    assert m["abandoned"] == m["by_tenant"]["impatient"]["abandoned"] == 3
    assert m["by_tenant"]["patient"]["completed"] == 3 and m["errored"] == 3
    assert all(r.error.startswith("ClientGaveUp") for r in run.records if r.abandoned)
    assert m["completed"] + m["rejected"] + m["errored"] == m["offered"]
    assert await running.engine.reset_prefix_cache()  # aborted requests left the engine


async def test_refused_clients_record_retry_after_and_retry():
    trace = tiny_trace(per_group=20, max_tokens=32)
    # Without the loop's charge a refusal comes at the very instant of arrival.
    factory = SimFactory("sim", ByteTokenizer(), charge_loop=False)
    running = await factory.start(caching=True, kv_cap_tokens=None)
    config = gateway_config("W1", {"max_queue_len": 2, "max_in_flight": 1})
    once = await run_arm("L", 0, trace, running, config)
    refused = [r for r in once.records if r.refusals]
    assert refused and all(r.outcome == "rejected" and r.attempts == 1 for r in refused)
    for r in refused:
        (f,) = r.refusals
        assert f.reason == "queue_full" and f.retry_after >= 0 and f.at == r.arrival
        assert f.decision_s >= 0 and f.ingress_s >= 0
    retried = await run_arm("L", 1, trace, running, config, retries=50)
    m = arm_metrics(retried)
    assert max(r.attempts for r in retried.records) > 1
    assert m["completed"] + m["rejected"] + m["errored"] == m["offered"]
    assert m["completed"] > arm_metrics(once)["completed"]


def test_arm_metrics_queue_waits_cold_requests_goodput_and_tenants():
    recs = [RequestRecord(arrival=0.0, first_output=f, finished=f + 1, prompt_tokens=10, outcome="completed",
                          queue_wait=w, cold=c, tenant=t)
            for f, w, c, t in [(0.5, 0.0, False, "a"), (1.0, 0.2, True, "a"), (3.0, 2.0, True, "b")]]
    recs.append(RequestRecord(arrival=2.0, finished=2.0, outcome="rejected", tenant="b"))
    m = arm_metrics(ArmRun("L", 0, 0.0, tuple(recs), 0), slo_ttft_s=1.0)
    assert (m["queue_wait_p50_s"], m["queue_wait_p99_s"], m["max_cold_queue_wait_s"]) == (0.2, 2.0, 2.0)
    assert m["cold_ttft_p99_s"] == 3.0
    assert m["slo_met"] == 2 and m["goodput_req_per_s"] == pytest.approx(2 / 4.0)
    assert m["window_s"] == 2.0 and m["goodput_window_req_per_s"] == pytest.approx(1.0)
    assert m["by_tenant"]["b"] == {"offered": 2, "completed": 1, "rejected": 1, "errored": 0, "abandoned": 0,
                                   "ttft_p50_s": 3.0, "ttft_p99_s": 3.0}
    assert arm_metrics(ArmRun("B1", 0, 0.0, tuple(recs), 0))["goodput_req_per_s"] is None
