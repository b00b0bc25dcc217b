"""The benchmark harness: engines, the four arms, per-request records and metrics.

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
import gc
import math
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from prefixgate import EngineRequest, Evicted, Gateway, GatewayConfig, KvStats, Rejected
from prefixgate.canonicalize import CanonicalizeConfig
from prefixgate.clock import Clock, MonotonicClock

from .ceiling import Ceiling, ceiling, kappa
from .workloads import Trace, TraceRequest

__all__ = ["ARMS", "DEFAULT_ARMS", "GATEWAY_DEFAULTS", "SIM_PROFILES", "ArmRun", "EngineFactory",
           "RequestRecord", "RunningEngine", "SimFactory", "SimProfile", "VllmFactory", "arm_metrics",
           "gateway_config", "ratios", "run_arm", "run_benchmark", "run_calibration", "summarize"]

ARMS = ("B0", "B1", "L", "O")
DEFAULT_ARMS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "W0": ("B1",), "W1": ARMS, "W2": ("B1", "L", "O"), "W3": ARMS, "W4": ("B1", "L", "O"),
    "W5": ("B1", "L", "O"),
})
# Per-workload GatewayConfig fields for the L arm; later issues (ordering, admission) fill these.
GATEWAY_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({w: {} for w in DEFAULT_ARMS})

METRICS = ("req_per_s", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
           "hit_rate", "prompt_tokens", "cached_tokens", "prefill_tokens", "preemptions", "offered",
           "completed", "rejected", "errored", "max_queue_wait_s", "makespan_s")


# -- engines ---------------------------------------------------------------------------------


class RunningEngine(Protocol):
    """A started engine as the arms use it."""

    engine: Any
    """The :class:`~prefixgate.engine.Engine` (``generate``, ``tokenizer``, ``block_size``)."""
    clock: Clock
    """The clock that times arrivals and outputs (virtual for the simulator)."""

    def sampling_params(self, max_tokens: int) -> Any:
        """Greedy sampling parameters for ``max_tokens`` output tokens, EOS ignored."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Empties the prefix cache (no request may be running)."""
        ...

    def preemptions(self) -> int:
        """Preemptions so far (cumulative)."""
        ...

    async def settle(self) -> None:
        """Waits until counters reflect every finished request."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready engine configuration."""
        ...

    async def close(self) -> None:
        """Shuts the engine down."""
        ...


class EngineFactory(Protocol):
    """Starts the engines of one benchmark run."""

    name: str
    """``"sim"``, ``"vllm-cpu"`` or ``"vllm"``."""
    vllm_version: str | None
    """vLLM's version, or ``None`` for the simulator."""
    concurrent_engines: bool
    """Whether the caching-on and caching-off engines may run side by side."""

    def tokenizer(self) -> Any:
        """The engines' tokenizer, available before any engine starts (to build traces)."""
        ...

    async def start(self, *, caching: bool, kv_cap_tokens: int | None) -> RunningEngine:
        """Starts an engine with prefix caching on or off and at most ``kv_cap_tokens`` of KV."""
        ...


@dataclass(frozen=True, slots=True)
class SimProfile:
    """SimEngine settings that mirror one real engine.

    Attributes:
        block_size: KV block size in tokens.
        num_blocks: KV blocks when uncapped.
        max_num_seqs: Running requests at most.
        max_num_batched_tokens: Tokens per step at most.
        max_model_len: Prompt + output at most.
        step_time: ``(alpha, beta, gamma)`` of the step-time model.
    """

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_time: tuple[float, float, float]


# vLLM 0.26, H200, Llama-3-8B shape: 52,548 blocks at 0.85 memory; AsyncLLMEngine defaults
# (ENGINE_CONTEXT: 128 seqs, 2048 batched tokens); SimEngine's default step time.
_H200_8B = SimProfile(16, 52_548, 128, 2048, 16_384, (0.005, 5e-5, 4e-5))
# vllm-cpu 0.32, tiny Llama, 2 cores (measured here: ~5.3k prefill tok/s, ~2 ms + 0.5 ms/seq).
_CPU_TINY = SimProfile(128, 16_384, 128, 2048, 4096, (0.002, 1.9e-4, 5e-4))
SIM_PROFILES: Mapping[str, SimProfile] = MappingProxyType({"gpu": _H200_8B, "sim": _H200_8B,
                                                           "cpu": _CPU_TINY})
