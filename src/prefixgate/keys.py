"""Stage 2: key each request on a chain of block hashes, exactly at the engine's block size.

vLLM caches KV in full blocks of ``block_size`` tokens (16 on CUDA, 128 on the CPU backend; a
*runtime* fact) and identifies block *i* by ``hash(hash of block i-1, tokens of block i)``.
Two prompts share cached block *i* iff they agree on every token up to the end of block *i*.
We mirror that chain with xxh3 so the gateway can reason about cache hits without asking the
engine: equal chains here mean equal blocks there. The hash values need not equal vLLM's; the
block boundaries must.

Block *i*'s key is ``xxh3_64(token ids of block i as 4-byte little-endian, seed=key of block
i-1)``; the first block's parent is a namespace root derived from (model, LoRA, tenant) and the
configured seed, so the same text under another model, adapter or tenant never collides. Keys
are computed once, at ingress, and carried on the ticket; nothing downstream re-tokenizes or
re-hashes. Because a key stands for its whole prefix, two chains agree on key *i* iff they agree
on every key before it: the longest common prefix of two chains is found by binary search.

A multimodal prompt's media items are folded in as vLLM folds them: vLLM's
``generate_block_hash_extra_keys`` (``vllm/v1/core/kv_cache_utils.py``) adds ``("mm", mm_hash,
offset in block)`` to each block that an item's placeholder tokens fall in. Here the block
holding an item's position is hashed over its tokens followed by the item's 16-byte identifier
and its 4-byte offset in the block (:func:`media_extras`). Through the chain every later block
differs too, so prompts with equal text and other media share only the blocks before the first
item's block.

Hot path: packing token ids is one C call, hashing one C call per block. :class:`ChainCache`
skips even that for the blocks a prompt shares with a recent sibling (same namespace and first
block): it compares packed bytes (a ``memcmp``) and reuses the sibling's keys, the same ``int``
objects, so later tuple comparisons of sibling chains are pointer checks.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NewType

import xxhash

__all__ = ["BlockHash", "ChainCache", "Namespace", "block_hashes", "cacheable_blocks", "chain_hashes",
           "common_prefix", "media_extras", "media_positions", "pack_tokens", "resident_prefix"]

BlockHash = NewType("BlockHash", int)
"""A 64-bit xxh3 digest identifying one full block and, through its parent, every block before it."""

_TOKEN_WIDTH = 4  # bytes per token id, little-endian unsigned; vocabularies are far below 2**32
_digest = xxhash.xxh3_64_intdigest


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
        """The parent hash of the first block: a digest of the namespace fields and ``seed``.

        Each field is written with its length (and ``None`` apart from the empty string), so no
        two distinct namespaces encode alike whatever characters their fields hold.
        """
        data = bytearray()
        for part in (self.model, self.lora, self.tenant):
            if part is None:
                data += b"\xff\xff\xff\xff"
                continue
            raw = part.encode("utf-8", "surrogatepass")
            data += len(raw).to_bytes(4, "little") + raw
        return BlockHash(_digest(bytes(data), seed))


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt can ever be served from cache.

    vLLM only caches full blocks and always recomputes the last prompt token (it needs its
    logits), so a prompt of ``L`` tokens can hit at most ``(L - 1) // block_size`` blocks.
    """
    return max(0, num_tokens - 1) // block_size


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers, in one C call.

    Raises:
        ValueError: If a token id is not an integer in ``[0, 2**32)``.
    """
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if packed.itemsize != _TOKEN_WIDTH:  # pragma: no cover - no such platform is supported
        raise RuntimeError("array('I') is not 4 bytes wide on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def media_extras(media: Sequence[tuple[int, str]], block_size: int, *, start: int = 0) -> dict[int, bytes]:
    """The extra bytes each block's key is hashed over, for a prompt's media items.

    Args:
        media: ``(token position, identifier)`` per item; the identifier is a 32-digit hex
            xxh3-128 digest (:class:`~prefixgate.engine.Media`).
        block_size: Tokens per block.
        start: Leave out blocks before this one and number the rest from it (for
            :func:`chain_hashes` with ``start`` blocks already known).

    Returns:
        Block index -> the identifiers and in-block offsets of the items in that block, in order.

    Raises:
        ValueError: If a position is negative or an identifier is not 32 hex digits.
    """
    extras: dict[int, bytes] = {}
    for position, identifier in media:
        if position < 0:
            raise ValueError(f"media position must be >= 0, got {position}")
        block, offset = divmod(position, block_size)
        if block < start:
            continue
        block -= start
        extras[block] = extras.get(block, b"") + bytes.fromhex(identifier) + offset.to_bytes(4, "little")
    return extras


def media_positions(text: str, token_ids: Sequence[int], chars: Sequence[int],
                    encode: Callable[[str, bool], Sequence[int]],
                    add_special_tokens: bool) -> tuple[int, ...]:
    """The token position of each media item of a rendered prompt, from its character offset.

    An item at character ``c`` sits at the first token where the prompt's tokens and those of
    ``text[:c]`` part: every token before it spells only text before the item.

    Args:
        text: The rendered prompt.
        token_ids: Its token ids.
        chars: Each media item's character offset in ``text``.
        encode: The tokenizer call that gave ``token_ids``.
        add_special_tokens: As given to ``encode`` for ``text``.
    """
    out: list[int] = []
    for c in chars:
        prefix = list(encode(text[:c], add_special_tokens)) if c else []
        n = min(len(prefix), len(token_ids))
        i = 0
        while i < n and prefix[i] == token_ids[i]:
            i += 1
        out.append(i)
    return tuple(out)


def chain_hashes(data: bytes, block_size: int, parent: int, *, start: int = 0,
                 stop: int | None = None, extras: Mapping[int, bytes] | None = None) -> list[BlockHash]:
    """Keys of the full blocks ``start, start+1, …`` of packed tokens ``data``.

    Args:
        data: Packed token ids (:func:`pack_tokens`).
        block_size: Tokens per block.
        parent: The key of block ``start - 1``, or the namespace root when ``start`` is 0.
        start: The first block to hash.
        stop: One past the last block to hash; every full block when ``None``.
        extras: Bytes hashed after a block's tokens, by block index (:func:`media_extras`).
    """
    stride = block_size * _TOKEN_WIDTH
    full = len(data) // stride
    stop = full if stop is None else min(stop, full)
    out: list[BlockHash] = []
    append = out.append
    digest = _digest
    if extras:
        for block in range(start, stop):
            offset = block * stride
            parent = digest(data[offset : offset + stride] + extras.get(block, b""), parent)
            append(parent)  # type: ignore[arg-type]
        return out
    for offset in range(start * stride, stop * stride, stride):
        parent = digest(data[offset : offset + stride], parent)
        append(parent)  # type: ignore[arg-type]
    return out


def block_hashes(
    token_ids: Sequence[int], block_size: int, namespace: Namespace, *, seed: int = 0,
    known: Sequence[BlockHash] = (), media: Sequence[tuple[int, str]] = (),
) -> tuple[BlockHash, ...]:
    """Hashes every full block of ``token_ids`` into a chain.

    Args:
        token_ids: The token ids (a prompt, or a prompt followed by its output).
        block_size: The engine's runtime KV block size.
        namespace: Model, LoRA and tenant; folded into the first block's parent.
        seed: The seed of the namespace root (config ``key_seed``).
        known: Keys already computed for the leading blocks of ``token_ids`` (a prompt's, when
            extending the chain over its output); they are reused, not recomputed.
        media: ``(token position, identifier)`` of each media item (:func:`media_extras`).

    Returns:
        One hash per *full* block, in order; a trailing partial block gets none.

    Raises:
        ValueError: If ``block_size`` is not positive or a token id is outside ``[0, 2**32)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    skip = len(known)
    data = pack_tokens(token_ids[skip * block_size :])
    parent = known[-1] if known else namespace.root(seed)
    extras = media_extras(media, block_size, start=skip)
    return (*known, *chain_hashes(data, block_size, parent, extras=extras))


