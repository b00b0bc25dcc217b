"""What every scenario is made of: variants, table columns, checks and the session that runs them.

:mod:`benchmarks.scenarios` defines the scenarios and their registry; scenarios kept in modules
of their own (:mod:`benchmarks.overload`) build on this module, not on ``scenarios``, so the
registry can import them without an import cycle.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engines import EngineFactory, RunningEngine
from .harness import gateway_config, measure_capacity, progress_bar, run_arm, say
from .metrics import ArmRun, jsonable, summarize
from .workloads import Trace

__all__ = ["Column", "Session", "Variant", "accounted", "check", "summaries"]


@dataclass(frozen=True, slots=True)
class Variant:
    """One row of a scenario: an arm on one of the scenario's traces.

    Attributes:
        label: The row's name (unique in the scenario).
        arm: ``"B1"``, ``"L"`` or ``"O"``.
        trace: Key of the scenario's trace it runs.
        gateway: GatewayConfig fields of the L arm (over the defaults).
        retries: L only: times a refused client retries after ``retry_after``.
        patience: Per tenant, seconds after which a client stops waiting (see ``run_arm``).
    """

    label: str
    arm: str
    trace: str
    gateway: Mapping[str, Any] = field(default_factory=dict)
    retries: int = 0
    patience: Mapping[str | None, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: a metric of each variant's summary, its header and format."""

    key: str
    header: str
    fmt: str = ".3f"


def check(name: str, measured: float | None, bound: float | None, op: str = "<=",
          note: str = "") -> dict[str, Any]:
    """A must-show check: ``measured op bound``; ``holds`` is ``None`` when a side is missing."""
    holds = None
    if measured is not None and bound is not None:
        holds = {"<=": measured <= bound, ">=": measured >= bound, "==": measured == bound,
                 "<": measured < bound}[op]
    return {"check": name, "measured": measured, "op": op, "bound": bound, "holds": holds, "note": note}