"""Per workload size, the real engine SimEngine mirrors."""


class _SimRunning:
    def __init__(self, engine: Any, caching: bool) -> None:
        self.engine = engine
        self.clock: Clock = engine.clock
        self.caching = caching

    def sampling_params(self, max_tokens: int) -> Any:
        from prefixgate.testing import FakeSamplingParams

        return FakeSamplingParams(max_tokens=max_tokens)

    async def reset_prefix_cache(self) -> None:
        for _ in range(10_000):  # aborted requests leave at the next step boundary
            if await self.engine.reset_prefix_cache():
                return
            await self.clock.sleep(0.001)
        raise RuntimeError("SimEngine refused to reset its prefix cache: requests still hold blocks")

    def preemptions(self) -> int:
        return int(self.engine.num_preemptions)

    async def settle(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        st = self.engine.step_time
        return {"block_size": self.engine.block_size,
                "num_gpu_blocks": self.engine.scheduler.pool.num_blocks,  # as vLLM's, null block included
                "max_model_len": self.engine.max_model_len, "enable_prefix_caching": self.caching,
                "step_time": {"alpha": st.alpha, "beta": st.beta, "gamma": st.gamma}}

    async def close(self) -> None:
        return None


class _MemoTokenizer:
    """Memoizes ``encode`` (a bounded LRU). Only for the simulator: tokenizing takes no virtual
    time there, and each prompt is tokenized once per arm run, and again for the ceiling.
    """

    def __init__(self, tokenizer: Any, max_entries: int = 100_000) -> None:
        self._tokenizer = tokenizer
        self._max_entries = max_entries
        self._memo: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        ids = self._memo.get(key)
        if ids is None:
            ids = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
            self._memo[key] = ids
            if len(self._memo) > self._max_entries:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return list(ids)

    def __getattr__(self, name: str) -> Any:  # decode, apply_chat_template, ... pass through
        return getattr(self._tokenizer, name)


class SimFactory:
    """Starts :class:`prefixgate.sim.SimEngine` instances, each on its own virtual clock.

    Args:
        size: Which real engine to mirror (a key of :data:`SIM_PROFILES`).
        tokenizer: The tokenizer (the tiny Llama's, to match vllm-cpu's token counts).
        step_time: Overrides the profile's ``(alpha, beta, gamma)``.
    """

    name = "sim"
    vllm_version = None
    concurrent_engines = True

    def __init__(self, size: str, tokenizer: Any, *,
                 step_time: tuple[float, float, float] | None = None) -> None:
        profile = SIM_PROFILES[size]
        self.profile = dataclasses.replace(profile, step_time=step_time or profile.step_time)
        self._tokenizer = _MemoTokenizer(tokenizer)

    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self, *, caching: bool, kv_cap_tokens: int | None) -> RunningEngine:
        from prefixgate.sim import SimEngine, StepTimeModel

        p = self.profile
        blocks = p.num_blocks if kv_cap_tokens is None else math.ceil(kv_cap_tokens / p.block_size)
        engine = SimEngine(block_size=p.block_size, num_blocks=blocks, max_num_seqs=p.max_num_seqs,
                           max_num_batched_tokens=p.max_num_batched_tokens, max_model_len=p.max_model_len,
                           enable_caching=caching, step_time=StepTimeModel(*p.step_time),
                           tokenizer=self._tokenizer)
        return _SimRunning(engine, caching)

    def __repr__(self) -> str:
        return f"SimFactory({self.profile})"


