"""Stage 2: key each request on a chain of block hashes, exactly at the engine's block size.

vLLM caches KV in full blocks of ``block_size`` tokens (16 on CUDA, 128 on the CPU backend; a
*runtime* fact) and identifies block *i* by ``hash(hash of block i-1, tokens of block i)``.
Two prompts share cached block *i* iff they agree on every token up to the end of block *i*.
We mirror that chain with xxh3 so the gateway can reason about cache hits without asking the
engine: equal chains here mean equal blocks there. The hash values need not equal vLLM's; the
block boundaries must.

The first block's parent is a namespace root derived from (model, LoRA, tenant) and a seed, so
the same text under another model, adapter or tenant never collides. Keys are computed once, at
ingress, and carried on the ticket; nothing downstream re-tokenizes or re-hashes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import xxhash

__all__ = ["BlockHash", "Namespace", "block_hashes", "cacheable_blocks"]

BlockHash = NewType("BlockHash", int)
"""A 64-bit xxh3 digest identifying one full block and, through its parent, every block before it."""

_TOKEN_WIDTH = 4  # bytes per token id, little-endian unsigned; vocabularies are far below 2**32


@dataclass(frozen=True, slots=True)
class Namespace:
    """What must match, besides tokens, for two requests to share cached KV.

    Attributes:
        model: The served model's name or path.
        lora: The LoRA adapter's name, or ``None`` for the base model.
        tenant: The tenant whose requests may share cache with each other, or ``None`` for the
            shared namespace. vLLM is given a matching ``cache_salt``.
    """

    model: str
    lora: str | None = None
    tenant: str | None = None

    def root(self, seed: int = 0) -> BlockHash:
        """The parent hash of the first block: a digest of the namespace fields and ``seed``."""
        parts = (self.model, self.lora or "", self.tenant or "")
        data = "\x1f".join(parts).encode("utf-8", "surrogatepass")
        return BlockHash(xxhash.xxh3_64_intdigest(data, seed))


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt can ever be served from cache.

    vLLM only caches full blocks and always recomputes the last prompt token (it needs its
    logits), so a prompt of ``L`` tokens can hit at most ``(L - 1) // block_size`` blocks.
    """
    return max(0, num_tokens - 1) // block_size


def block_hashes(
    token_ids: Sequence[int], block_size: int, namespace: Namespace, *, seed: int = 0,
    known: Sequence[BlockHash] = (),
) -> tuple[BlockHash, ...]:
    """Hashes every full block of ``token_ids`` into a chain.

    Each digest is ``xxh3_64(parent_digest as 8 LE bytes + token ids as 4-byte LE, seed)``.

    Args:
        token_ids: The token ids (a prompt, or a prompt followed by its output).
        block_size: The engine's runtime KV block size.
        namespace: Model, LoRA and tenant; folded into the first block's parent.
        seed: A seed for every digest (config ``key_seed``).
        known: Hashes already computed for the leading blocks of ``token_ids`` (a prompt's,
            when extending the chain over its output); they are reused, not recomputed.

    Returns:
        One hash per *full* block, in order; a trailing partial block gets none.

    Raises:
        ValueError: If ``block_size`` is not positive or a token id is outside ``[0, 2**32)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    skip = len(known)
    try:
        packed = array("I", token_ids[skip * block_size :])
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if packed.itemsize != _TOKEN_WIDTH:  # pragma: no cover - no such platform is supported
        raise RuntimeError("array('I') is not 4 bytes wide on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    data = packed.tobytes()
    stride = block_size * _TOKEN_WIDTH
    digest = xxhash.xxh3_64_intdigest
    parent = known[-1] if known else namespace.root(seed)
    out: list[BlockHash] = list(known)
    for start in range(0, (len(token_ids) // block_size - skip) * stride, stride):
        parent = BlockHash(digest(parent.to_bytes(8, "little") + data[start : start + stride], seed))
        out.append(parent)
    return tuple(out)
