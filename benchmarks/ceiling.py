"""The prefix-cache ceiling of a trace, and the headline ratio κ.

With block size ``b``, request *i* of length ``L_i`` can be served at most
``b·⌊min(LCP_i, L_i − 1)/b⌋`` tokens from cache, where ``LCP_i`` is its longest common prefix
with *any* earlier prompt (an unbounded cache, perfect order). Summed over the trace that gives
the best possible token hit rate ``H* = Σ hit_i / Σ L_i`` and the least prefill any engine must
compute, ``U_b = Σ (L_i − hit_i)``. κ measures how much of the avoidable prefill a run removed:
``κ = (C_B1 − C_L) / (C_B1 − U_b)``, 1 at the limit, 0 for no better than bare vLLM.

Only whole blocks count, so ``⌊LCP_i/b⌋`` is the number of leading full blocks request *i*
shares with some earlier prompt. That is a walk down a trie of blocks; the trie is stored as a
set of prefix digests (xxh3-128 of every block-aligned prefix, fed incrementally), so the whole
trace costs O(Σ L_i) time and O(Σ L_i / b) memory: 10k prompts × 8k tokens is 5M digests at
b = 16. Exact token-level LCPs (a sorted-neighbour scan) are never needed.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

__all__ = ["Ceiling", "best_hit_tokens", "ceiling", "kappa"]


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The best any cache and order can do on a trace.

    Attributes:
        block_size: The engine's KV block size in tokens.
        prompt_tokens: ``Σ L_i``.
        hit_tokens: ``Σ hit_i``, the most tokens that can be served from cache.
        per_request: ``hit_i`` for each request, in trace order.
    """

    block_size: int
    prompt_tokens: int
    hit_tokens: int
    per_request: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        """``H* = Σ hit_i / Σ L_i`` (0 for an empty trace)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def min_prefill_tokens(self) -> int:
        """``U_b = Σ (L_i − hit_i)``: prompt tokens every engine has to compute."""
        return self.prompt_tokens - self.hit_tokens

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready summary (without the per-request list)."""
        return {"hit_rate": self.hit_rate, "min_prefill_tokens": self.min_prefill_tokens,
                "hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens,
                "block_size": self.block_size}

    def __repr__(self) -> str:
        return (f"Ceiling(b={self.block_size}, requests={len(self.per_request)}, "
                f"hit_rate={self.hit_rate:.3f}, min_prefill={self.min_prefill_tokens})")


def _token_bytes(ids: Sequence[int]) -> bytes:
    tobytes = getattr(ids, "tobytes", None)
    if tobytes is not None and getattr(ids, "dtype", None) is not None:  # numpy: no per-item work
        return ids.astype("<i8").tobytes()  # type: ignore[attr-defined]
    return array("q", ids).tobytes()


def best_hit_tokens(prompts: Iterable[Sequence[int]], block_size: int, *,
                    namespaces: Iterable[str | None] | None = None) -> list[int]:
    """``hit_i = b·⌊min(LCP_i, L_i − 1)/b⌋`` for each prompt, in order.

    Args:
        prompts: Token id sequences in arrival order.
        block_size: ``b``.
        namespaces: Per prompt, the cache namespace (tenant salt); prompts only share with
            earlier prompts of the same namespace. ``None`` puts all in one.

    Returns:
        The best-case cached tokens of each prompt.

    Raises:
        ValueError: If ``block_size`` is not positive.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    width = 8 * block_size
    seen: set[bytes] = set()
    out: list[int] = []
    names = iter(namespaces) if namespaces is not None else None
    for ids in prompts:
        namespace = next(names) if names is not None else None
        data = _token_bytes(ids)
        length = len(data) // 8
        cap = max(0, (length - 1) // block_size)  # the last prompt token is always computed
        hasher = xxhash.xxh3_128()
        if namespace is not None:
            hasher.update(namespace.encode("utf-8", "surrogatepass") + b"\x00")
        view = memoryview(data)
        hits = 0
        matching = True
        for k in range(length // block_size):
            hasher.update(view[k * width:(k + 1) * width])
            key = hasher.digest()  # the digest of the whole prefix up to block k's end
            if matching and k < cap and key in seen:
                hits += 1
            else:
                matching = False
                seen.add(key)
        out.append(hits * block_size)
    return out


def ceiling(prompts: Iterable[Sequence[int]], block_size: int, *,
            namespaces: Iterable[str | None] | None = None) -> Ceiling:
    """The ceiling of a trace at ``block_size``; see :func:`best_hit_tokens`.

    For W3, pass the *clean* prompts: the ceiling is the sharing the user meant.
    """
    materialized = [p for p in prompts]
    hits = best_hit_tokens(materialized, block_size, namespaces=namespaces)
    total = sum(len(p) for p in materialized)
    return Ceiling(block_size, total, sum(hits), tuple(hits))


def kappa(prefill_b1: float, prefill_l: float, min_prefill: float) -> float | None:
    """``κ = (C_B1 − C_L) / (C_B1 − U_b)``: the share of avoidable prefill that L removed.

    Args:
        prefill_b1: ``C_B1``, prompt tokens bare vLLM computed.
        prefill_l: ``C_L``, prompt tokens computed with prefixgate in front.
        min_prefill: ``U_b`` from :class:`Ceiling`.

    Returns:
        κ. When nothing was avoidable (bare vLLM already at the minimum, as with a burst of
        short shared prefixes), κ is 1.0 if L is at the minimum too and ``None`` otherwise (the
        ratio is undefined; compare the prefill tokens directly).
    """
    avoidable = prefill_b1 - min_prefill
    if avoidable <= 0:
        return 1.0 if prefill_l <= min_prefill else None
    return (prefill_b1 - prefill_l) / avoidable