class _BareVllm:
    """An ``AsyncLLMEngine`` with prefix caching off, for B0 (:class:`prefixgate.VllmEngine`
    refuses such engines). Offers the slice of :class:`~prefixgate.engine.Engine` the bare arms
    use, and counts preemptions with a stat logger.
    """

    def __init__(self, engine_args: Any) -> None:
        from vllm import AsyncLLMEngine
        from vllm.v1.metrics.loggers import StatLoggerBase

        counter = self

        class _Preemptions(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if iteration_stats is not None:
                    counter.preempted += getattr(iteration_stats, "num_preempted_reqs", 0) or 0

            def log_engine_initialized(self) -> None:
                pass

        self.preempted = 0
        self._engine = AsyncLLMEngine.from_engine_args(engine_args, stat_loggers=[_Preemptions])
        cfg = self._engine.vllm_config
        self.block_size = int(cfg.cache_config.block_size)
        self.num_blocks = int(cfg.cache_config.num_gpu_blocks or 0)
        self.tokenizer = self._engine.get_tokenizer()

    @property
    def vllm_engine(self) -> Any:
        return self._engine

    def kv_stats(self) -> KvStats:
        return KvStats(time=0.0, total_blocks=self.num_blocks, free_blocks=0, preemptions=self.preempted)

    async def generate(self, request: EngineRequest) -> Any:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        async for out in self._engine.generate(prompt, request.sampling_params, request.request_id):
            yield out

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
            del engine  # collected at interpreter exit instead, vLLM's __del__ raises
            gc.collect()


class _VllmRunning:
    def __init__(self, engine: Any, caching: bool) -> None:
        self.engine = engine
        self.clock: Clock = MonotonicClock()
        self.caching = caching

    def sampling_params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def reset_prefix_cache(self) -> None:
        for _ in range(100):  # aborted requests may still hold blocks for a few steps
            if await self.engine.vllm_engine.reset_prefix_cache():
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("vLLM refused to reset its prefix cache: requests still hold blocks")

    def preemptions(self) -> int:
        stats = self.engine.kv_stats()
        return int(stats.preemptions) if stats is not None else 0

    async def settle(self) -> None:
        await asyncio.sleep(0.3)  # the last step's stats reach the stat logger after its outputs

    def describe(self) -> dict[str, Any]:
        cfg = self.engine.vllm_engine.vllm_config
        return {"block_size": int(cfg.cache_config.block_size),
                "num_gpu_blocks": int(cfg.cache_config.num_gpu_blocks or 0),
                "max_model_len": int(cfg.model_config.max_model_len),
                "max_num_seqs": int(cfg.scheduler_config.max_num_seqs),
                "max_num_batched_tokens": int(cfg.scheduler_config.max_num_batched_tokens),
                "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching)}

    async def close(self) -> None:
        self.engine.shutdown()


class VllmFactory:
    """Starts real vLLM engines: vllm-cpu with the tiny Llama, or the GPU with an 8B shape.

    Both use dummy weights. The KV cap is passed as ``num_gpu_blocks_override``, converted at
    ``block_size_hint`` (the platform's block size: 128 on CPU, 16 on CUDA; checked at start).

    Args:
        name: ``"vllm-cpu"`` or ``"vllm"`` (GPU).
        model_dir: A model directory with ``config.json`` and the tokenizer files.
    """

    concurrent_engines = False

    def __init__(self, name: str, model_dir: str) -> None:
        if name not in ("vllm-cpu", "vllm"):
            raise ValueError(f"VllmFactory name must be 'vllm-cpu' or 'vllm', got {name!r}")
        self.name = name
        self.model_dir = model_dir
        self.block_size_hint = 128 if name == "vllm-cpu" else 16
        self._tokenizer: Any = None

    @property
    def vllm_version(self) -> str | None:  # type: ignore[override]
        import vllm

        return str(vllm.__version__)

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def engine_args(self, *, caching: bool, kv_cap_tokens: int | None) -> Any:
        """vLLM engine arguments for one engine."""
        from vllm import AsyncEngineArgs

        kwargs: dict[str, Any] = dict(model=self.model_dir, load_format="dummy",
                                      enable_prefix_caching=caching, seed=0, disable_log_stats=False)
        if self.name == "vllm-cpu":
            kwargs.update(max_model_len=4096, enforce_eager=True)
        else:
            kwargs.update(max_model_len=16_384, gpu_memory_utilization=0.85, dtype="bfloat16")
        if kv_cap_tokens is not None:
            kwargs["num_gpu_blocks_override"] = math.ceil(kv_cap_tokens / self.block_size_hint)
        return AsyncEngineArgs(**kwargs)

    async def start(self, *, caching: bool, kv_cap_tokens: int | None) -> RunningEngine:
        from prefixgate import VllmEngine

        args = self.engine_args(caching=caching, kv_cap_tokens=kv_cap_tokens)
        engine = VllmEngine.from_engine_args(args) if caching else _BareVllm(args)
        running = _VllmRunning(engine, caching)
        try:
            if engine.block_size != self.block_size_hint and kv_cap_tokens is not None:
                raise RuntimeError(f"block size is {engine.block_size}, not {self.block_size_hint}: "
                                   "the KV cap would be wrong")
            warm = [f"warm up {i} " + "the cache of the engine " * 40 for i in range(4)]
            await asyncio.gather(*(self._one(running, f"warmup-{caching}-{i}", p)
                                   for i, p in enumerate(warm)))
            await running.reset_prefix_cache()
        except BaseException:
            await running.close()
            raise
        return running

    @staticmethod
    async def _one(running: _VllmRunning, rid: str, prompt: str) -> None:
        ids = running.engine.tokenizer.encode(prompt)
        async for _ in running.engine.generate(EngineRequest(rid, ids, running.sampling_params(4))):
            pass

    def __repr__(self) -> str:
        return f"VllmFactory({self.name!r}, model_dir={self.model_dir!r})"


def make_gpu_model_dir(tokenizer_dir: str, dst: str) -> str:
    """A Llama-3-8B-shaped model directory for dummy weights (as ``baseline_pressure.py``):
    ``config.json`` written, the tokenizer files copied from ``tokenizer_dir``.
    """
    import json
    import shutil

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), dst)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 16384,
           "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "rope_theta": 500000.0}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


