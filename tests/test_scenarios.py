"""Issue 4 and 5 scenarios on tiny SimEngine sizes: schema, accounting, determinism.

Benchmarks are programs, not tests: nothing here asserts a latency, a throughput or a must-show
bound; only that the runs are complete, consistent and reproducible.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks.engines import SimFactory
from benchmarks.metrics import ArmRun, Refusal, RequestRecord
from benchmarks.overload import SLO_FACTOR, admission_settings, reject_cost, retry_after_accuracy
from benchmarks.run import parse_args
from benchmarks.scenarios import SCENARIOS, format_scenario, run_scenario, workload_checks
from prefixgate.testing import ByteTokenizer

TINY = {"groups": 2, "per_group": 6, "prefix_tokens": 64, "suffix_tokens": 8, "max_tokens": 2}
TINY_W4 = {"groups": 2, "prefix_tokens": 64, "suffix_tokens": 8, "max_tokens": 4, "kv_cap_tokens": 16_400}
CHECK_KEYS = {"check", "measured", "op", "bound", "holds", "note"}


def sim_factory() -> SimFactory:
    return SimFactory("sim", ByteTokenizer())


def assert_common(result: dict[str, Any], name: str) -> None:
    json.dumps(result, allow_nan=False)
    assert result["scenario"] == name and result["engine"] == "sim"
    assert result["params"]["code"]["src_sha1"]
    for label, arm in result["arms"].items():
        assert arm["setup"]["arm"] in ("B1", "L"), label
        for rep in arm["repeats"]:
            assert rep["completed"] + rep["rejected"] + rep["errored"] == rep["offered"], label
        assert arm["offered"] == arm["setup"]["requests"], label
    for c in result["checks"]:
        assert set(c) == CHECK_KEYS
    accounted = [c for c in result["checks"] if "accounted" in c["check"]]
    assert accounted and all(c["holds"] for c in accounted)
    table = format_scenario(result)
    assert all(label in table for label in result["arms"])


def strip_wall_clock(result: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in result.items() if k not in ("runtime_s", "reject_cost", "summary")}
    return json.loads(json.dumps(out))


def test_the_cli_knows_every_scenario():
    assert parse_args(["--scenario", "overload", "--engine", "sim", "--duration", "5"]).duration == 5.0
    with pytest.raises(SystemExit):
        parse_args(["--scenario", "overload", "--workload", "W1"])
    assert set(SCENARIOS) == {"starvation", "flood", "noisy", "overload", "overload-short", "no-reject",
                              "reject-cost"}


async def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="scenario"):
        await run_scenario("stampede", sim_factory(), size="sim")


async def test_starvation_variants_and_queue_wait_metrics(tmp_path):
    result = await run_scenario("starvation", sim_factory(), size="sim", repeats=1,
                                overrides={**TINY, "cold_requests": 4})
    assert_common(result, "starvation")
    arms = result["arms"]
    assert {"L", "L no-aging", "L fcfs", "L engine-window", "B1", "L @1.2x"} <= set(arms)
    assert arms["L"]["setup"]["gateway_config"]["max_in_flight"] == 16
    assert arms["L fcfs"]["setup"]["gateway_config"]["ordering"] == "fcfs"
    assert arms["L engine-window"]["setup"]["gateway_config"]["max_in_flight"] is None
    assert arms["L"]["setup"]["rate"] == pytest.approx(0.9 * result["params"]["capacity_req_per_s"])
    for label in ("L", "L @1.2x"):
        assert arms[label]["max_cold_queue_wait_s"] is not None
        assert arms[label]["aged_dispatches"] is not None
    assert arms["B1"]["queue_wait_p50_s"] is None  # bare vLLM has no gateway queue
    assert result["checks"][0]["check"].startswith("0.9x, L (prefix, aging)")
    from benchmarks.plot import plot

    plot([result], tmp_path / "starvation.png")  # a scenario's own panels
    assert (tmp_path / "starvation.png").read_bytes()[:4] == b"\x89PNG"


async def test_noisy_neighbour_tenants_and_patience():
    result = await run_scenario("noisy", sim_factory(), size="sim", repeats=1, duration=0.15,
                                overrides={"groups": 2, "prefix_tokens": 64, "suffix_tokens": 8,
                                           "max_tokens": 2})
    assert_common(result, "noisy")
    arms = result["arms"]
    quiet = {f"quiet{k}" for k in range(4)}
    for setting in ("B1", "L none", "L share", "L rate", "L rate+share"):
        alone, mixed = arms[f"{setting} / quiet only"], arms[f"{setting} / with noisy"]
        assert set(alone["by_tenant"]) == quiet
        assert set(mixed["by_tenant"]) == quiet | {"noisy"}
        assert alone["quiet_p99_ratio"] == mixed["quiet_p99_ratio"]
        assert mixed["setup"]["patience"] == {"noisy": 10.0} and alone["setup"]["patience"] == {}
        assert alone["quiet_completed"] == mixed["quiet_completed"]  # quiet tenants never give up
    limits = arms["L rate+share / with noisy"]["setup"]["gateway_config"]["default_tenant_limits"]
    assert limits["rate"] == pytest.approx(result["params"]["fair_share_rate"])
    assert limits["max_in_flight_share"] == 0.2
    params = result["params"]
    assert params["noisy_rate"] == pytest.approx(10 * params["quiet_rate"])


async def test_overload_accounts_for_every_request_and_is_deterministic():
    kwargs = dict(size="sim", repeats=1, duration=0.5, overrides=TINY_W4)
    result = await run_scenario("overload", sim_factory(), **kwargs)
    assert_common(result, "overload")
    params = result["params"]
    assert params["slo_ttft_s"] == pytest.approx(SLO_FACTOR * params["unloaded"]["cold_ttft_s"])
    assert params["admission"] == admission_settings(params["slo_ttft_s"])
    arms = result["arms"]
    assert set(arms) == {"B1 @2.0x", "L @2.0x", "L retry @2.0x", "L tight @2.0x", "B1 @0.8x", "L @0.8x"}
    tight = arms["L tight @2.0x"]["setup"]["gateway_config"]
    assert tight["queue_timeout"] == tight["max_queue_wait"] == pytest.approx(params["slo_ttft_s"] / 8)
    gateway = arms["L @2.0x"]["setup"]["gateway_config"]
    assert gateway["max_queue_wait"] == params["admission"]["max_queue_wait"]
    assert arms["L retry @2.0x"]["setup"]["retries"] == 3
    for arm in arms.values():
        assert arm["slo_met"] is not None and arm["slo_met"] <= arm["completed"]
    assert {"decision", "ingress", "total"} <= set(result["reject_cost"])
    assert len(result["retry_after_accuracy"]) == 1
    again = await run_scenario("overload", sim_factory(), **kwargs)
    assert strip_wall_clock(again)["arms"] == strip_wall_clock(result)["arms"]


async def test_no_reject_uses_the_same_admission_rule():
    result = await run_scenario("no-reject", sim_factory(), size="sim", repeats=2, overrides=TINY)
    assert_common(result, "no-reject")
    arm = result["arms"]["L @0.8x"]
    assert arm["setup"]["gateway_config"]["queue_timeout"] == result["params"]["slo_ttft_s"] / 2
    first, second = arm["repeats"]  # the simulator is deterministic (up to float rounding of
    for key in ("completed", "rejected", "cached_tokens", "preemptions"):  # later clock readings)
        assert first[key] == second[key], key
    assert first["ttft_p99_s"] == pytest.approx(second["ttft_p99_s"])


def test_retry_after_accuracy_reads_arrivals_as_probes():
    def rec(at: float, refused: float | None = None) -> RequestRecord:
        r = RequestRecord(arrival=at, finished=at, outcome="rejected" if refused is not None else "completed")
        if refused is not None:
            r.refusals.append(Refusal(at, refused, "predicted_wait", 1e-5, 1e-5))
        return r

    run = ArmRun("L", 0, 0.0, (rec(0.0), rec(1.0, 0.5), rec(2.0, 2.5), rec(3.0), rec(4.0)), 0)
    a = retry_after_accuracy(run)
    assert a["refusals"] == 2
    assert (a["actual_s"]["n"], a["actual_s"]["max"]) == (2, 2.0)  # 1 -> 3, and 2 -> 3
    assert sorted([a["error_s"]["p10"], a["error_s"]["max"]]) == [-1.5, 1.5]
    assert a["retry_accepted"] == 0.0  # the first arrival after 1.5 (at 2) was refused; none after 4.5
    assert a["accept_share_of_arrivals"] == pytest.approx(3 / 5)
    assert a["probe_gap_mean_s"] == 1.0


def test_reject_cost_pools_refusals_in_microseconds():
    r = RequestRecord(arrival=0.0)
    r.refusals += [Refusal(0.0, 1.0, "predicted_wait", 2e-3, 1e-4),
                   Refusal(1.0, 1.0, "queue_full", 4e-3, 3e-4)]
    cost = reject_cost([ArmRun("L", 0, 0.0, (r,), 0)])
    assert cost["unit"] == "us"
    assert cost["decision"]["n"] == 2 and cost["decision"]["max"] == pytest.approx(300.0)
    assert cost["total"]["p50"] == pytest.approx(2100.0)


def test_workload_checks_name_issue_4_bounds():
    def arm(req: float, hit: float) -> dict[str, Any]:
        return {"req_per_s": req, "hit_rate": hit,
                "repeats": [{"completed": 1, "rejected": 0, "errored": 0, "offered": 1}]}

    w2 = {"workload": "W2", "params": {"noise_p": 0.0},
          "arms": {"B1": arm(1.0, 0.1), "L": arm(5.0, 0.8), "O": arm(5.5, 0.82)}}
    checks = {c["check"]: c for c in workload_checks(w2)}
    assert checks["L req/s >= 2 x B1's"]["holds"] and checks["L hit rate >= 0.9 x O's"]["holds"]
    assert checks["L req/s >= 0.85 x O's"]["bound"] == pytest.approx(0.85 * 5.5)
    w1 = {"workload": "W1", "params": {"noise_p": 0.0}, "arms": {"B1": arm(10.0, 0.9), "L": arm(9.7, 0.9)}}
    (only,) = workload_checks(w1)
    assert only["holds"] is False and only["bound"] == pytest.approx(9.8)
    assert workload_checks({**w1, "params": {"noise_p": 0.5}}) == []


async def test_reject_cost_micro_benchmark_refuses_every_probe():
    result = await run_scenario("reject-cost", sim_factory(), size="sim", repeats=1,
                                overrides={"prefix_tokens": 128})
    json.dumps(result, allow_nan=False)
    (arm,) = result["arms"].values()
    assert arm["refused"] == result["params"]["samples"] and arm["accepted"] == 0
    assert arm["decision_p50_us"] <= arm["decision_p99_us"] <= arm["decision_max_us"]
    assert "decision p99" in format_scenario(result)
