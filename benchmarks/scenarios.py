"""Scenarios: the runs behind the "must show" lists of issues 4 (ordering) and 5 (admission).

A scenario runs several *variants* (an arm, the L arm's :class:`~prefixgate.GatewayConfig`, a
trace at some load, client behaviour) on one engine with prefix caching on, interleaved per
repeat (variant 1, 2, …, then again), and reports medians over repeats, a table and its
checks. Loads are multiples of a capacity measured first on the same engine (req/s of a burst
of the scenario's base trace), so the same scenario means the same thing on every engine.

=============  =====  ===========================================================================
scenario       issue  what it measures
=============  =====  ===========================================================================
starvation     4      W6 (hot groups + cache-cold unique prompts) at 0.9× (and 1.2×) L's capacity:
                      cold requests' longest queue wait against the median wait; prefix policy
                      with and without aging, FCFS, B1
noisy          4      four quiet tenants at rate r, with and without a noisy one at 10 r: quiet
                      tenants' p99 TTFT per tenant setting (none, in-flight share, rate), and B1
overload       5      W4 Poisson at 2× capacity for a sustained window vs 0.8×: preemptions,
                      goodput under a TTFT SLO from an unloaded W4 request, TTFT of admitted
                      requests, accounting, reject cost, retry_after accuracy (``overload.py``)
flood          10     a flood of identical prompts at 1.25× capacity for 60 s and 200 s, and one
                      different prompt at t = 0.5 s: its queue wait against the flood's median
                      (aging must hold against an endless group of riders)
overload-short 5, 9   ``overload`` cut to fit one GPU call: 1× capacity burst, 15 s, B1/L at 2×, L 0.8×
no-reject      5      W1 at 0.8× capacity with the same admission rule: nothing refused
reject-cost    5      the refusal path alone (``generate()`` → ``Overloaded``), timed 2000 times
=============  =====  ===========================================================================

Issue 4's W2 and W1/W3-at-p=0 checks run as plain workloads (``--workload``); their checks come
from :func:`workload_checks`. The simulator is deterministic: its repeats are identical.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prefixgate.config import TenantLimits

from .engines import EngineFactory
from .harness import code_version
from .metrics import ArmRun, arm_metrics, quantile
from .scenario_kit import Column, Session, Variant, accounted, check, summaries
from .workloads import Trace, TraceRequest, make_trace, tenant_mix

__all__ = ["SCENARIOS", "Column", "Session", "Variant", "check", "format_scenario", "run_scenario",
           "workload_checks"]


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, spec)


def format_scenario(result: Mapping[str, Any]) -> str:
    """A scenario's result as text: the variants' table, then its notes and checks."""
    cols = [Column(**c) for c in result["columns"]]
    width = max(12, *(len(label) + 2 for label in result["arms"]))
    lines = [f"scenario {result['scenario']} ({result.get('workload')}) on {result['engine']} "
             f"(size {result['params'].get('size')}, {result['params'].get('repeats')} repeats; "
             f"vLLM {result.get('vllm_version') or '-'})"]
    head = f"{'variant':<{width}}" + "".join(f"{c.header:>{max(9, len(c.header) + 2)}}" for c in cols)
    lines += [head, "-" * len(head)]
    for label, m in result["arms"].items():
        lines.append(f"{label:<{width}}" + "".join(
            f"{_fmt(m.get(c.key), c.fmt):>{max(9, len(c.header) + 2)}}" for c in cols))
    for key, value in result.get("summary", {}).items():
        lines.append(f"{key}: {value}")
    for c in result.get("checks", []):
        mark = {True: "HOLDS", False: "FAILS", None: "n/a"}[c["holds"]]
        lines.append(f"[{mark:>5}] {c['check']}: {_fmt(c['measured'], '.4g')} {c['op']} "
                     f"{_fmt(c['bound'], '.4g')}" + (f"  ({c['note']})" if c.get("note") else ""))
    if result.get("runtime_s") is not None:
        lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


def workload_checks(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 4's checks on a plain workload result (W2; W1 and W3 at ``noise_p == 0``)."""
    arms, params = result["arms"], result["params"]

    def get(arm: str, key: str) -> Any:
        return arms.get(arm, {}).get(key)

    def scaled(arm: str, key: str, factor: float) -> float | None:
        value = get(arm, key)
        return None if value is None else factor * value

    out = []
    if result["workload"] == "W2":
        out += [check("L hit rate >= 0.9 x O's", get("L", "hit_rate"), scaled("O", "hit_rate", 0.9), ">="),
                check("L req/s >= 0.85 x O's", get("L", "req_per_s"), scaled("O", "req_per_s", 0.85), ">="),
                check("L req/s >= 2 x B1's", get("L", "req_per_s"), scaled("B1", "req_per_s", 2.0), ">=")]
    if result["workload"] in ("W1", "W3") and params.get("noise_p") == 0:
        out.append(check("L req/s >= 0.98 x B1's (p=0)", get("L", "req_per_s"),
                         scaled("B1", "req_per_s", 0.98), ">="))
    for arm, m in arms.items():
        for rep in m.get("repeats", []):
            if rep["completed"] + rep["rejected"] + rep["errored"] != rep["offered"]:
                out.append(check(f"{arm}: every request accounted for", 0, 1, ">="))
    return out


