"""prefixgate vs bare vLLM on a whitespace-noisy shared-prefix workload (CPU, tiny Llama).

Run with ``make demo`` (it sets everything up). The workload: 8 long shared system prompts, 8
questions each; every request after a group's first carries 3 random whitespace edits inside the
shared part (a CRLF, trailing spaces, a doubled space, a tab), as real clients produce. The same
requests go once straight into vLLM and once through prefixgate, on one embedded engine, arms
interleaved over repeats; the table shows medians.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # over the Makefile's WARNING: the table is the output
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # torch noise in vLLM's workers
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "tiny-llama"
WORDS = ("system user answer document context retrieval cache prefix token block model server "
         "request response latency memory queue engine tenant policy schedule batch stream output "
         "the of and to in is that for it as was with be by on not this are or from at which").split()
GROUPS, PER_GROUP, SYSTEM_LINES, MAX_TOKENS, REPEATS = 8, 8, 80, 16, 3


@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """Sends this process's stderr (file descriptor 2, which vLLM's engine process inherits, and
    its C++ warnings use) to ``path`` meanwhile, so the demo prints its table without vLLM's log
    noise above it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def make_workload(seed: int = 0) -> tuple[list[str], list[str]]:
    """Returns (noisy prompts in arrival order, the same prompts without the noise)."""
    rng = random.Random(seed)
    line = lambda n=12: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    systems = ["\n".join(line() for _ in range(SYSTEM_LINES)) for _ in range(GROUPS)]
    clean, noisy = [], []
    for i in range(GROUPS * PER_GROUP):
        g = i % GROUPS
        question = f"\n\nQuestion {i}: {line(rng.randint(4, 20))}?"
        lines = systems[g].split("\n")
        if i >= GROUPS:  # a group's first request is clean; the rest carry client noise
            for _ in range(3):
                k = rng.randrange(len(lines))
                lines[k] = rng.choice([lines[k] + "\r", lines[k] + "  ",
                                       lines[k].replace(" ", "  ", 1), lines[k].replace(" ", "\t", 1)])
        clean.append(systems[g] + question)
        noisy.append("\n".join(lines) + question)
    return noisy, clean


def ceiling_hit_rate(token_lists: list[list[int]], block: int) -> float:
    """The best possible token hit rate: b·⌊min(LCP, L−1)/b⌋ against all earlier prompts."""
    hits = 0
    for i, p in enumerate(token_lists):
        lcp = max((next((k for k, (x, y) in enumerate(zip(p, q, strict=False)) if x != y),
                        min(len(p), len(q))) for q in token_lists[:i]), default=0)
        hits += block * (min(lcp, len(p) - 1) // block)
    return hits / sum(len(p) for p in token_lists)


async def bare_vllm(engine, prompts, sp, tag):
    """What users run today: every prompt as sent, straight into vLLM, all at once."""
    from prefixgate import EngineRequest

    async def one(i, prompt):
        ids = engine.tokenizer.encode(prompt)
        first, cached = None, 0
        async for out in engine.generate(EngineRequest(f"{tag}-{i}", ids, sp)):
            first = first or time.perf_counter()
            cached = out.num_cached_tokens
        return first, cached, len(ids)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    ttft = [f - t0 for f, _, _ in results]
    return len(prompts) / wall, sum(c for _, c, _ in results) / sum(n for _, _, n in results), ttft


async def through_prefixgate(engine, prompts, sp, tag):
    """The same prompts, at the same moment, through a prefixgate Gateway."""
    from prefixgate import Gateway, GatewayConfig

    # The shared part is a system prompt the user wrote: the "prose" rule set also undoes tabs and
    # trailing spaces before a continuing line, which the default ("safe") keeps as possible TSV
    # columns and Markdown hard breaks.
    async with Gateway.for_vllm(engine, GatewayConfig(canonicalize="prose")) as gw:
        async def one(i, prompt):
            first = None
            async for _ in gw.generate(prompt, sp, request_id=f"{tag}-{i}"):
                first = first or time.perf_counter()
            return first

        t0 = time.perf_counter()
        firsts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        stats = gw.statistics()
    return len(prompts) / wall, stats.hit_rate, [f - t0 for f in firsts], stats


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    log = os.path.join(tempfile.gettempdir(), "prefixgate-demo-vllm.log")
    print(f"starting vLLM on CPU with the tiny Llama at {MODEL.relative_to(ROOT)} "
          f"(its log: {log}) …", flush=True)
    with stderr_to(log):  # vLLM's import and engine print warnings; the table goes to stdout
        await run()


async def run() -> None:
    from vllm import AsyncEngineArgs, SamplingParams

    from prefixgate import VllmEngine
    from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

    engine = VllmEngine.from_engine_args(AsyncEngineArgs(
        model=str(MODEL), load_format="dummy", enable_prefix_caching=True, max_model_len=4096,
        enforce_eager=True, seed=0, disable_log_stats=False,
        # On an x86 host that reports AMX, vLLM's CPU worker needs it asked for (see the module).
        worker_extension_cls=AMX_WORKER_EXTENSION))
    try:
        import vllm

        noisy, clean = make_workload()
        ceiling = ceiling_hit_rate([engine.tokenizer.encode(p) for p in clean], engine.block_size)
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        await bare_vllm(engine, noisy[:4], sp, "warmup")
        arms: dict[str, list] = {"bare vLLM": [], "prefixgate": []}
        canon = 0
        for r in range(REPEATS):  # interleaved, each on a cold cache
            await engine.vllm_engine.reset_prefix_cache()
            arms["bare vLLM"].append(await bare_vllm(engine, noisy, sp, f"bare{r}"))
            await engine.vllm_engine.reset_prefix_cache()
            *res, stats = await through_prefixgate(engine, noisy, sp, f"pg{r}")
            arms["prefixgate"].append(tuple(res))
            canon = stats.canonicalized

        def row(runs):
            return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                    statistics.median(pct(r[2], 0.5) for r in runs),
                    statistics.median(pct(r[2], 0.99) for r in runs))

        bare, pg = row(arms["bare vLLM"]), row(arms["prefixgate"])
        print(f"\nvLLM {vllm.__version__} (CPU), block size {engine.block_size}; "
              f"{len(noisy)} requests = {GROUPS} shared prompts × {PER_GROUP}, "
              f"{MAX_TOKENS} output tokens, all submitted at once; median of {REPEATS} repeats\n")
        print(f"{'':<12}{'req/s':>9}{'hit rate':>10}{'of ceiling':>12}{'TTFT p50':>10}{'TTFT p99':>10}")
        for name, (rps, hit, p50, p99) in (("bare vLLM", bare), ("prefixgate", pg)):
            print(f"{name:<12}{rps:>9.1f}{hit:>10.3f}{hit / ceiling:>12.2f}{p50:>9.2f}s{p99:>9.2f}s")
        print(f"{'ratio':<12}{pg[0] / bare[0]:>8.2f}×{pg[1] / max(bare[1], 1e-9):>9.1f}×"
              f"{'':>12}{pg[2] / bare[2]:>9.2f}×{pg[3] / bare[3]:>9.2f}×")
        print(f"\nceiling (hit rate of the clean prompts, block {engine.block_size}): {ceiling:.3f}; "
              f"prefixgate canonicalized {canon} of {len(noisy)} prompts.")
        print("Why: one stray space or CRLF inside a shared prompt changes every block hash after "
              "it, so bare vLLM recomputes the prefix; prefixgate canonicalizes whitespace first, "
              "so the noisy prompts share the cached blocks again.")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