# -- arms --------------------------------------------------------------------------------------


def gateway_config(workload: str, overrides: Mapping[str, Any] | None = None) -> GatewayConfig:
    """The L arm's :class:`GatewayConfig`: the workload's defaults, then ``overrides``.

    Keys are GatewayConfig fields; ``canonicalize.<rule>`` sets one canonicalization switch.

    Raises:
        ValueError: For an unknown field or an invalid value.
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
    if canon:
        plain["canonicalize"] = dataclasses.replace(plain.get("canonicalize", CanonicalizeConfig()), **canon)
    return GatewayConfig(**plain)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request in one arm run (times on the engine's clock).

    Attributes:
        arrival: When the request was sent (its arrival slot).
        first_output: When its first output came back.
        finished: When its last output came back.
        prompt_tokens: Prompt length as the engine saw it.
        cached_tokens: The engine's ``num_cached_tokens``.
        output_tokens: Tokens generated.
        outcome: ``"completed"``, ``"rejected"`` (refused or evicted by the gateway) or
            ``"errored"``; ``None`` while running.
        queue_wait: Time in the gateway's queue (L only).
        error: The exception, for errored requests.
    """

    arrival: float
    first_output: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    outcome: str | None = None
    queue_wait: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ArmRun:
    """One arm run: its per-request records and the engine counters around it.

    Attributes:
        arm: ``"B0"``, ``"B1"``, ``"L"`` or ``"O"``.
        repeat: Repeat index.
        start: Engine-clock time the run started.
        records: One record per offered request, in submission order.
        preemptions: Engine preemptions during the run.
        gateway: The L arm's gateway statistics (JSON-ready), else empty.
        timed_out: Whether the run hit its timeout (its unfinished requests count as errored).
    """

    arm: str
    repeat: int
    start: float
    records: tuple[RequestRecord, ...]
    preemptions: int
    gateway: Mapping[str, Any] = field(default_factory=dict)
    timed_out: bool = False