# -- starvation (issue 4) ----------------------------------------------------------------------

# The L arm's in-flight window in the starvation scenario: small enough that the gateway, not
# the engine, holds the queue (with the engine's own window nothing ever waits in the gateway).
STARVATION_WINDOW = {"sim": 16, "gpu": 16, "cpu": 4}
STARVATION_LOADS = (0.9, 1.2)
WAITED = 1e-3  # a queue wait above this counts as having waited (``waited_share``)


def _starvation_extra(run: ArmRun) -> dict[str, Any]:
    waits = sorted(r.queue_wait for r in run.records if r.queue_wait is not None)
    if not waits:
        return {"waited_share": None, "median_positive_wait_s": None, "max_hot_queue_wait_s": None,
                "cold_wait_over_median": None}
    positive = [w for w in waits if w > WAITED]  # on a real engine every ticket waits a few us
    hot = [r.queue_wait for r in run.records if not r.cold and r.queue_wait is not None]
    m = arm_metrics(run)
    median = m["queue_wait_p50_s"]
    cold = m["max_cold_queue_wait_s"]
    return {"waited_share": len(positive) / len(waits),
            "median_positive_wait_s": quantile(positive, 0.5),
            "max_hot_queue_wait_s": max(hot) if hot else None,
            "cold_wait_over_median": cold / median if cold is not None and median else None}