class Session:
    """One engine (prefix caching on) for a scenario, and the steps every scenario takes on it.

    Args:
        factory: Starts the engine.
        repeats: Runs per variant.
        progress: Show a progress bar.
        arm_timeout: Real seconds one run may take.
        overrides: Shape fields applied to every trace the scenario generates (tiny test sizes,
            what-ifs); scenarios that size their traces themselves keep their ``per_group``.
        duration: Seconds of arrivals, for scenarios that run for a set time.
        verbose: Print each stage (engine start, unloaded TTFT, capacity, every run) with the
            seconds since the scenario began: for machines without a progress bar.
    """

    def __init__(self, factory: EngineFactory, *, repeats: int, progress: bool,
                 arm_timeout: float | None, overrides: Mapping[str, Any] | None = None,
                 duration: float | None = None, verbose: bool = False) -> None:
        self.factory = factory
        self.overrides = dict(overrides or {})
        self.duration = duration
        self.repeats = repeats
        self.progress = progress
        self.arm_timeout = arm_timeout
        self.engine: RunningEngine | None = None
        self.bar: Any = None
        self.notes: dict[str, Any] = {}
        self.verbose = verbose
        self._t0 = time.perf_counter()

    def log(self, message: str) -> None:
        """Prints ``message`` with the seconds since the scenario began, if ``verbose``."""
        if self.verbose:
            print(f"  [{time.perf_counter() - self._t0:7.1f} s] {message}", flush=True)

    async def start(self, kv_cap_tokens: int | None) -> RunningEngine:
        """Starts the scenario's engine (once)."""
        self.log("starting the engine")
        self.engine = await self.factory.start(caching=True, kv_cap_tokens=kv_cap_tokens)
        self.notes["engine_on"] = self.engine.describe()
        self.log("engine started")
        return self.engine

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
            self.engine = None
        if self.bar is not None:
            self.bar.close()

    async def capacity(self, trace: Trace, *, arm: str = "B1", gateway: Mapping[str, Any] | None = None,
                       name: str = "capacity_req_per_s", repeats: int | None = None) -> float:
        """``arm``'s req/s on a burst of ``trace`` (:func:`measure_capacity`), median over
        ``repeats`` (the session's by default), noted as ``name`` (the 10th-90th percentile rate
        beside it, for reference)."""
        assert self.engine is not None
        config = gateway_config(trace.workload, gateway) if arm == "L" else None
        values, steady = [], []
        for i in range(self.repeats if repeats is None else repeats):
            self.log(f"capacity burst {i + 1} ({len(trace.requests)} requests, {arm})")
            detail: dict[str, Any] = {}
            values.append(await measure_capacity(trace, self.engine, arm=arm, config=config,
                                                 timeout=self.arm_timeout, detail=detail))
            steady.append(detail["steady_req_per_s"])
        self.notes[name] = statistics.median(values)
        self.log(f"capacity {self.notes[name]:.3g} req/s")
        self.notes[f"{name}_repeats"] = values
        self.notes[f"{name}_burst_requests"] = len(trace.requests)
        self.notes[f"{name}_steady_10_90"] = statistics.median(steady)
        return self.notes[name]

    async def unloaded_ttft(self, trace: Trace) -> dict[str, Any]:
        """W0-style: the TTFT of one request of ``trace`` alone on an idle engine with an empty
        cache (cold), and of a sibling sent right after it (warm, its prefix cached); medians
        over repeats."""
        assert self.engine is not None
        first = trace.requests[0]
        sibling = next((r for r in trace.requests[1:] if r.group == first.group), first)
        pair = dataclasses.replace(trace, requests=(dataclasses.replace(first, arrival=0.0),
                                                    dataclasses.replace(sibling, arrival=0.0)),
                                   arrivals=dataclasses.replace(trace.arrivals, kind="closed", rate=None,
                                                                concurrency=1, capacity_multiple=None))
        cold, warm = [], []
        self.log("unloaded TTFT")
        for repeat in range(self.repeats):
            run = await run_arm("B1", -2 - repeat, pair, self.engine, timeout=self.arm_timeout)
            a, b = run.records
            if a.first_output is None or b.first_output is None:
                raise RuntimeError(f"unloaded TTFT run failed: {a.error or b.error}")
            cold.append(a.first_output - a.arrival)
            warm.append(b.first_output - b.arrival)
        out = {"cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
               "cold_repeats": cold, "warm_repeats": warm, "prompt_tokens": a.prompt_tokens,
               "max_tokens": first.max_tokens}
        self.notes["unloaded"] = out
        return out

    async def run(self, variants: Sequence[Variant], traces: Mapping[str, Trace]) -> dict[str, list[ArmRun]]:
        """Runs every variant ``repeats`` times, interleaved: all variants, then again."""
        assert self.engine is not None
        total = self.repeats * sum(len(traces[v.trace].requests) for v in variants)
        self.bar = progress_bar(total, f"scenario on {self.factory.name}", self.progress)
        runs: dict[str, list[ArmRun]] = {v.label: [] for v in variants}
        for repeat in range(self.repeats):
            for v in variants:
                say(self.bar, f"{v.label} repeat {repeat + 1}/{self.repeats}")
                self.log(f"{v.label} repeat {repeat + 1}/{self.repeats} "
                         f"({len(traces[v.trace].requests)} requests)")
                trace = traces[v.trace]
                config = gateway_config(trace.workload, v.gateway) if v.arm == "L" else None
                runs[v.label].append(await run_arm(
                    v.arm, repeat, trace, self.engine, config, timeout=self.arm_timeout,
                    on_done=self.bar.update if self.bar is not None else None,
                    retries=v.retries, patience=v.patience))
        return runs


def summaries(variants: Sequence[Variant], traces: Mapping[str, Trace], runs: Mapping[str, list[ArmRun]],
              *, slo_ttft_s: float | None = None,
              extra: Callable[[ArmRun], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Each variant's :func:`~benchmarks.metrics.summarize`, with its setup and, per run,
    ``aged_dispatches`` and whatever ``extra`` computes (medians; per repeat under ``repeats``)."""
    out: dict[str, Any] = {}
    for v in variants:
        summary = summarize(runs[v.label], slo_ttft_s)
        more = [{"aged_dispatches": r.gateway.get("aged_dispatches"), **(extra(r) if extra else {})}
                for r in runs[v.label]]
        for key in more[0]:
            values = [m[key] for m in more if m[key] is not None]
            summary[key] = statistics.median(values) if values else None
        for rep, m in zip(summary["repeats"], more, strict=True):
            rep.update(m)
        trace = traces[v.trace]
        summary["setup"] = {"arm": v.arm, "trace": v.trace, "rate": trace.params.get("rate"),
                            "requests": len(trace.requests), "retries": v.retries,
                            "patience": jsonable(v.patience),
                            "gateway_config": jsonable(gateway_config(trace.workload, v.gateway))
                            if v.arm == "L" else None}
        out[v.label] = summary
    return out


def accounted(arms: Mapping[str, Any]) -> bool:
    """Whether every repeat of every variant has ``completed + rejected + errored == offered``."""
    return all(r["completed"] + r["rejected"] + r["errored"] == r["offered"]
               for a in arms.values() for r in a["repeats"])
