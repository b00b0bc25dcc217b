"""Soak: a million requests over a hundred thousand tenants; memory and every index stay bounded.

Usage::

    python -m benchmarks.soak --requests 1000000 --tenants 100000 --json benchmarks/results/soak.json

A null-like engine (pre-tokenized prompts of a few blocks, 1 to 3 outputs each) that fails a
share of requests mid-stream (``EngineError``) or refuses them (``InvalidRequest``); clients that
cancel a share of their requests at a random await (before dispatch or mid-stream) or close the
stream early; tenants under a rate limit (a hot few hit it: blocking and ``try_generate``
paths); a bounded queue. Every accepted request must end completed or with a typed error, and
every index of the gateway must stay within its bound; resident memory is sampled after warm-up
and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from prefixgate import EngineRequest, Gateway, GatewayConfig, PrefixgateError, SamplingCheck
from prefixgate.config import TenantLimits
from prefixgate.errors import EngineError, InvalidRequest
from prefixgate.testing import FakeCompletion, FakeOutput, FakeSamplingParams

__all__ = ["FaultyEngine", "bounds", "main", "run_soak"]


class FaultyEngine:
    """Answers with 1 to 3 outputs, yielding to the loop between them; fails ``fail`` of its
    requests mid-stream and refuses ``refuse`` of them at the start."""

    model_name = "soak"
    block_size = 16
    num_blocks = 65_536
    max_model_len = 8192
    max_num_seqs = 128

    def __init__(self, rng: random.Random, fail: float, refuse: float) -> None:
        from prefixgate.testing import ByteTokenizer

        self.tokenizer = ByteTokenizer()
        self.rng = rng
        self.fail = fail
        self.refuse = refuse
        self.live: set[str] = set()

    def default_sampling_params(self) -> FakeSamplingParams:
        return FakeSamplingParams(max_tokens=2)

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        return SamplingCheck(max_tokens=sampling_params.max_tokens)

    def kv_stats(self) -> None:
        return None

    async def generate(self, request: EngineRequest) -> AsyncIterator[FakeOutput]:
        roll = self.rng.random()
        if roll < self.refuse:
            raise InvalidRequest("refused by the engine")
        self.live.add(request.request_id)
        try:
            n = self.rng.randint(1, 3)
            for i in range(n):
                await asyncio.sleep(0)
                if roll < self.refuse + self.fail and i == n - 1:
                    raise EngineError("injected engine failure")
                done = i == n - 1
                yield FakeOutput(request.request_id, (), (FakeCompletion((7,) * (i + 1),
                                 finish_reason="length" if done else None),), done)
        finally:
            self.live.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.live.discard(request_id)


def bounds(gw: Gateway) -> dict[str, tuple[int, int]]:
    """Each index of the gateway: (size now, its bound)."""
    sch, ing = gw._scheduler, gw._ingress
    in_flight = len(sch.running) + sch.num_waiting
    return {
        "scheduler.tenants": (len(sch.tenants), in_flight),
        "scheduler.waiting": (sch.num_waiting, sch.max_queue_len),
        "scheduler.running": (len(sch.running), sch.max_in_flight or 0),
        "scheduler.recent_waits": (len(sch.recent_waits), 256),
        "throttles": (len(gw._dispatch.throttles), 4096 + in_flight),
        "ingress.roots": (len(ing._roots), 4096),
        "ingress.salts": (len(ing._salts), 4096),
        "ingress.interned": (len(ing._interned), 4097),
        "ingress.chains": (len(ing.chains), ing.chains.max_entries),
        "mirror.keys": (len(gw._replica.mirror), gw._replica.mirror.capacity),
        "ledger.tickets": (len(gw._replica.admission.ledger), sch.max_in_flight or 0),
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def run_soak(*, requests: int, tenants: int, clients: int = 512, seed: int = 0,
                   fail: float = 0.02, refuse: float = 0.01, cancel: float = 0.03,
                   close_early: float = 0.02, hot_tenants: int = 20, hot_rate: float = 2.0,
                   progress: bool = True) -> dict[str, Any]:
    """Runs the soak and returns its counts, memory samples and bound checks."""
    rng = random.Random(seed)
    engine = FaultyEngine(random.Random(seed + 1), fail, refuse)
    hot = {f"tenant-{i}" for i in range(hot_tenants)}
    config = GatewayConfig(
        max_queue_len=1024, stall_timeout=30.0,
        tenants={t: TenantLimits(rate=hot_rate) for t in hot},
        default_tenant_limits=TenantLimits(rate=10_000.0, max_in_flight_share=0.25))
    counts: Counter[str] = Counter()
    violations: list[str] = []
    samples: list[dict[str, Any]] = []
    prompts = [[2 + (i * 7 + j) % 250 for j in range(16 * (1 + i % 4) + 5)] for i in range(64)]
    params = FakeSamplingParams(max_tokens=3)
    sent = 0
    t0 = time.perf_counter()
    warm_rss: float | None = None

    async def one(gw: Gateway, i: int) -> None:
        is_hot = rng.random() < 0.01  # 1% to the hot tenants: over their rate in bursts
        tenant = f"tenant-{rng.randrange(len(hot))}" if is_hot else f"tenant-{rng.randrange(tenants)}"
        prompt = prompts[rng.randrange(len(prompts))]
        roll = rng.random()
        try:
            if roll < 0.05 or (is_hot and roll < 0.5):
                stream = gw.try_generate(prompt, params, tenant=tenant)
            else:
                stream = gw.generate(prompt, params, tenant=tenant)
            async with stream:
                n = 0
                async for _ in stream:
                    n += 1
                    if roll > 1 - close_early:
                        break  # the client leaves early: the stream closes, the request aborts
            counts["ended: completed" if stream.ticket is not None and stream.ticket.outcome is not None
                   and stream.ticket.outcome.value == "completed" else "ended: closed early"] += 1
        except PrefixgateError as e:
            counts[f"typed: {type(e).__name__}"] += 1
        except Exception as e:  # anything untyped is a defect
            counts[f"UNTYPED: {type(e).__name__}"] += 1
            violations.append(f"untyped {type(e).__name__}: {e}")

    async def client(gw: Gateway) -> None:
        nonlocal sent
        while sent < requests:
            i = sent
            sent += 1
            task = asyncio.ensure_future(one(gw, i))
            if rng.random() < cancel:
                await asyncio.sleep(0) if rng.random() < 0.5 else None
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                counts["cancelled by client"] += 1

    async with Gateway(engine, config) as gw:
        workers = [asyncio.ensure_future(client(gw)) for _ in range(clients)]
        next_sample = 0
        while not all(w.done() for w in workers):
            await asyncio.sleep(0.5)
            if sent >= next_sample:
                gc.collect()
                rss = _rss_mb()
                if warm_rss is None and sent >= requests // 10:
                    warm_rss = rss
                b = bounds(gw)
                for name, (size, bound) in b.items():
                    if size > bound:
                        violations.append(f"{name}: {size} > {bound} at {sent} requests")
                samples.append({"sent": sent, "rss_mb": rss, "elapsed_s": time.perf_counter() - t0,
                                **{k: v[0] for k, v in b.items()}})
                if progress:
                    print(f"{sent:>9} sent  rss {rss:7.1f} MB  tenants {b['scheduler.tenants'][0]:>5}  "
                          f"throttles {b['throttles'][0]:>6}  live {len(gw._live):>5}", flush=True)
                next_sample = sent + max(1, requests // 40)
        await asyncio.gather(*workers)
        stats = gw.statistics()
        end_bounds = bounds(gw)
        live_left = len(gw._live)
    gc.collect()
    end_rss = _rss_mb()
    accepted = stats.requests
    ended = sum(stats.outcomes.values())
    result = {
        "requests": requests, "tenants": tenants, "clients": clients, "seed": seed,
        "faults": {"engine_fail": fail, "engine_refuse": refuse, "client_cancel": cancel,
                   "client_close_early": close_early, "hot_tenants": len(hot), "hot_rate": hot_rate},
        "elapsed_s": time.perf_counter() - t0, "client_counts": dict(counts),
        "gateway": {"accepted": accepted, "ended": ended, "outcomes": dict(stats.outcomes),
                    "refused": dict(stats.refused), "rejected_reasons": dict(stats.rejected_reasons)},
        "rss_mb": {"after_warmup": warm_rss, "end": end_rss,
                   "growth": None if warm_rss is None else end_rss - warm_rss},
        "end_bounds": {k: list(v) for k, v in end_bounds.items()}, "live_left": live_left,
        "violations": violations, "samples": samples,
    }
    result["checks"] = {
        "every accepted request ended (accepted == sum of outcomes)": accepted == ended,
        "no untyped error reached a client": not any(k.startswith("UNTYPED") for k in counts),
        "every index within its bound, all the way": not violations,
        "nothing left behind (no live ids, queue or running)": live_left == 0
        and end_bounds["scheduler.waiting"][0] == 0 and end_bounds["scheduler.running"][0] == 0,
        "resident memory grew <= 50 MB after warm-up": result["rss_mb"]["growth"] is not None
        and result["rss_mb"]["growth"] <= 50,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--tenants", type=int, default=100_000)
    p.add_argument("--clients", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = asyncio.run(run_soak(requests=args.requests, tenants=args.tenants, clients=args.clients,
                                  seed=args.seed))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