async def starvation(session: Session, size: str, seed: int) -> dict[str, Any]:
    """W6 through L (prefix policy, aging on) at 0.9× and 1.2× L's measured capacity, beside
    the prefix policy without aging, FCFS, L with the engine's own window, and B1."""
    tokenizer = session.factory.tokenizer()
    trace = make_trace("W6", size, seed=seed, tokenizer=tokenizer, overrides=session.overrides)
    window = {"max_in_flight": STARVATION_WINDOW[size]}
    await session.start(trace.kv_cap_tokens)
    cap = await session.capacity(trace, arm="L", gateway=window)
    await session.capacity(trace, arm="B1", name="capacity_B1_req_per_s")
    traces = {f"{x}x": trace.with_rate(cap * x) for x in STARVATION_LOADS}
    no_aging = {**window, "min_aging_wait": 1e9}  # aging needs a wait above min_aging_wait
    variants = [Variant("L", "L", "0.9x", window),
                Variant("L no-aging", "L", "0.9x", no_aging),
                Variant("L fcfs", "L", "0.9x", {**window, "ordering": "fcfs"}),
                Variant("L engine-window", "L", "0.9x"),
                Variant("B1", "B1", "0.9x")]
    variants += [Variant(f"{v.label} @1.2x", v.arm, "1.2x", v.gateway) for v in variants[:3]]
    runs = await session.run(variants, traces)
    arms = summaries(variants, traces, runs, extra=_starvation_extra)
    main = arms["L"]
    checks = [check("0.9x, L (prefix, aging): max cold queue wait <= 2 x median queue wait",
                    main["max_cold_queue_wait_s"], _times(2, main["queue_wait_p50_s"]),
                    note=f"median wait {main['queue_wait_p50_s']}; {_pct(main['waited_share'])} of "
                         "requests waited at all"),
              check("every request accounted for", float(accounted(arms)), 1.0, "==")]
    for label in ("L @1.2x", "L engine-window"):
        m = arms[label]
        checks.append(check(f"{label}: max cold queue wait <= 2 x median queue wait",
                            m["max_cold_queue_wait_s"], _times(2, m["queue_wait_p50_s"]),
                            note="for reference"))
    return {"workload": "W6", "trace_params": dict(trace.params), "arms": arms, "checks": checks,
            "columns": [Column("req_per_s", "req/s", ".2f"), Column("hit_rate", "hit", ".3f"),
                        Column("queue_wait_p50_s", "wait p50", ".3f"),
                        Column("queue_wait_p99_s", "wait p99", ".3f"),
                        Column("max_cold_queue_wait_s", "max cold wait", ".3f"),
                        Column("max_hot_queue_wait_s", "max hot wait", ".3f"),
                        Column("waited_share", "waited", ".2f"),
                        Column("aged_dispatches", "aged", ".0f"),
                        Column("ttft_p50_s", "TTFT p50", ".3f"), Column("ttft_p99_s", "TTFT p99", ".3f"),
                        Column("cold_ttft_p99_s", "cold TTFT p99", ".3f"),
                        Column("completed", "done", ".0f")],
            "panels": [["queue_wait_p50_s", "median queue wait (s)"],
                       ["max_cold_queue_wait_s", "longest cold queue wait (s)"],
                       ["cold_ttft_p99_s", "cold requests' p99 TTFT (s)"]],
            "params": {"window": window, "loads": list(STARVATION_LOADS),
                       "capacity_arm": "L (prefix policy, the window, burst)"}}


FLOOD_DURATIONS = (60.0, 200.0)
FLOOD_LOAD = 1.1
FLOOD_BURST_S = 3.0  # the flood opens with this many seconds of capacity at once
FLOOD_ODD_AT = 0.5


def _flood_trace(base: Trace, odd: TraceRequest, capacity: float, duration: float) -> Trace:
    """``base``'s first prompt, identical: a burst of ``FLOOD_BURST_S`` × ``capacity`` requests at
    t = 0, then Poisson at ``FLOOD_LOAD`` × capacity for ``duration`` seconds; ``odd`` (marked
    cold) arrives at ``FLOOD_ODD_AT`` seconds, behind the burst."""
    import random

    rng = random.Random(f"flood-{duration}")
    flood = base.requests[0]
    rate = capacity * FLOOD_LOAD
    requests = [dataclasses.replace(flood, arrival=0.0, group=0, cold=False)
                for _ in range(int(capacity * FLOOD_BURST_S))]
    t = rng.expovariate(rate)
    while t < duration:
        requests.append(dataclasses.replace(flood, arrival=t, group=0, cold=False))
        t += rng.expovariate(rate)
    requests.append(dataclasses.replace(odd, arrival=FLOOD_ODD_AT, group=1, cold=True))
    requests.sort(key=lambda r: r.arrival)
    arrivals = dataclasses.replace(base.arrivals, kind="poisson", rate=rate, capacity_multiple=None)
    params = {**base.params, "flood_duration_s": duration, "rate": rate, "requests": len(requests)}
    return dataclasses.replace(base, requests=tuple(requests), arrivals=arrivals, params=params)