def common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash], limit: int | None = None) -> int:
    """How many leading keys two chains share (at most ``limit``), by binary search.

    Keys stand for their whole prefix, so ``a[i] == b[i]`` implies ``a[j] == b[j]`` for ``j < i``.
    """
    hi = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    if hi == 0 or a[0] != b[0]:
        return 0
    if a[hi - 1] == b[hi - 1]:
        return hi
    lo = 1  # a[lo-1] == b[lo-1] and a[hi-1] != b[hi-1]
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def resident_prefix(chain: Sequence[BlockHash], contains: Callable[[BlockHash], bool],
                    limit: int | None = None) -> int:
    """How many leading keys of ``chain`` (at most ``limit``) satisfy ``contains``, by binary
    search. Requires a prefix-closed set: if a key is in it, so is every key before it in its
    chain (true of every set of whole-prefix keys the gateway keeps)."""
    hi = len(chain) if limit is None else min(len(chain), limit)
    if hi == 0 or not contains(chain[0]):
        return 0
    if contains(chain[hi - 1]):
        return hi
    lo = 1
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if contains(chain[mid - 1]):
            lo = mid
        else:
            hi = mid
    return lo


class ChainCache:
    """Recent prompts' packed tokens and keys, by (namespace root, first block), so a sibling
    reuses the keys of the blocks it shares instead of hashing them again.

    Thread-safe: ingress workers share one cache; a lock guards the index, not the hashing.

    Invariant: at most ``max_entries`` entries; an entry's keys are exactly the chain of its
    packed tokens under its root.

    Args:
        block_size: Tokens per block.
        max_entries: Distinct (namespace, first block) entries kept, least recently used evicted.

    Raises:
        ValueError: If ``block_size`` or ``max_entries`` is not positive.
    """

    def __init__(self, block_size: int, max_entries: int = 4096) -> None:
        if block_size <= 0 or max_entries <= 0:
            raise ValueError(f"block_size and max_entries must be positive, got {block_size}, "
                             f"{max_entries}")
        self.block_size = block_size
        self.max_entries = max_entries
        self._stride = block_size * _TOKEN_WIDTH
        self._entries: OrderedDict[tuple[int, bytes], tuple[bytes, tuple[BlockHash, ...]]] = OrderedDict()
        self._lock = threading.Lock()
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def chain(self, data: bytes, root: BlockHash,
              extras: Mapping[int, bytes] | None = None) -> tuple[BlockHash, ...]:
        """The key chain of packed tokens ``data`` under ``root``, reusing a sibling's keys.

        A prompt with media (``extras``, :func:`media_extras`) is hashed in full, and not kept.
        """
        stride = self._stride
        full = len(data) // stride
        if full == 0:
            return ()
        if extras:
            return tuple(chain_hashes(data, self.block_size, root, extras=extras))
        key = (root, data[:stride])
        with self._lock:
            entry = self._entries.get(key)
        shared = 0
        keys: tuple[BlockHash, ...] = ()
        if entry is not None:
            other, keys = entry
            shared = _shared_blocks(data, other, stride, min(full, len(keys)))
        if shared == full:
            chain = keys[:full]
        else:
            parent = keys[shared - 1] if shared else root
            chain = (*keys[:shared], *chain_hashes(data, self.block_size, parent, start=shared))
        self.reused_blocks += shared
        self.hashed_blocks += full - shared
        with self._lock:
            self._entries[key] = (data, chain)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return chain

    def __repr__(self) -> str:
        return (f"ChainCache(entries={len(self._entries)}/{self.max_entries}, "
                f"reused={self.reused_blocks}, hashed={self.hashed_blocks})")


def _shared_blocks(a: bytes, b: bytes, stride: int, limit: int) -> int:
    """Leading full blocks (at most ``limit``) on which packed tokens ``a`` and ``b`` agree;
    the first block is known to agree. Binary search over ``memcmp``s."""
    if a[: limit * stride] == b[: limit * stride]:
        return limit
    lo, hi = 1, limit  # blocks [0, lo) agree; [0, hi) do not
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if a[: mid * stride] == b[: mid * stride]:
            lo = mid
        else:
            hi = mid
    return lo