def _quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of an ascending sequence; ``None`` if empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def arm_metrics(run: ArmRun) -> dict[str, Any]:
    """The metrics of one arm run.

    ``req_per_s`` and ``output_tok_per_s`` are completed work over the makespan (start of the run
    to the last request's end); TTFT and E2E run from each request's *arrival* (quantiles are
    nearest-rank); ``hit_rate`` is Σ cached / Σ prompt tokens and ``prefill_tokens`` Σ (prompt −
    cached), over completed requests; ``completed + rejected + errored == offered``.
    """
    done = [r for r in run.records if r.outcome == "completed"]
    ends = [r.finished for r in run.records if r.finished is not None]
    makespan = max(ends) - run.start if ends else 0.0
    ttft = sorted(r.first_output - r.arrival for r in done if r.first_output is not None)
    e2e = sorted(r.finished - r.arrival for r in done if r.finished is not None)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    waits = [r.queue_wait for r in run.records if r.queue_wait is not None]
    return {
        "req_per_s": len(done) / makespan if makespan > 0 else None,
        "output_tok_per_s": sum(r.output_tokens for r in done) / makespan if makespan > 0 else None,
        "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99),
        "e2e_p50_s": _quantile(e2e, 0.5), "e2e_p99_s": _quantile(e2e, 0.99),
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached,
        "preemptions": run.preemptions,
        "offered": len(run.records), "completed": len(done),
        "rejected": sum(r.outcome == "rejected" for r in run.records),
        "errored": sum(r.outcome == "errored" for r in run.records),
        "max_queue_wait_s": max(waits) if waits else None,
        "makespan_s": makespan,
    }