async def flood(session: Session, size: str, seed: int) -> dict[str, Any]:
    """Identical prompts (every one a rider of the last): a burst, then ``FLOOD_LOAD`` × capacity
    for 60 s and 200 s, and one different prompt at 0.5 s; prefix policy with aging, without
    aging, FCFS."""
    tokenizer = session.factory.tokenizer()
    base = make_trace("W1", size, seed=seed, tokenizer=tokenizer,
                      overrides={"groups": 2, "per_group": 1, **session.overrides})
    odd = next(r for r in base.requests if r.group != base.requests[0].group)
    await session.start(base.kv_cap_tokens)
    burst = dataclasses.replace(base, requests=(base.requests[0],) * 256)
    cap = await session.capacity(burst, arm="L")
    durations = (session.duration,) if session.duration else FLOOD_DURATIONS
    traces = {f"{d:g}s": _flood_trace(base, odd, cap, d) for d in durations}
    no_aging = {"min_aging_wait": 1e9}
    variants = []
    for name in traces:
        variants += [Variant(f"L {name}", "L", name), Variant(f"L no-aging {name}", "L", name, no_aging),
                     Variant(f"L fcfs {name}", "L", name, {"ordering": "fcfs"})]
    runs = await session.run(variants, traces)
    arms = summaries(variants, traces, runs, extra=_starvation_extra)
    checks = []
    for name in traces:
        m = arms[f"L {name}"]
        checks.append(check(f"L {name}: the odd request's wait <= max_wait_factor (2) x the flood's median",
                            m["max_cold_queue_wait_s"], _times(2, m["queue_wait_p50_s"])))
    if len(traces) == 2:
        a, b = (arms[f"L {n}"]["max_cold_queue_wait_s"] for n in traces)
        checks.append(check("L: the odd wait differs by <= 10% between the two floods",
                            abs(b - a) / a if a else None, 0.10))
    checks.append(check("every request accounted for", float(accounted(arms)), 1.0, "=="))
    return {"workload": "flood", "arms": arms, "checks": checks,
            "columns": [Column("max_cold_queue_wait_s", "odd wait", ".3f"),
                        Column("queue_wait_p50_s", "flood wait p50", ".3f"),
                        Column("queue_wait_p99_s", "wait p99", ".3f"),
                        Column("aged_dispatches", "aged", ".0f"), Column("req_per_s", "req/s", ".2f"),
                        Column("completed", "done", ".0f")],
            "panels": [["max_cold_queue_wait_s", "the odd request's queue wait (s)"],
                       ["queue_wait_p50_s", "flood median queue wait (s)"],
                       ["req_per_s", "throughput (req/s)"]],
            "params": {"load": FLOOD_LOAD, "burst_s": FLOOD_BURST_S, "odd_at_s": FLOOD_ODD_AT,
                       "durations_s": list(durations)}}


def _times(factor: float, value: float | None) -> float | None:
    return None if value is None else factor * value


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


# -- noisy neighbour (issue 4) -----------------------------------------------------------------

QUIET_TENANTS = 4
QUIET_SHARE = 0.15  # each quiet tenant's rate r, as a share of capacity: quiet total 0.6, noisy 1.5
NOISY_FACTOR = 10
NOISY_SHAPE = {"sim": {"groups": 4, "prefix_tokens": 2048, "suffix_tokens": 64, "max_tokens": 64},
               "gpu": {"groups": 4, "prefix_tokens": 2048, "suffix_tokens": 64, "max_tokens": 64},
               "cpu": {"groups": 2, "prefix_tokens": 512, "suffix_tokens": 32, "max_tokens": 8}}
NOISY_DURATION = {"sim": 20.0, "gpu": 20.0, "cpu": 20.0}
NOISY_PATIENCE = 10.0  # seconds the noisy tenant's clients wait before giving up (bounds its backlog)


