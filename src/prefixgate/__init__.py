"""prefixgate: an asyncio gateway that makes vLLM's prefix cache pay off.

Canonicalize prompts, key them on block-hash chains at the engine's block size, queue and order
them, admit only what fits, and stream results back::

    from prefixgate import Gateway, GatewayConfig

    async with Gateway.for_vllm(engine, GatewayConfig()) as gw:
        async for out in gw.generate(prompt, SamplingParams(max_tokens=64), tenant="acme"):
            ...
"""

from .cache_events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent, CacheFollower
from .canonicalize import (
    RULE_SETS,
    CanonicalizeConfig,
    Canonicalized,
    Rule,
    RuleCount,
    canonicalize_messages,
    canonicalize_text,
)
from .clock import AutoClock, Clock, FakeClock, MonotonicClock
from .config import GatewayConfig, TenantLimits
from .engine import Engine, EngineRequest, KvStats, Media, SamplingCheck, Tokenizer
from .errors import (
    AdmissionPolicyFailed,
    AdmissionRefused,
    EngineDead,
    EngineError,
    EngineStalled,
    Evicted,
    InvalidRequest,
    Outcome,
    Overloaded,
    PrefixgateError,
    PromptTooLong,
    QueueFull,
    QueueTimeout,
    RateLimited,
    Reason,
    Rejected,
    RequestTooLarge,
    RetryableRejection,
    ShuttingDown,
    UsageError,
)
from .gateway import Gateway
from .keys import BlockHash, Namespace, block_hashes
from .ordering import Fcfs, OrderingPolicy, PrefixOrder, PriorityOrder
from .placement import ConsistentHash, CostPlacement, LeastLoaded, PlacementPolicy, ReplicaState, RoundRobin
from .policies import AdmissionPolicy, Refusal, TokenBudget, Usage
from .remote import RemoteVllm
from .statistics import GatewayStatistics, ReplicaStatistics, RuleStats
from .streaming import ResponseStream
from .tickets import Ticket, TicketState
from .vllm_engine import VllmEngine

__version__ = "0.1.0"

__all__ = (
    "RULE_SETS",
    "AdmissionPolicy",
    "AdmissionPolicyFailed",
    "AdmissionRefused",
    "AutoClock",
    "BlockHash",
    "BlocksRemoved",
    "BlocksStored",
    "CacheCleared",
    "CacheEvent",
    "CacheFollower",
    "CanonicalizeConfig",
    "Canonicalized",
    "Clock",
    "ConsistentHash",
    "CostPlacement",
    "Engine",
    "EngineDead",
    "EngineError",
    "EngineRequest",
    "EngineStalled",
    "Evicted",
    "FakeClock",
    "Fcfs",
    "Gateway",
    "GatewayConfig",
    "GatewayStatistics",
    "InvalidRequest",
    "KvStats",
    "LeastLoaded",
    "Media",
    "MonotonicClock",
    "Namespace",
    "OrderingPolicy",
    "Outcome",
    "Overloaded",
    "PlacementPolicy",
    "PrefixOrder",
    "PrefixgateError",
    "PriorityOrder",
    "PromptTooLong",
    "QueueFull",
    "QueueTimeout",
    "RateLimited",
    "Reason",
    "Refusal",
    "Rejected",
    "RemoteVllm",
    "ReplicaState",
    "ReplicaStatistics",
    "RequestTooLarge",
    "ResponseStream",
    "RetryableRejection",
    "RoundRobin",
    "Rule",
    "RuleCount",
    "RuleStats",
    "SamplingCheck",
    "ShuttingDown",
    "TenantLimits",
    "Ticket",
    "TicketState",
    "TokenBudget",
    "Tokenizer",
    "Usage",
    "UsageError",
    "VllmEngine",
    "block_hashes",
    "canonicalize_messages",
    "canonicalize_text",
)
