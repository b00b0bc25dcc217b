"""W5 in the simulator: placement across replicas, against round robin, at 4 to 64 replicas.

Usage::

    python -m benchmarks.routing --replicas 4 16 64 --repeats 3 \\
        --json benchmarks/results/W5-sim.json --png benchmarks/results/W5-sim.png

Each case is ``N`` SimEngine replicas (the H200 Llama-3.2-1B profile, ``gpu-1b``), one virtual
clock, and the W5 trace scaled to them: ``16 N`` prefix groups (``--prefix-tokens`` each, a
64-token question, 32 output tokens), 8 requests a group on average, Zipf (α = 1.1) or even
popularity, all sent at once (a burst, shuffled). Each replica's KV is capped at
``--kv-share`` × (the working set / N): the working set (every group's prefix) is several times
what one replica holds, and a single cache of all the replicas' KV would hold it all.

Arms (the same trace; each on fresh engines):

* ``RR``: bare engines, request *i* sent to replica *i* mod N (each engine queues its own).
* ``L``: one prefixgate gateway over the N engines, its default placement (``cost``: by the
  predicted hits and the work placed ahead, a new prefix by the ring).
* ``L ring``: the same with ``placement="consistent_hash"`` (bounded loads, ε 0.1, margin 1).
* ``L rr``: the gateway with ``placement="round_robin"``: its queueing without placement.

Two independent gateways (``run_pair``; the Zipf cases): both over the same N engines, each
sent every other request of the burst, placing by ``L``'s and by ``L ring``'s policy with no
state shared: how alike their placements of each prefix group are (the overlap of their shares
per replica), and the pair's hit rate against one gateway's given the whole trace.

Metrics: hit rate (engine-reported cached tokens over prompt tokens), computed prefill tokens,
req/s (requests over the virtual makespan), and load imbalance: each replica's time-averaged
number of requests in flight on it (placed and not finished: by Little's law the sum of their
times in flight over the makespan, which is sampling it continuously), max over mean. The
ceiling is ``benchmarks.ceiling``'s H* (an unbounded cache in the best order; here the replicas'
KV together holds the working set, so it is also the single big cache's).

The simulator's clock charges the engines' steps (the fitted ``gpu-1b`` step model) but not the
gateway's own CPU: one event loop in front of many replicas is a cost this benchmark does not
show (the M1 overhead benchmark measures it per request).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
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


def _trace(replicas: int, popularity: str, prefix_tokens: int, seed: int, tokenizer: Any) -> Any:
    from .workloads import make_trace

    return make_trace("W5", "sim", seed=seed, tokenizer=tokenizer, overrides={
        "groups": 16 * replicas, "per_group": 8, "prefix_tokens": prefix_tokens, "suffix_tokens": 64,
        "max_tokens": 32, "popularity": popularity, "replicas": replicas})


async def run_arm(arm: str, trace: Any, replicas: int, kv_tokens: int, tokenizer: Any,
                  seed: int = 0) -> dict[str, Any]:
    """One arm of one case on fresh engines; its metrics."""
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.engine import EngineRequest
    from prefixgate.placement import make_placement
    from prefixgate.sim import SimClock, SimEngine, StepTimeModel

    from .engines import SIM_PROFILES

    p = SIM_PROFILES["gpu-1b"]
    clock = SimClock()
    engines = [SimEngine(block_size=p.block_size, num_blocks=math.ceil(kv_tokens / p.block_size),
                         max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                         max_model_len=p.max_model_len,
                         step_time=StepTimeModel(*p.step_time, overlap=p.overlap), tokenizer=tokenizer,
                         clock=clock) for _ in range(replicas)]
    requests = list(enumerate(trace.requests))
    random.Random(seed).shuffle(requests)
    start = clock.now()
    spans: dict[int, list[float]] = {i: [] for i in range(replicas)}
    results: list[Any] = []
    wall0 = time.perf_counter()

    if arm == "RR":
        params = engines[0].default_sampling_params

        async def bare(n: int, i: int, req: Any) -> None:
            engine = engines[n % replicas]
            ids = tokenizer.encode(req.prompt)
            sp = type(params())(max_tokens=req.max_tokens)
            last = None
            async for out in engine.generate(EngineRequest(f"rr-{i}", ids, sp)):
                last = out
            spans[n % replicas].append(clock.now() - start)
            results.append(last)

        await asyncio.gather(*(bare(n, i, req) for n, (i, req) in enumerate(requests)))
    else:
        recorder = _Recorder(make_placement(PLACEMENT[arm]))
        async with Gateway(engines, GatewayConfig(placement=recorder), clock=clock) as gw:
            sp_type = type(engines[0].default_sampling_params())

            async def through(i: int, req: Any) -> None:
                rid = f"{arm}-{i}"
                last = None
                async for out in gw.generate(req.prompt, sp_type(max_tokens=req.max_tokens), request_id=rid):
                    last = out
                spans[recorder.placed[rid]].append(clock.now() - start)
                results.append(last)

            await asyncio.gather(*(through(i, req) for i, req in requests))
    makespan = clock.now() - start
    prompt = sum(len(r.prompt_token_ids) for r in results)
    cached = sum(int(r.num_cached_tokens or 0) for r in results)
    load = [sum(s) / makespan for s in spans.values()]  # all arrive at 0: time in flight = finish
    mean = statistics.fmean(load)
    return {"arm": arm, "requests": len(results), "req_per_s": len(results) / makespan,
            "makespan_s": makespan,
            "hit_rate": cached / prompt, "prompt_tokens": prompt, "computed_prefill_tokens": prompt - cached,
            "imbalance": max(load) / mean if mean else None, "placed": [len(s) for s in spans.values()],
            "wall_s": time.perf_counter() - wall0}


async def run_pair(trace: Any, replicas: int, kv_tokens: int, tokenizer: Any, placement: str = "cost",
                   seed: int = 0) -> dict[str, Any]:
    """Two independent gateways over the same engines, each sent every other request of the
    (shuffled) trace at once: where each put each prefix group, and the hit rate of the pair."""
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.placement import make_placement
    from prefixgate.sim import SimClock, SimEngine, StepTimeModel

    from .engines import SIM_PROFILES

    p = SIM_PROFILES["gpu-1b"]
    clock = SimClock()
    engines = [SimEngine(block_size=p.block_size, num_blocks=math.ceil(kv_tokens / p.block_size),
                         max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                         max_model_len=p.max_model_len,
                         step_time=StepTimeModel(*p.step_time, overlap=p.overlap), tokenizer=tokenizer,
                         clock=clock) for _ in range(replicas)]
    requests = list(enumerate(trace.requests))
    random.Random(seed).shuffle(requests)
    recorders = [_Recorder(make_placement(placement)), _Recorder(make_placement(placement))]
    where: dict[int, list[collections.Counter[int]]] = collections.defaultdict(
        lambda: [collections.Counter(), collections.Counter()])
    outs: list[Any] = []
    start = clock.now()
    async with Gateway(engines, GatewayConfig(placement=recorders[0]), clock=clock) as a, \
            Gateway(engines, GatewayConfig(placement=recorders[1]), clock=clock) as b:
        sp_type = type(engines[0].default_sampling_params())

        async def through(k: int, i: int, req: Any) -> None:
            side = k % 2
            gw, rid = (a, b)[side], f"g{side}-{i}"
            last = None
            async for out in gw.generate(req.prompt, sp_type(max_tokens=req.max_tokens), request_id=rid):
                last = out
            where[req.group][side][recorders[side].placed[rid]] += 1
            outs.append(last)

        await asyncio.gather(*(through(k, i, req) for k, (i, req) in enumerate(requests)))
    prompt = sum(len(r.prompt_token_ids) for r in outs)
    cached = sum(int(r.num_cached_tokens or 0) for r in outs)
    both = [(ca, cb) for ca, cb in where.values() if ca and cb]
    # Per group seen by both: how alike the two gateways' placements are (the overlap of their
    # shares per replica), and the share of its requests on its most used replica.
    overlap = [sum(min(ca[r] / sum(ca.values()), cb[r] / sum(cb.values())) for r in ca) for ca, cb in both]
    modal = [max((ca + cb).values()) / sum((ca + cb).values()) for ca, cb in both]
    sizes = [sum((ca + cb).values()) for ca, cb in both]
    return {"hit_rate": cached / prompt, "req_per_s": len(outs) / (clock.now() - start),
            "groups_seen_by_both": len(both),
            "agreement": sum(o * n for o, n in zip(overlap, sizes, strict=True)) / sum(sizes),
            "groups_agreeing_95": sum(o >= 0.95 for o in overlap) / len(both),
            "modal_share": sum(m * n for m, n in zip(modal, sizes, strict=True)) / sum(sizes)}


def run_case(replicas: int, popularity: str, *, repeats: int, prefix_tokens: int, kv_share: float,
             tokenizer: Any, pair: bool = False) -> dict[str, Any]:
    """Every arm ``repeats`` times (seeds 0..) on one replica count and popularity; with
    ``pair``, also two independent gateways (:func:`run_pair`) for ``L`` and ``L ring``."""
    from .ceiling import ceiling

    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    ceilings = []
    for seed in range(repeats):
        trace = _trace(replicas, popularity, prefix_tokens, seed, tokenizer)
        working_set = len({r.group for r in trace.requests}) * prefix_tokens
        kv = int(kv_share * working_set / replicas) + 64 * 128  # plus room for 64 running requests
        ceilings.append(ceiling([tokenizer.encode(r.prompt) for r in trace.requests], 16).hit_rate)
        for arm in ARMS:
            runs[arm].append(asyncio.run(run_arm(arm, trace, replicas, kv, tokenizer, seed)))
    med = {a: {k: statistics.median(r[k] for r in rs) for k in
               ("req_per_s", "hit_rate", "computed_prefill_tokens", "imbalance")} for a, rs in runs.items()}
    pairs: dict[str, Any] = {}
    if pair:  # two independent gateways, each given half the trace
        for arm in ("L", "L ring"):
            got = []
            for seed in range(repeats):
                trace = _trace(replicas, popularity, prefix_tokens, seed, tokenizer)
                working_set = len({r.group for r in trace.requests}) * prefix_tokens
                kv = int(kv_share * working_set / replicas) + 64 * 128
                got.append(asyncio.run(run_pair(trace, replicas, kv, tokenizer, PLACEMENT[arm], seed)))
            pairs[arm] = {k: statistics.median(g[k] for g in got) for k in got[0]}
            pairs[arm]["hit_rate_vs_one"] = pairs[arm]["hit_rate"] / med[arm]["hit_rate"]
    h_star = statistics.median(ceilings)
    rr = med["RR"]
    return {"replicas": replicas, "popularity": popularity, "ceiling_hit_rate": h_star, "medians": med,
            "ratios": {a: {"req_per_s_vs_RR": m["req_per_s"] / rr["req_per_s"],
                           "hit_rate_vs_ceiling": m["hit_rate"] / h_star} for a, m in med.items()},
            "pairs": pairs, "runs": runs,
            "kv_tokens_per_replica": int(kv_share * 16 * replicas * prefix_tokens / replicas)}


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    """Per case and arm: req/s, ×RR, hit rate, ×ceiling, computed prefill, imbalance."""
    lines = [f"{'replicas':>8} {'popularity':<10} {'arm':<7} {'req/s':>9} {'xRR':>6} {'hit':>6} "
             f"{'xH*':>6} {'prefill':>11} {'imbal':>6}"]
    for c in cases:
        for arm, m in c["medians"].items():
            r = c["ratios"][arm]
            lines.append(f"{c['replicas']:>8} {c['popularity']:<10} {arm:<7} {m['req_per_s']:>9.1f} "
                         f"{r['req_per_s_vs_RR']:>6.2f} {m['hit_rate']:>6.3f} "
                         f"{r['hit_rate_vs_ceiling']:>6.2f} "
                         f"{m['computed_prefill_tokens']:>11.0f} {m['imbalance']:>6.2f}")
        lines.append(f"{'':>8} {'':<10} {'H*':<7} {'':>9} {'':>6} {c['ceiling_hit_rate']:>6.3f}")
        for arm, pr in c.get("pairs", {}).items():
            lines.append(f"{'':>8} {'':<10} two gateways ({arm}): hit {pr['hit_rate']:.3f} "
                         f"({pr['hit_rate_vs_one']:.3f} of one's), placements alike {pr['agreement']:.2f} "
                         f"(groups alike >= 95%: {pr['groups_agreeing_95']:.2f}), "
                         f"on the group's main replica {pr['modal_share']:.2f}")
    return "\n".join(lines)


def plot(cases: Sequence[dict[str, Any]], out: Path) -> None:
    """Bars of req/s (× RR) and hit rate (× H*) per case and arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{c['replicas']}\n{c['popularity']}" for c in cases]
    width = 0.8 / len(ARMS)
    for k, arm in enumerate(ARMS):
        xs = [i + k * width for i in range(len(cases))]
        axes[0].bar(xs, [c["ratios"][arm]["req_per_s_vs_RR"] for c in cases], width, label=arm)
        axes[1].bar(xs, [c["ratios"][arm]["hit_rate_vs_ceiling"] for c in cases], width, label=arm)
    for ax, title in zip(axes, ("req/s / round robin", "hit rate / H*"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], labels)
        ax.set_title(f"W5 (sim): {title}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the cases, prints the table, writes JSON and a PNG."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--popularity", nargs="+", default=["zipf", "even"], choices=["zipf", "even"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--kv-share", type=float, default=1.5,
                   help="each replica's KV over its share of the working set (the prefixes / N)")
    p.add_argument("--no-pair", action="store_true", help="skip the two-gateway runs (zipf cases)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "tests" / "fixtures" / "tiny-llama"))
    wall0 = time.perf_counter()
    cases = []
    for n in args.replicas:
        for popularity in args.popularity:
            cases.append(run_case(n, popularity, repeats=args.repeats, prefix_tokens=args.prefix_tokens,
                                  kv_share=args.kv_share, tokenizer=tokenizer,
                                  pair=not args.no_pair and popularity == "zipf"))
            print(format_table(cases[-1:]), flush=True)
    print(format_table(cases))
    doc = {"benchmark": "W5-sim", "profile": "gpu-1b", "args": {k: str(v) for k, v in vars(args).items()},
           "cases": cases, "wall_s": time.perf_counter() - wall0}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        plot(cases, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