def _noisy_extra(run: ArmRun) -> dict[str, Any]:
    quiet = sorted(r.first_output - r.arrival for r in run.records
                   if r.tenant != "noisy" and r.outcome == "completed" and r.first_output is not None)
    per = arm_metrics(run)["by_tenant"]
    noisy = per.get("noisy", {})
    worst = [m["ttft_p99_s"] for t, m in per.items() if t != "noisy" and m["ttft_p99_s"] is not None]
    return {"quiet_ttft_p99_s": quantile(quiet, 0.99), "quiet_ttft_p50_s": quantile(quiet, 0.5),
            "worst_quiet_tenant_ttft_p99_s": max(worst) if worst else None,
            "quiet_completed": len(quiet), "noisy_completed": noisy.get("completed"),
            "noisy_rejected": noisy.get("rejected"), "noisy_abandoned": noisy.get("abandoned"),
            "noisy_ttft_p99_s": noisy.get("ttft_p99_s")}


async def noisy(session: Session, size: str, seed: int) -> dict[str, Any]:
    """Four quiet tenants at r each (total 0.6× capacity), with and without a noisy tenant at
    10 r (1.5× capacity), each tenant with its own system prompts; B1 and L under tenant
    settings: none (fairness by fewest in flight alone), an in-flight share, a rate, both."""
    tokenizer = session.factory.tokenizer()
    shape = {**NOISY_SHAPE[size], **session.overrides}
    duration = session.duration or NOISY_DURATION[size]

    def tenant_trace(k: int, n: float) -> Trace:
        per_group = max(1, math.ceil(n / shape["groups"]))
        return make_trace("W1", size, seed=seed * 1000 + k, tokenizer=tokenizer,
                          overrides={**shape, "per_group": per_group})

    calibration = tenant_trace(999, 256 if size != "cpu" else 32)
    await session.start(None)
    cap = await session.capacity(calibration)
    r = QUIET_SHARE * cap
    quiet = [(f"quiet{k}", tenant_trace(k, 1.5 * r * duration + 20), r) for k in range(QUIET_TENANTS)]
    loud = ("noisy", tenant_trace(QUIET_TENANTS, 1.3 * NOISY_FACTOR * r * duration + 50), NOISY_FACTOR * r)
    traces = {"quiet": tenant_mix(quiet, duration), "with-noisy": tenant_mix([*quiet, loud], duration)}
    fair = cap / (QUIET_TENANTS + 1)  # a tenant's fair share of capacity, req/s
    settings: list[tuple[str, dict[str, Any]]] = [
        ("L none", {}),
        ("L share", {"default_tenant_limits": TenantLimits(max_in_flight_share=0.2)}),
        ("L rate", {"default_tenant_limits": TenantLimits(rate=fair)}),
        ("L rate+share", {"default_tenant_limits": TenantLimits(rate=fair, max_in_flight_share=0.2)}),
    ]
    # Diagnostic: fairness by fewest-in-flight with nothing overriding it (no sibling riders, no
    # aging, no queue inside the engine where the gateway cannot reorder).
    window = getattr(session.engine.engine, "max_num_seqs", None) if session.engine else None
    settings.append(("L fairness-only", {"ordering": "fcfs", "min_aging_wait": 1e9, "max_in_flight": window}))
    patience = {"noisy": NOISY_PATIENCE}
    variants = []
    for label, arm, gw in [("B1", "B1", {}), *((lab, "L", g) for lab, g in settings)]:
        variants += [Variant(f"{label} / quiet only", arm, "quiet", gw),
                     Variant(f"{label} / with noisy", arm, "with-noisy", gw, patience=patience)]
    runs = await session.run(variants, traces)
    arms = summaries(variants, traces, runs, extra=_noisy_extra)
    checks = []
    for label, _, _ in [("B1", "", {}), *((lab, "L", g) for lab, g in settings)]:
        alone, mixed = arms[f"{label} / quiet only"], arms[f"{label} / with noisy"]
        ratio = _ratio(mixed["quiet_ttft_p99_s"], alone["quiet_ttft_p99_s"])
        worst = _ratio(mixed["worst_quiet_tenant_ttft_p99_s"], alone["worst_quiet_tenant_ttft_p99_s"])
        alone["quiet_p99_ratio"] = mixed["quiet_p99_ratio"] = ratio
        checks.append(check(f"{label}: quiet tenants' p99 TTFT with noisy / without", ratio, 1.5,
                            note=f"worst single quiet tenant {_fmt(worst, '.2f')}x"))
    checks.append(check("every request accounted for", float(accounted(arms)), 1.0, "=="))
    return {"workload": "W1-tenants", "trace_params": {k: dict(t.params) for k, t in traces.items()},
            "arms": arms, "checks": checks,
            "columns": [Column("quiet_ttft_p50_s", "quiet p50", ".3f"),
                        Column("quiet_ttft_p99_s", "quiet p99", ".3f"),
                        Column("worst_quiet_tenant_ttft_p99_s", "worst tenant p99", ".3f"),
                        Column("quiet_p99_ratio", "p99 x", ".2f"),
                        Column("quiet_completed", "quiet done", ".0f"),
                        Column("noisy_completed", "noisy done", ".0f"),
                        Column("noisy_abandoned", "noisy gave up", ".0f"),
                        Column("noisy_ttft_p99_s", "noisy p99", ".2f"),
                        Column("req_per_s", "req/s", ".1f"), Column("hit_rate", "hit", ".3f")],
            "panels": [["quiet_ttft_p99_s", "quiet tenants' p99 TTFT (s)"],
                       ["noisy_completed", "noisy requests completed"],
                       ["req_per_s", "throughput (req/s)"]],
            "params": {"tenant_shape": shape, "duration_s": duration, "quiet_rate": r,
                       "noisy_rate": NOISY_FACTOR * r, "fair_share_rate": fair,
                       "noisy_patience_s": NOISY_PATIENCE}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- the registry ------------------------------------------------------------------------------

ScenarioFn = Callable[[Session, str, int], Awaitable[dict[str, Any]]]


def _registry() -> dict[str, ScenarioFn]:
    from .overload import no_reject, overload, overload_short, reject_micro

    return {"starvation": starvation, "flood": flood, "noisy": noisy, "overload": overload,
            "overload-short": overload_short, "no-reject": no_reject, "reject-cost": reject_micro}


SCENARIOS = ("starvation", "flood", "noisy", "overload", "overload-short", "no-reject", "reject-cost")


async def run_scenario(name: str, factory: EngineFactory, *, size: str, seed: int = 0, repeats: int = 3,
                       progress: bool = False, arm_timeout: float | None = None,
                       overrides: Mapping[str, Any] | None = None,
                       duration: float | None = None, verbose: bool = False) -> dict[str, Any]:
    """Runs scenario ``name`` and returns its JSON-ready result (``arms`` holds one summary per
    variant; ``checks`` the must-show checks with measured values and bounds). ``overrides``
    and ``duration`` change the scenario's traces (see :class:`Session`).

    Raises:
        ValueError: For an unknown scenario or ``repeats < 1``.
    """
    if name not in SCENARIOS or repeats < 1:
        raise ValueError(f"scenario must be one of {SCENARIOS} (got {name!r}) and repeats >= 1")
    wall0 = time.perf_counter()
    code = code_version()  # what this process imported, before anyone edits src/ under it
    session = Session(factory, repeats=repeats, progress=progress, arm_timeout=arm_timeout,
                      overrides=overrides, duration=duration, verbose=verbose)
    try:
        body = await _registry()[name](session, size, seed)
    finally:
        await session.close()
    body["columns"] = [dataclasses.asdict(c) for c in body["columns"]]
    params = {"size": size, "seed": seed, "repeats": repeats, "overrides": dict(overrides or {}),
              "duration_override_s": duration, **body.pop("params", {}),
              **session.notes, "code": code}
    return {"scenario": name, "engine": factory.name, "vllm_version": factory.vllm_version,
            **body, "params": params, "runtime_s": time.perf_counter() - wall0}