def _median(values: Sequence[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: Sequence[ArmRun]) -> dict[str, Any]:
    """Median over repeats of each metric, plus the per-repeat values under ``"repeats"``."""
    per = [arm_metrics(r) for r in runs]
    out: dict[str, Any] = {m: _median([p[m] for p in per]) for m in METRICS}
    errors = [rec.error for r in runs for rec in r.records if rec.error]
    if errors:
        out["errors_sample"] = sorted(set(errors))[:5]
    out["timed_out"] = sum(r.timed_out for r in runs)
    if any(r.gateway for r in runs):
        out["gateway"] = [dict(r.gateway) for r in runs]
    out["repeats"] = per
    return out


def _order(arm: str, trace: Trace) -> list[tuple[TraceRequest, str, float]]:
    """(request, prompt to send, arrival slot) in submission order for ``arm``."""
    if arm != "O":
        return [(r, r.prompt, r.arrival) for r in trace.requests]
    slots = [r.arrival for r in trace.requests]
    return [(r, r.clean_prompt, t) for r, t in zip(trace.best_order(), slots, strict=True)]


class _ArmDriver:
    """Sends one arm's requests on the engine's clock and records what comes back."""

    def __init__(self, arm: str, repeat: int, trace: Trace, engine: RunningEngine,
                 config: GatewayConfig | None, on_done: Callable[[], None]) -> None:
        self.arm = arm
        self.repeat = repeat
        self.trace = trace
        self.engine = engine
        self.clock: Clock = engine.clock
        self.gateway = Gateway(engine.engine, config, clock=engine.clock) if arm == "L" else None
        self.on_done = on_done

    async def _serve(self, i: int, request: TraceRequest, prompt: str, rec: RequestRecord) -> None:
        rid = f"{self.arm}-r{self.repeat}-{i}"
        params = self.engine.sampling_params(request.max_tokens)
        last = None
        try:
            if self.gateway is not None:
                stream = self.gateway.generate(prompt, params, request_id=rid, tenant=request.tenant)
                async with stream:
                    async for out in stream:
                        rec.first_output = rec.first_output or self.clock.now()
                        last = out
                ticket = stream.ticket
                if ticket.dispatched_at is not None:
                    rec.queue_wait = ticket.dispatched_at - ticket.arrival
            else:
                ids = self.engine.engine.tokenizer.encode(prompt)
                outputs = self.engine.engine.generate(EngineRequest(rid, ids, params))
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        rec.first_output = rec.first_output or self.clock.now()
                        last = out
            rec.finished = self.clock.now()
            if last is None or not getattr(last, "finished", False):
                raise RuntimeError("stream ended without a finished output")
            rec.prompt_tokens = len(last.prompt_token_ids)
            rec.cached_tokens = int(last.num_cached_tokens or 0)
            rec.output_tokens = len(last.outputs[0].token_ids)
            rec.outcome = "completed"
        except (Rejected, Evicted) as e:
            rec.outcome, rec.error = "rejected", f"{type(e).__name__}: {e}"
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
                    rec = records[i] = RequestRecord(arrival=self.clock.now())
                    await self._serve(i, req, prompt, rec)

            await asyncio.gather(*(client() for _ in range(arrivals.concurrency or 1)))
            return
        tasks = []
        try:
            for i, (req, prompt, at) in enumerate(items):
                if arrivals.kind == "poisson" and (delay := start + at - self.clock.now()) > 0:
                    await self.clock.sleep(delay)
                rec = records[i] = RequestRecord(arrival=start + at)
                tasks.append(asyncio.create_task(self._serve(i, req, prompt, rec)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # on a timeout: end every request, each records its outcome
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, timeout: float | None) -> ArmRun:
        await self.engine.reset_prefix_cache()
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
            stats = _jsonable(self.gateway.statistics())
            stats.pop("kv", None)
        done = tuple(r if r is not None else RequestRecord(
            arrival=start, finished=start, outcome="errored", error="not sent: the arm timed out")
            for r in records)
        return ArmRun(self.arm, self.repeat, start, done, self.engine.preemptions() - before, stats,
                      timed_out)


async def run_arm(arm: str, repeat: int, trace: Trace, engine: RunningEngine,
                  config: GatewayConfig | None = None,
                  on_done: Callable[[], None] | None = None,
                  timeout: float | None = None) -> ArmRun:
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

    Returns:
        The run's records and counters.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")
    driver = _ArmDriver(arm, repeat, trace, engine, config, on_done or (lambda: None))
    return await driver.run(timeout)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(arms: Mapping[str, Mapping[str, Any]], ceil: Ceiling) -> dict[str, Any]:
    """Headline ratios between arms' medians; ``None`` where an arm is missing."""
    def get(arm: str, metric: str) -> Any:
        return arms.get(arm, {}).get(metric)

    out: dict[str, Any] = {
        "L_over_B1_req_per_s": _ratio(get("L", "req_per_s"), get("B1", "req_per_s")),
        "O_over_B1_req_per_s": _ratio(get("O", "req_per_s"), get("B1", "req_per_s")),
        "L_over_O_req_per_s": _ratio(get("L", "req_per_s"), get("O", "req_per_s")),
        "B1_over_B0_req_per_s": _ratio(get("B1", "req_per_s"), get("B0", "req_per_s")),
        "L_over_B1_ttft_p99": _ratio(get("L", "ttft_p99_s"), get("B1", "ttft_p99_s")),
        "L_hit_over_ceiling": _ratio(get("L", "hit_rate"), ceil.hit_rate),
        "kappa": None, "kappa_O": None, "kappa_repeats": None,
    }
    b1, lo, oo = get("B1", "prefill_tokens"), get("L", "prefill_tokens"), get("O", "prefill_tokens")
    if b1 is not None and lo is not None:
        out["kappa"] = kappa(b1, lo, ceil.min_prefill_tokens)
        reps = zip(arms["B1"]["repeats"], arms["L"]["repeats"], strict=False)
        out["kappa_repeats"] = [kappa(x["prefill_tokens"], y["prefill_tokens"], ceil.min_prefill_tokens)
                                for x, y in reps]
    if b1 is not None and oo is not None:
        out["kappa_O"] = kappa(b1, oo, ceil.min_prefill_tokens)
    return out


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
                        progress: bool = False, arm_timeout: float | None = None) -> dict[str, Any]:
    """Runs every arm ``repeats`` times on ``trace`` and returns the JSON-ready result.

    Args:
        trace: The workload (W1–W4; W0 goes through :func:`run_calibration`).
        factory: Starts engines (caching on or off) and says whether two may run at once.
        arms: Arms to run; the workload's defaults when ``None``.
        repeats: Runs per arm.
        gateway_overrides: GatewayConfig fields for the L arm, over the workload's defaults.
        progress: Show a tqdm progress bar (per request) on stderr.
        arm_timeout: Real seconds one arm run may take (see :func:`run_arm`).

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
    pending_rate = trace.arrivals.pending
    phases = _phases(arms, repeats, factory.concurrent_engines, on_first=pending_rate)
    total = sum(len(items) for items in phases) * len(trace.requests) + (
        len(trace.requests) if pending_rate else 0)
    bar = _progress(total, f"{trace.workload} on {factory.name}", progress)
    runs: dict[str, list[ArmRun]] = {a: [] for a in arms}
    engines: dict[bool, RunningEngine] = {}
    params: dict[str, Any] = dict(trace.params)
    ceil: Ceiling | None = None
    try:
        for items in phases:
            needed = sorted({arm != "B0" for _, arm in items}, reverse=True)
            for on in [on for on in engines if on not in needed]:
                await engines.pop(on).close()
            for on in needed:
                if on not in engines:
                    _say(bar, f"starting {factory.name} (prefix caching {'on' if on else 'off'})")
                    engines[on] = await factory.start(caching=on, kv_cap_tokens=trace.kv_cap_tokens)
                    params[f"engine_{'on' if on else 'off'}"] = engines[on].describe()
            if ceil is None:
                ceil = _ceiling(trace, engines[needed[0]])
            if pending_rate and True in engines:
                trace = await _measure_rate(trace, engines[True], config, bar, params, arm_timeout)
                pending_rate = False
            for repeat, arm in items:
                _say(bar, f"{arm} repeat {repeat + 1}/{repeats}")
                run = await run_arm(arm, repeat, trace, engines[arm != "B0"], config,
                                    on_done=bar.update if bar is not None else None, timeout=arm_timeout)
                runs[arm].append(run)
    finally:
        for running in engines.values():
            await running.close()
        if bar is not None:
            bar.close()
    assert ceil is not None
    arm_results = {a: summarize(runs[a]) for a in arms}
    params.update(repeats=repeats, arms=list(arms), gateway_config=_jsonable(config),
                  schedule="interleaved" if factory.concurrent_engines
                  else "B0 repeats on the caching-off engine, then the other arms interleaved")
    return {
        "workload": trace.workload, "engine": factory.name, "vllm_version": factory.vllm_version,
        "params": params, "ceiling": ceil.as_dict(), "arms": arm_results,
        "ratios": ratios(arm_results, ceil), "runtime_s": time.perf_counter() - wall0,
    }


def _ceiling(trace: Trace, engine: RunningEngine) -> Ceiling:
    tokenizer = engine.engine.tokenizer
    prompts = [tokenizer.encode(r.clean_prompt) for r in trace.requests]
    return ceiling(prompts, engine.engine.block_size, namespaces=[r.tenant for r in trace.requests])


async def _measure_rate(trace: Trace, engine: RunningEngine, config: GatewayConfig, bar: Any,
                        params: dict[str, Any], timeout: float | None) -> Trace:
    """Measures capacity (B1 req/s on a burst of the trace) and returns the trace at its multiple."""
    _say(bar, "measuring capacity (B1, burst)")
    burst = dataclasses.replace(trace, arrivals=dataclasses.replace(trace.arrivals, kind="burst",
                                                                    capacity_multiple=None, rate=1.0))
    run = await run_arm("B1", -1, burst, engine, config, on_done=bar.update if bar is not None else None,
                        timeout=timeout)
    capacity = arm_metrics(run)["req_per_s"] or 1.0
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
    bar = _progress(repeats * len(trace.requests), f"W0 on {factory.name}", progress)
    engine = await factory.start(caching=True, kv_cap_tokens=None)
    runs: dict[str, list[ArmRun]] = {"B1-prefill": [], "B1-decode": []}
    try:
        for repeat in range(repeats):
            for name, sub in (("B1-prefill", prefill), ("B1-decode", decode)):
                runs[name].append(await run_arm("B1", repeat, sub, engine,
                                                on_done=bar.update if bar is not None else None,
                                                timeout=arm_timeout))
        described = engine.describe()
        ceil = _ceiling(trace, engine)
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


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (dataclasses and mappings to dicts, sets to sorted lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU machine has no tqdm: run without a bar
        return None

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True,
                disable=os.environ.get("PREFIXGATE_NO_PROGRESS") == "1")


def _say(bar: Any, message: str) -> None:
    if bar is not None:
        bar.set_postfix_str(message)

