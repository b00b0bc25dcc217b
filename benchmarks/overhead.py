"""M1: what the gateway itself costs per request, through an engine that does nothing.

Usage::

    python -m benchmarks.overhead --json benchmarks/results/M1-overhead.json \\
        --png benchmarks/results/M1-overhead.png

Method (issue 9). A :class:`~prefixgate.testing.NullEngine` (block size 16) answers every request
with one finished output at once; the tokenizer is the tiny Llama's (a Hugging Face fast
tokenizer, so ingress takes the same path as on vLLM: worker processes by default). Prompts of
1k, 2k, 8k and 32k tokens: 8 shared documents of mixed prose, code and JSON, each request one of
them with 3 random whitespace edits (W3's noise) plus a unique question, as text and as token
ids (the text's canonical tokens).

* **Cost** (``gateway_us``): requests one at a time, the main process and every ingress worker
  pinned to one core, in 3 rounds that interleave the variants (pool, inline, pre-tokenized, and
  an earlier commit's gateway with ``--before``); medians over rounds of each round's p50/p99.
  CPU time over the main process's threads and the workers' processes
  (``/proc/<pid>/schedstat``, nanoseconds) around each request, minus the CPU time the tokenizer
  took for that very request (timed around the call: in this process, or by the worker, which
  reports it). Whatever else a pool does, its cost is counted.
* **Stages** (``stages``, µs p50): the same requests with ingress inline and each stage timed
  (wall clock, one core): canonicalize, tokenize, keys (pack + chain + intern), enqueue+schedule
  (enqueue and the pump), dispatch (the pump's grant to the engine's ``generate`` call: the task
  switch included), stream (the engine's yield to the consumer), completion, and other (the
  rest: ``generate()``'s checks, the ticket, the client's loop).
* **Throughput** (``max_req_per_s_pretokenized``): 256 clients in a closed loop sending token-id
  prompts of each size for a few seconds on one core; completions per second.
* **Routing** (``routing_pretokenized``, issue 12): pre-tokenized prompts one at a time through a
  gateway over 1, 2, 16 and 64 NullEngines, placed by ``cost`` and by ``consistent_hash``, the
  same rounds; ``routing_us_p50`` is the excess over one engine (placement, the router, the
  replica's own queue).
* **A huge prompt** (``huge_prompt``): 100 ordinary 2k-token text requests sent at once, with and
  without a 2M-character prompt sent just before them; their p99 time to first output, median of
  9 interleaved repeats (with 3, one slow repeat of this VM moved the median by 10 ms), ingress in
  processes. Not pinned: the point is that the huge prompt's work happens elsewhere (a worker
  held still while ordinary prompts are prepared) and the loop stays responsive.

The cost is measured with ingress in worker processes (``gateway_us``: what the H200 host runs)
and inline (``inline``); pre-tokenized prompts are always keyed inline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "run_overhead"]

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "fixtures" / "tiny-llama"
SIZES = (1024, 2048, 8192, 32768)
STAGES = ("canonicalize", "tokenize", "keys", "enqueue+schedule", "dispatch", "stream", "completion",
          "other")


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _cpu_ns(pids: Sequence[int]) -> int:
    """CPU time of this process (all threads) plus that of ``pids`` (worker processes)."""
    total = time.process_time_ns()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def _pin(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def make_prompts(tokenizer: Any, size: int, n: int, seed: int = 0, groups: int = 8) -> list[str]:
    """``n`` prompts of about ``size`` tokens: ``groups`` shared documents with whitespace noise."""
    from .text import TextMaker, apply_whitespace_edits

    rng = random.Random(seed * 1_000_003 + size)
    maker = TextMaker(rng, tokenizer)
    docs = [maker.text(size - 32, "mixed") for _ in range(groups)]
    return [apply_whitespace_edits(docs[i % groups], rng, 3) + "\n\n" + maker.question(32)
            for i in range(n)]


class _StageTimer:
    """Wraps the gateway's stage functions (inline ingress) and times them per request."""

    def __init__(self, gateway: Any, engine: Any) -> None:
        import prefixgate.ingress as ingress_module

        self.samples: dict[str, float] = {}
        self.pump_end = 0.0
        self.yielded = 0.0
        self._module = ingress_module
        self._saved = (ingress_module.canonicalize_text, ingress_module.pack_tokens)
        ingress = gateway._ingress
        ingress_module.canonicalize_text = self._timed(ingress_module.canonicalize_text, "canonicalize")
        ingress_module.pack_tokens = self._timed(ingress_module.pack_tokens, "keys")
        ingress.encode = self._timed(ingress.encode, "tokenize")
        ingress.chains.chain = self._timed(ingress.chains.chain, "keys")  # type: ignore[method-assign]
        ingress._intern = self._timed(ingress._intern, "keys")  # type: ignore[method-assign]
        scheduler = gateway._scheduler
        scheduler.enqueue = self._timed(scheduler.enqueue, "enqueue+schedule")  # type: ignore[method-assign]
        dispatcher = gateway._dispatch
        pump = self._timed(dispatcher._pump_now, "enqueue+schedule")

        def pump_now() -> None:
            pump()
            self.pump_end = time.perf_counter()

        dispatcher._pump_now = pump_now
        dispatcher._on_complete = self._timed(dispatcher._on_complete, "completion")
        engine.on_generate = lambda request: self._add("dispatch", time.perf_counter() - self.pump_end)
        engine.on_output = lambda out: setattr(self, "yielded", time.perf_counter())

    def _add(self, stage: str, seconds: float) -> None:
        self.samples[stage] = self.samples.get(stage, 0.0) + seconds

    def _timed(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(stage, time.perf_counter() - t0)

        return timed

    def restore(self) -> None:
        self._module.canonicalize_text, self._module.pack_tokens = self._saved


async def _one(gateway: Any, prompt: Any, params: Any, timer: _StageTimer | None = None) -> None:
    async for _ in gateway.generate(prompt, params):
        if timer is not None:
            timer._add("stream", time.perf_counter() - timer.yielded)


def _engine(tokenizer: Any, events: bool = False) -> Any:
    from prefixgate.testing import NullEngine

    return NullEngine(tokenizer=tokenizer, block_size=16, cache_events=events)


async def _cost(tokenizer: Any, prompts: Sequence[Any], ingress: str, warmup: int, replicas: int = 1,
                placement: str = "cost", events: bool = False) -> dict[str, Any]:
    """Sequential requests; CPU per request over every process, minus what the tokenizer took
    for that very request (timed around it, in the main process or reported by the worker).
    With ``replicas`` > 1, a gateway over that many engines, placing by ``placement``. With
    ``events``, the engines publish every prompt's full blocks as stored (all new: the most the
    gateway's mirrors have to re-key) and the gateway follows them."""
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.testing import FakeSamplingParams

    engines = [_engine(tokenizer, events) for _ in range(replicas)]
    engine = engines[0] if replicas == 1 else engines
    params = FakeSamplingParams(max_tokens=1)
    async with Gateway(engine, GatewayConfig(ingress=ingress, placement=placement)) as gw:
        pool = gw._pool
        pids = [w.process.pid for w in getattr(pool, "_workers", ())]
        inline_ns = [0]
        encode = gw._ingress.encode

        def timed_encode(text: str, special: bool) -> Any:
            t0 = time.thread_time_ns()
            try:
                return encode(text, special)
            finally:
                inline_ns[0] += time.thread_time_ns() - t0

        gw._ingress.encode = timed_encode

        def tokenized() -> int:
            return inline_ns[0] + getattr(pool, "tokenize_ns", 0)

        for prompt in prompts[:warmup]:
            await _one(gw, prompt, params)
        costs, tokenize = [], []
        gc.collect()
        for prompt in prompts[warmup:]:
            c0, k0 = _cpu_ns(pids), tokenized()
            await _one(gw, prompt, params)
            k = tokenized() - k0
            costs.append((_cpu_ns(pids) - c0 - k) / 1000)
            tokenize.append(k / 1000)
        mode = type(pool).__name__ if pool is not None else "inline"
    return {"mode": mode, "us_p50": _pct(costs, 0.5), "us_p99": _pct(costs, 0.99),
            "us_mean": statistics.fmean(costs), "tokenize_us_p50": _pct(tokenize, 0.5)}


async def _stages(tokenizer: Any, prompts: Sequence[Any]) -> dict[str, float | None]:
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.testing import FakeSamplingParams

    engine = _engine(tokenizer)
    params = FakeSamplingParams(max_tokens=1)
    per_stage: dict[str, list[float]] = {s: [] for s in STAGES}
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw:
        for prompt in prompts[:5]:
            await _one(gw, prompt, params)
        timer = _StageTimer(gw, engine)
        try:
            for prompt in prompts:
                timer.samples = {}
                t0 = time.perf_counter()
                await _one(gw, prompt, params, timer)
                total = time.perf_counter() - t0
                for stage in STAGES[:-1]:
                    per_stage[stage].append(timer.samples.get(stage, 0.0) * 1e6)
                per_stage["other"].append((total - sum(timer.samples.values())) * 1e6)
        finally:
            timer.restore()
    return {s: _pct(v, 0.5) for s, v in per_stage.items()}


async def _throughput(tokenizer: Any, prompts: Sequence[Any], seconds: float,
                      clients: int = 256) -> float:
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.testing import FakeSamplingParams

    engine = _engine(tokenizer)
    params = FakeSamplingParams(max_tokens=1)
    done = 0
    async with Gateway(engine, GatewayConfig(max_in_flight=clients)) as gw:
        stop = time.perf_counter() + seconds
        feed: Iterator[Any] = iter(prompts * (1 + int(seconds * 100_000 / len(prompts))))

        async def client() -> None:
            nonlocal done
            for prompt in feed:
                if time.perf_counter() > stop:
                    return
                await _one(gw, prompt, params)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    return done / elapsed


async def _huge(tokenizer: Any, normal: Sequence[str], huge_chars: int, repeats: int) -> dict[str, Any]:
    from prefixgate import Gateway, GatewayConfig, PrefixgateError
    from prefixgate.testing import FakeSamplingParams

    params = FakeSamplingParams(max_tokens=1)
    huge = ("All work and no play makes a dull prompt. " * (huge_chars // 42 + 1))[:huge_chars]

    async def run(with_huge: bool) -> float:
        engine = _engine(tokenizer)
        async with Gateway(engine, GatewayConfig(ingress="processes")) as gw:
            for prompt in normal[:8]:  # warm the workers
                await _one(gw, prompt, params)
            ttft: list[float] = []

            async def timed(prompt: str) -> None:
                t0 = time.perf_counter()
                async for _ in gw.generate(prompt, params):
                    ttft.append(time.perf_counter() - t0)

            async def big() -> None:
                with contextlib.suppress(PrefixgateError):
                    await _one(gw, huge, params)

            extra = [asyncio.ensure_future(big())] if with_huge else []
            await asyncio.sleep(0)
            await asyncio.gather(*(timed(p) for p in normal))
            p99 = _pct(ttft, 0.99) or 0.0
            for task in extra:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        return p99

    without, with_ = [], []
    for _ in range(repeats):
        without.append(await run(False))
        with_.append(await run(True))
    base, loaded = statistics.median(without), statistics.median(with_)
    return {"huge_chars": huge_chars, "requests": len(normal), "repeats": repeats,
            "p99_ttft_ms_without": base * 1e3, "p99_ttft_ms_with": loaded * 1e3,
            "p99_increase_ms": (loaded - base) * 1e3,
            "repeats_ms": {"without": [x * 1e3 for x in without], "with": [x * 1e3 for x in with_]}}


async def _cost_before(package: str, tokenizer: Any, prompts: Sequence[str], warmup: int) -> dict[str, Any]:
    """The same cost measurement through an earlier commit's gateway (text prompts, its own
    inline ingress): ``package`` is that commit's ``src/prefixgate`` importable under a name. The
    tokenizer is timed around each call, as for the current gateway."""
    import importlib

    old = importlib.import_module(package)
    from prefixgate.testing import FakeSamplingParams

    spent = [0]

    class TimedTokenizer:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def encode(self, text: str, add_special_tokens: bool = True) -> Any:
            t0 = time.thread_time_ns()
            try:
                return self.inner.encode(text, add_special_tokens=add_special_tokens)
            finally:
                spent[0] += time.thread_time_ns() - t0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    engine = _engine(TimedTokenizer(tokenizer))
    params = FakeSamplingParams(max_tokens=1)
    gw = old.Gateway(engine, old.GatewayConfig())
    for prompt in prompts[:warmup]:
        await _one(gw, prompt, params)
    costs = []
    for prompt in prompts[warmup:]:
        c0, k0 = _cpu_ns(()), spent[0]
        await _one(gw, prompt, params)
        costs.append((_cpu_ns(()) - c0 - (spent[0] - k0)) / 1000)
    await gw.aclose()
    return {"package": package, "us_p50": _pct(costs, 0.5), "us_p99": _pct(costs, 0.99)}


def _rounds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each round's p50 and p99; every round kept."""
    out = dict(results[0])
    for key in ("us_p50", "us_p99"):
        out[key] = statistics.median(r[key] for r in results)
    out["rounds"] = [{k: r[k] for k in ("us_p50", "us_p99")} for r in results]
    return out


def run_overhead(*, sizes: Sequence[int] = SIZES, requests: Mapping[int, int] | None = None,
                 core: int | None = 0, throughput_s: float = 3.0, huge_chars: int = 2_000_000,
                 huge_repeats: int = 9, seed: int = 0, before: str | None = None,
                 rounds: int = 3, replicas: Sequence[int] = (2, 16, 64)) -> dict[str, Any]:
    """Runs M1 and returns the JSON-ready result (see the module docstring)."""
    from transformers import AutoTokenizer

    from prefixgate.canonicalize import canonicalize_text
    from prefixgate.ingress import fast_encoder

    from .harness import code_version

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    encode = fast_encoder(tokenizer)
    assert encode is not None, "the tiny Llama tokenizer is a Hugging Face fast tokenizer"
    counts = dict(requests or {1024: 200, 2048: 200, 8192: 80, 32768: 30})
    out: dict[str, Any] = {"benchmark": "M1", "block_size": 16, "engine": "NullEngine",
                           "tokenizer": "tests/fixtures/tiny-llama", "cpus": os.cpu_count(),
                           "pinned_core": core, "code": code_version(), "sizes": {}}
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    _pin(core)
    try:
        for size in sizes:
            n = counts.get(size, 100)
            texts = make_prompts(tokenizer, size, n + 10, seed)
            canon = [canonicalize_text(t).value for t in texts]
            ids = [encode(c, True) for c in canon]
            warm = 10
            # Rounds interleave the variants, so a machine that slows down mid-run slows all alike;
            # each figure is the median over rounds of the round's p50 (p99).
            runs: dict[str, list[dict[str, Any]]] = {"pool": [], "inline": [], "pre": [], "before": [],
                                                     "events": []}
            for _ in range(rounds):
                runs["pool"].append(asyncio.run(_cost(tokenizer, texts, "processes", warm)))
                runs["inline"].append(asyncio.run(_cost(tokenizer, texts, "inline", warm)))
                runs["pre"].append(asyncio.run(_cost(tokenizer, ids, "inline", warm)))
                runs["events"].append(asyncio.run(_cost(tokenizer, ids, "inline", warm, events=True)))
                if before is not None:
                    runs["before"].append(asyncio.run(_cost_before(before, tokenizer, texts, warm)))
            text_default, text_inline, pre, events = (_rounds(runs[k])
                                                      for k in ("pool", "inline", "pre", "events"))
            old = _rounds(runs["before"]) if runs["before"] else None
            # Routing (issue 12): pre-tokenized prompts through a gateway over N engines, placed
            # by each policy, in the same interleaved rounds' manner; the excess over one engine
            # is what placement and the router cost per request.
            routing: dict[str, Any] = {}
            if replicas:
                for placement in ("cost", "consistent_hash"):
                    per: dict[str, list[dict[str, Any]]] = {str(n): [] for n in (1, *replicas)}
                    for _ in range(rounds):
                        for n in (1, *replicas):
                            per[str(n)].append(asyncio.run(
                                _cost(tokenizer, ids, "inline", warm, n, placement)))
                    meds = {n: _rounds(r) for n, r in per.items()}
                    routing[placement] = {n: {"gateway_us_p50": m["us_p50"], "gateway_us_p99": m["us_p99"],
                                              "routing_us_p50": m["us_p50"] - meds["1"]["us_p50"]}
                                          for n, m in meds.items()}
            stages = asyncio.run(_stages(tokenizer, texts[warm:]))
            stages_pre = asyncio.run(_stages(tokenizer, ids[warm:]))
            rate = asyncio.run(_throughput(tokenizer, ids, throughput_s))
            entry = {
                "tokens_mean": statistics.fmean(len(i) for i in ids), "requests": n,
                "gateway_us_p50": text_default["us_p50"], "gateway_us_p99": text_default["us_p99"],
                "ingress_mode": text_default["mode"],
                "tokenize_us_p50": statistics.median(r["tokenize_us_p50"] for r in runs["inline"]),
                "stages": stages,
                "inline": {"gateway_us_p50": text_inline["us_p50"], "gateway_us_p99": text_inline["us_p99"],
                           "rounds": text_inline["rounds"]},
                "pool_rounds": text_default["rounds"],
                "pretokenized": {"gateway_us_p50": pre["us_p50"], "gateway_us_p99": pre["us_p99"],
                                 "stages": stages_pre, "max_req_per_s": rate},
                # The engine publishes every prompt's blocks as newly stored and the gateway's
                # mirror follows them (cache_events): the worst case, a prompt never seen.
                "cache_events_pretokenized": {"gateway_us_p50": events["us_p50"],
                                              "gateway_us_p99": events["us_p99"],
                                              "events_us_p50": events["us_p50"] - pre["us_p50"],
                                              "rounds": events["rounds"]},
            }
            if old is not None:
                entry["before"] = old
            if routing:
                entry["routing_pretokenized"] = routing
            out["sizes"][str(size)] = entry
            print(_row(size, entry), flush=True)
        if "2048" in out["sizes"]:
            out["max_req_per_s_pretokenized"] = out["sizes"]["2048"]["pretokenized"]["max_req_per_s"]
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
    if huge_repeats:
        normal = make_prompts(tokenizer, 2048, 100, seed + 1)
        out["huge_prompt"] = asyncio.run(_huge(tokenizer, normal, huge_chars, huge_repeats))
    return out


def _row(size: int, e: Mapping[str, Any]) -> str:
    st = e["stages"]
    return (f"{size:>6} tok  gateway p50 {e['gateway_us_p50']:7.1f} µs  p99 {e['gateway_us_p99']:7.1f}  "
            f"({e['ingress_mode']}; inline {e['inline']['gateway_us_p50']:.1f})  "
            f"tokenize {e['tokenize_us_p50']:8.1f}  "
            f"pre-tokenized {e['pretokenized']['gateway_us_p50']:6.1f} µs, "
            f"{e['pretokenized']['max_req_per_s']:7.0f} req/s  | "
            + " ".join(f"{k} {v:.1f}" for k, v in st.items() if v is not None))


def format_table(result: Mapping[str, Any]) -> str:
    """The result as a text table."""
    lines = [f"M1 overhead: NullEngine, block 16, tiny-Llama tokenizer, {result['cpus']} CPUs, "
             f"pinned to core {result['pinned_core']}; µs per request (CPU over all processes, "
             "minus the tokenizer's)"]
    head = (f"{'tokens':>7}{'mode':>20}{'gw p50':>9}{'gw p99':>9}{'inline':>9}{'tokenize':>10}"
            f"{'pre p50':>9}{'pre p99':>9}{'req/s pre':>11}")
    lines += [head, "-" * len(head)]
    for size, e in result["sizes"].items():
        pre = e["pretokenized"]
        lines.append(f"{size:>7}{e['ingress_mode']:>20}{e['gateway_us_p50']:9.1f}{e['gateway_us_p99']:9.1f}"
                     f"{e['inline']['gateway_us_p50']:9.1f}{e['tokenize_us_p50']:10.1f}"
                     f"{pre['gateway_us_p50']:9.1f}{pre['gateway_us_p99']:9.1f}{pre['max_req_per_s']:11.0f}")
    befores = {size: e["before"] for size, e in result["sizes"].items() if "before" in e}
    for size, b in befores.items():
        lines.append(f"{size:>7}  before ({b['package']}): gw p50 {b['us_p50']:.1f} µs, "
                     f"p99 {b['us_p99']:.1f} µs")
    lines.append("stages (inline, text; µs p50): " + ", ".join(STAGES))
    for size, e in result["sizes"].items():
        lines.append(f"{size:>7}  " + "  ".join(f"{e['stages'][s] or 0:7.1f}" for s in STAGES)
                     + "   | pre-tokenized: "
                     + " ".join(f"{e['pretokenized']['stages'][s] or 0:.1f}" for s in STAGES))
    routed = {size: e["routing_pretokenized"] for size, e in result["sizes"].items()
              if "routing_pretokenized" in e}
    for size, by_policy in routed.items():
        for placement, per in by_policy.items():
            lines.append(f"{size:>7}  routing ({placement}, pre-tokenized; µs p50, over one engine): "
                         + ", ".join(f"{n} replicas {r['gateway_us_p50']:.1f} ({r['routing_us_p50']:+.1f})"
                                     for n, r in per.items()))
    for size, e in result["sizes"].items():
        ev = e.get("cache_events_pretokenized")
        if ev:
            lines.append(f"{size:>7}  following cache events (pre-tokenized, every block new; µs p50): "
                         f"{ev['gateway_us_p50']:.1f} ({ev['events_us_p50']:+.1f} over none)")
    huge = result.get("huge_prompt")
    if huge:
        lines.append(f"huge prompt ({huge['huge_chars']:,} chars) among {huge['requests']} requests: p99 "
                     f"time to first output {huge['p99_ttft_ms_without']:.1f} ms -> "
                     f"{huge['p99_ttft_ms_with']:.1f} ms (+{huge['p99_increase_ms']:.1f} ms), "
                     f"median of {huge['repeats']}")
    return "\n".join(lines)


def plot(result: Mapping[str, Any], path: Path) -> None:
    """Stacked stage costs per size (inline), with the pooled total beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(sizes)
    for stage in STAGES:
        if stage == "tokenize":
            continue
        values = [result["sizes"][s]["stages"][stage] or 0.0 for s in sizes]
        ax.bar(sizes, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(sizes, [result["sizes"][s]["gateway_us_p50"] for s in sizes], "ko-", label="total (default pool)")
    ax.set_title("gateway cost per request, tokenization excluded (µs)")
    ax.set_xlabel("prompt tokens")
    ax.legend(fontsize=7)
    bx.bar(sizes, [result["sizes"][s]["pretokenized"]["max_req_per_s"] for s in sizes], color="#1e88e5")
    bx.set_title("max req/s, pre-tokenized, one core")
    bx.set_xlabel("prompt tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--requests", type=int, help="requests per size (default 200/200/80/30)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the cost measurement")
    p.add_argument("--core", type=int, default=0, help="CPU core to pin to (-1: no pinning)")
    p.add_argument("--throughput-seconds", type=float, default=3.0)
    p.add_argument("--huge-chars", type=int, default=2_000_000)
    p.add_argument("--huge-repeats", type=int, default=9, help="0 skips the huge-prompt check")
    p.add_argument("--replicas", default="2,16,64",
                   help="replica counts for the routing cost (issue 12); '' skips it")
    p.add_argument("--before", metavar="DIR/PACKAGE",
                   help="also measure an earlier commit's gateway: its src/prefixgate as a package dir")
    args = p.parse_args(argv)
    before = None
    if args.before:
        path = Path(args.before).resolve()
        sys.path.insert(0, str(path.parent))
        before = path.name
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = [int(s) for s in args.sizes.split(",")]
    requests = {s: args.requests for s in sizes} if args.requests else None
    result = run_overhead(sizes=sizes, requests=requests, core=None if args.core < 0 else args.core,
                          throughput_s=args.throughput_seconds, huge_chars=args.huge_chars,
                          huge_repeats=args.huge_repeats, before=before, rounds=args.rounds,
                          replicas=[int(n) for n in args.replicas.split(",") if n])
    print(format_table(result), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png is not None:
        plot(result, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
