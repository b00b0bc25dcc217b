"""The gateway's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .canonicalize import CanonicalizeConfig

__all__ = ["GatewayConfig"]


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"GatewayConfig.{name} must be positive or None, got {value!r}")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How a :class:`~prefixgate.Gateway` treats requests. Every field has a safe default.

    Attributes:
        canonicalize: Whitespace rules applied to every prompt (see ``canonicalize.py``).
        key_seed: Seed of every block-key digest.
        model_name: Overrides the engine's model name in block-key namespaces.
        isolate_tenants: Give each tenant its own prefix-cache namespace (vLLM ``cache_salt``),
            so one tenant cannot time another's prompts. ``False`` shares the cache.
        known_tenants: If set, a request naming any other tenant is refused with
            ``InvalidRequest``; ``None`` accepts any tenant.
        max_queue_len: The most requests waiting for dispatch; more are refused (``QueueFull``).
        max_in_flight: The most requests handed to the engine at once; ``None`` for no cap.
        max_prompt_tokens: Refuse prompts longer than this (``PromptTooLong``) even when the
            model would take them; ``None`` leaves only the model's limit.
        queue_timeout: Seconds a request may wait for dispatch before ``QueueTimeout``;
            ``None`` waits indefinitely.
        ordering: Name of the ordering policy for the waiting queue.
    """

    canonicalize: CanonicalizeConfig = field(default_factory=CanonicalizeConfig)
    key_seed: int = 0
    model_name: str | None = None
    isolate_tenants: bool = True
    known_tenants: frozenset[str] | None = None
    max_queue_len: int = 10_000
    max_in_flight: int | None = None
    max_prompt_tokens: int | None = None
    queue_timeout: float | None = None
    ordering: str = "fcfs"

    def __post_init__(self) -> None:
        if not isinstance(self.canonicalize, CanonicalizeConfig):
            raise ValueError("GatewayConfig.canonicalize must be a CanonicalizeConfig")
        if not 0 <= self.key_seed < 2**64:
            raise ValueError(f"GatewayConfig.key_seed must be in [0, 2**64), got {self.key_seed}")
        if self.max_queue_len < 1:
            raise ValueError(f"GatewayConfig.max_queue_len must be >= 1, got {self.max_queue_len}")
        _positive_or_none("max_in_flight", self.max_in_flight)
        _positive_or_none("max_prompt_tokens", self.max_prompt_tokens)
        _positive_or_none("queue_timeout", self.queue_timeout)
        if self.known_tenants is not None:
            if isinstance(self.known_tenants, str) or not isinstance(self.known_tenants, Iterable):
                raise ValueError("GatewayConfig.known_tenants must be a set of tenant names")
            object.__setattr__(self, "known_tenants", frozenset(self.known_tenants))
        from .queueing import ORDERING_POLICIES

        if self.ordering not in ORDERING_POLICIES:
            raise ValueError(f"GatewayConfig.ordering must be one of {sorted(ORDERING_POLICIES)}, "
                             f"got {self.ordering!r}")
