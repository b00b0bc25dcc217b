"""Per-request records, per-run metrics, medians over repeats and the headline ratios.

Times are on the engine's clock (virtual on the simulator). TTFT and E2E run from each request's
*arrival*; quantiles are nearest-rank; ``completed + rejected + errored == offered`` for every run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .ceiling import Ceiling, kappa

__all__ = ["METRICS", "TENANT_METRICS", "ArmRun", "Refusal", "RequestRecord", "arm_metrics", "jsonable",
           "quantile", "ratios", "summarize"]

METRICS = ("req_per_s", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
           "hit_rate", "prompt_tokens", "cached_tokens", "prefill_tokens", "preemptions", "offered",
           "completed", "rejected", "errored", "max_queue_wait_s", "makespan_s",
           "queue_wait_p50_s", "queue_wait_p99_s", "max_cold_queue_wait_s", "cold_ttft_p99_s",
           "slo_met", "goodput_req_per_s", "goodput_window_req_per_s", "window_s", "abandoned")
TENANT_METRICS = ("offered", "completed", "rejected", "errored", "abandoned", "ttft_p50_s", "ttft_p99_s")


@dataclass(frozen=True, slots=True)
class Refusal:
    """One retryable refusal (``Overloaded``, ``QueueFull``) as a client saw it.

    Attributes:
        at: Engine-clock time of the refusal.
        retry_after: The refusal's ``retry_after`` (seconds).
        reason: The refusal's ``reason``.
        ingress_s: Wall seconds of ``Gateway.generate()`` (canonicalize, tokenize, key).
        decision_s: Wall seconds from the first ``__anext__`` of the stream to the refusal
            (rate limit, load check: the reject decision itself).
    """

    at: float
    retry_after: float
    reason: str
    ingress_s: float
    decision_s: float



@dataclass(slots=True)
class RequestRecord:
    """What happened to one request in one arm run (times on the engine's clock).

    Attributes:
        arrival: When the request was sent (its arrival slot).
        first_output: When its first output came back.
        finished: When its last output came back.
        prompt_tokens: Prompt length as the engine saw it.
        cached_tokens: The engine's ``num_cached_tokens``.
        output_tokens: Tokens generated.
        outcome: ``"completed"``, ``"rejected"`` (refused or evicted by the gateway) or
            ``"errored"``; ``None`` while running.
        queue_wait: Time in the gateway's queue (L only).
        error: The exception, for errored requests.
        tenant: The request's tenant.
        cold: Whether the request is cache-cold by construction (W6).
        refusals: Every retryable refusal the client got, in order (L only; more than one
            when the client retries).
        attempts: Submissions made (1 + retries).
        abandoned: The client gave up waiting (counted as ``errored``).
    """

    arrival: float
    first_output: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    outcome: str | None = None
    queue_wait: float | None = None
    error: str | None = None
    tenant: str | None = None
    cold: bool = False
    refusals: list[Refusal] = field(default_factory=list)
    attempts: int = 1
    abandoned: bool = False


@dataclass(frozen=True, slots=True)
class ArmRun:
    """One arm run: its per-request records and the engine counters around it.

    Attributes:
        arm: ``"B0"``, ``"B1"``, ``"L"`` or ``"O"``.
        repeat: Repeat index.
        start: Engine-clock time the run started.
        records: One record per offered request, in submission order.
        preemptions: Engine preemptions during the run.
        gateway: The L arm's gateway statistics (JSON-ready), else empty.
        timed_out: Whether the run hit its timeout (its unfinished requests count as errored).
    """

    arm: str
    repeat: int
    start: float
    records: tuple[RequestRecord, ...]
    preemptions: int
    gateway: Mapping[str, Any] = field(default_factory=dict)
    timed_out: bool = False


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of an ascending sequence; ``None`` if empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _ttft(r: RequestRecord) -> float | None:
    return r.first_output - r.arrival if r.first_output is not None else None


def _tenant_metrics(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tenant in sorted({r.tenant for r in records if r.tenant is not None}):
        mine = [r for r in records if r.tenant == tenant]
        ttft = sorted(t for r in mine if r.outcome == "completed" and (t := _ttft(r)) is not None)
        out[tenant] = {"offered": len(mine), "completed": sum(r.outcome == "completed" for r in mine),
                       "rejected": sum(r.outcome == "rejected" for r in mine),
                       "errored": sum(r.outcome == "errored" for r in mine),
                       "abandoned": sum(r.abandoned for r in mine),
                       "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99)}
    return out


def arm_metrics(run: ArmRun, slo_ttft_s: float | None = None) -> dict[str, Any]:
    """The metrics of one arm run.

    ``req_per_s`` and ``output_tok_per_s`` are completed work over the makespan (start of the run
    to the last request's end); TTFT and E2E run from each request's *arrival* (quantiles are
    nearest-rank); ``hit_rate`` is Σ cached / Σ prompt tokens and ``prefill_tokens`` Σ (prompt −
    cached), over completed requests; ``completed + rejected + errored == offered``. Queue waits
    (L only) are of dispatched requests; ``max_cold_queue_wait_s`` is over the cache-cold ones.
    With ``slo_ttft_s``, ``slo_met`` counts completed requests whose TTFT met it,
    ``goodput_req_per_s`` is that over the makespan and ``goodput_window_req_per_s`` over the
    arrival window (first to last arrival; ``window_s``). ``by_tenant`` appears when requests
    name tenants.
    """
    done = [r for r in run.records if r.outcome == "completed"]
    ends = [r.finished for r in run.records if r.finished is not None]
    makespan = max(ends) - run.start if ends else 0.0
    ttft = sorted(r.first_output - r.arrival for r in done if r.first_output is not None)
    e2e = sorted(r.finished - r.arrival for r in done if r.finished is not None)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    waits = [r.queue_wait for r in run.records if r.queue_wait is not None]
    sorted_waits = sorted(waits)
    cold_waits = [r.queue_wait for r in run.records if r.cold and r.queue_wait is not None]
    cold_ttft = sorted(t for r in done if r.cold and (t := _ttft(r)) is not None)
    arrivals = [r.arrival for r in run.records]
    window = max(arrivals) - run.start if arrivals else 0.0
    slo_met = None if slo_ttft_s is None else sum(t <= slo_ttft_s for t in ttft)
    extra: dict[str, Any] = {
        "queue_wait_p50_s": quantile(sorted_waits, 0.5), "queue_wait_p99_s": quantile(sorted_waits, 0.99),
        "max_cold_queue_wait_s": max(cold_waits) if cold_waits else None,
        "cold_ttft_p99_s": quantile(cold_ttft, 0.99), "slo_met": slo_met,
        "goodput_req_per_s": slo_met / makespan if slo_met is not None and makespan > 0 else None,
        "goodput_window_req_per_s": slo_met / window if slo_met is not None and window > 0 else None,
        "window_s": window, "abandoned": sum(r.abandoned for r in run.records),
    }
    if any(r.tenant is not None for r in run.records):
        extra["by_tenant"] = _tenant_metrics(run.records)
    return {
        "req_per_s": len(done) / makespan if makespan > 0 else None,
        "output_tok_per_s": sum(r.output_tokens for r in done) / makespan if makespan > 0 else None,
        "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
        "e2e_p50_s": quantile(e2e, 0.5), "e2e_p99_s": quantile(e2e, 0.99),
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached,
        "preemptions": run.preemptions,
        "offered": len(run.records), "completed": len(done),
        "rejected": sum(r.outcome == "rejected" for r in run.records),
        "errored": sum(r.outcome == "errored" for r in run.records),
        "max_queue_wait_s": max(waits) if waits else None,
        "makespan_s": makespan,
        **extra,
    }


def _median(values: Sequence[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: Sequence[ArmRun], slo_ttft_s: float | None = None) -> dict[str, Any]:
    """Median over repeats of each metric (per tenant too), plus the per-repeat values under
    ``"repeats"``."""
    per = [arm_metrics(r, slo_ttft_s) for r in runs]
    out: dict[str, Any] = {m: _median([p[m] for p in per]) for m in METRICS}
    tenants = sorted({t for p in per for t in p.get("by_tenant", {})})
    if tenants:
        out["by_tenant"] = {t: {m: _median([p["by_tenant"].get(t, {}).get(m) for p in per])
                                for m in TENANT_METRICS} for t in tenants}
    errors = [rec.error for r in runs for rec in r.records if rec.error]
    if errors:
        out["errors_sample"] = sorted(set(errors))[:5]
    out["timed_out"] = sum(r.timed_out for r in runs)
    if any(r.gateway for r in runs):
        out["gateway"] = [dict(r.gateway) for r in runs]
    out["repeats"] = per
    return out



def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(arms: Mapping[str, Mapping[str, Any]], ceil: Ceiling) -> dict[str, Any]:
    """Headline ratios between arms' medians; ``None`` where an arm is missing."""
    def get(arm: str, metric: str) -> Any:
        return arms.get(arm, {}).get(metric)

    out: dict[str, Any] = {
        "L_over_B1_req_per_s": _ratio(get("L", "req_per_s"), get("B1", "req_per_s")),
        "O_over_B1_req_per_s": _ratio(get("O", "req_per_s"), get("B1", "req_per_s")),
        "L_over_O_req_per_s": _ratio(get("L", "req_per_s"), get("O", "req_per_s")),
        "B1_over_B0_req_per_s": _ratio(get("B1", "req_per_s"), get("B0", "req_per_s")),
        "L_over_B1_ttft_p99": _ratio(get("L", "ttft_p99_s"), get("B1", "ttft_p99_s")),
        "L_hit_over_ceiling": _ratio(get("L", "hit_rate"), ceil.hit_rate),
        "kappa": None, "kappa_O": None, "kappa_repeats": None,
    }
    b1, lo, oo = get("B1", "prefill_tokens"), get("L", "prefill_tokens"), get("O", "prefill_tokens")
    if b1 is not None and lo is not None:
        out["kappa"] = kappa(b1, lo, ceil.min_prefill_tokens)
        reps = zip(arms["B1"]["repeats"], arms["L"]["repeats"], strict=False)
        out["kappa_repeats"] = [kappa(x["prefill_tokens"], y["prefill_tokens"], ceil.min_prefill_tokens)
                                for x, y in reps]
    if b1 is not None and oo is not None:
        out["kappa_O"] = kappa(b1, oo, ceil.min_prefill_tokens)
    return out



def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (dataclasses and mappings to dicts, sets to sorted lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)

