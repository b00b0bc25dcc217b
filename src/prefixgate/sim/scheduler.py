"""The simulator's synchronous core: vLLM v1's block pool and scheduler, step by step.

:class:`BlockPool` mirrors ``vllm/v1/core/block_pool.py`` (with ``FreeKVCacheBlockQueue``) and
:class:`SimScheduler` mirrors ``Scheduler.schedule`` / ``update_from_output`` together with the
single-group ``KVCacheManager`` they drive, for a decoder-only model with one full-attention KV
group, FCFS policy, no speculative decoding, no KV connector and synchronous scheduling (what
vLLM runs for such a model on CPU, and by default on GPU apart from async scheduling). Checked
against vLLM 0.26 and 0.32, whose behaviour here is the same:

* Block 0 is the null block; blocks ``1 .. num_blocks - 1`` are usable.
* Block ``i`` of a request is keyed by the chained hash of every token up to its end; only full
  blocks are cached, and the last prompt token is always recomputed.
* A block is registered (hash → block) when it is *allocated* for tokens scheduled this step,
  so a request scheduled later in the same step already hits it. Output blocks are registered
  the same way once full. Identical blocks are not de-duplicated.
* Freed blocks go back tail-first: a request's blocks are released in reverse, unhashed blocks
  to the front of the free queue, hashed ones to the back, so a finished prompt's tail is
  evicted before its head. Allocation pops the front and evicts the block's hash.
* Scheduling: running requests first, then waiting ones (FCFS), within ``max_num_seqs`` and a
  chunked-prefill budget of ``max_num_batched_tokens``. A waiting request is admitted only if
  its whole sequence fits (``scheduler_reserve_full_isl``). When a running request cannot get
  a block, the last running request is preempted (blocks freed, back to the head of the
  waiting queue, recomputed later); a step that preempted admits no waiting request.
* ``num_cached_tokens`` is the hit found when the request is first scheduled; prefix-cache
  queries and hits are counted then, never for resumed requests (as 0.32 does; 0.26 counts
  every lookup, also those of a request that then did not fit and is looked up again).

Nothing here awaits; :class:`~prefixgate.sim.SimEngine` is the async shell around it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ..cache_events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent
from ..keys import BlockHash, Namespace, block_hashes

__all__ = ["OUTPUT_TOKEN", "BlockPool", "SimRequest", "SimScheduler", "StepPlan"]

OUTPUT_TOKEN = 7
"""The token id every simulated output token has."""


class BlockPool:
    """KV blocks, their reference counts, the prefix-cache map and the LRU free queue.

    Invariants: block 0 (the null block) is never free nor handed out; a block is in the free
    queue iff its reference count is 0; ``hash -> block`` holds exactly the blocks whose hash is
    set, and a free block keeps its hash (it is an eviction candidate) until reallocated.

    Args:
        num_blocks: Blocks in the pool, the null block included (vLLM's ``num_gpu_blocks``).
        enable_caching: Whether full blocks are registered for prefix caching.

    Raises:
        ValueError: If ``num_blocks`` is below 2.
    """

    __slots__ = ("_cached", "_free", "_hash", "_ref", "enable_caching", "events", "evictions", "num_blocks")

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # Front = next to be reused. An OrderedDict gives O(1) pop-front, remove and both appends.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # A hash maps to one block id, or to an insertion-ordered dict of ids when duplicated.
        self._cached: dict[BlockHash, int | dict[int, None]] = {}
        self.evictions = 0
        self.events: list[CacheEvent] | None = None
        """Where cache events are recorded (``None``: they are not): a hash that no block holds
        any more is reported removed, as vLLM reports it; the scheduler reports stores."""

    @property
    def num_free(self) -> int:
        """Blocks no request holds, evictable cached blocks included."""
        return len(self._free)

    def ref_count(self, block: int) -> int:
        """How many requests hold ``block``."""
        return self._ref[block]

    def block_hash(self, block: int) -> BlockHash | None:
        """The hash ``block`` is registered under, or ``None``."""
        return self._hash[block]

    def free_queue(self) -> tuple[int, ...]:
        """Free block ids in eviction order (first is reused first)."""
        return tuple(self._free)

    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return sum(1 for h in self._hash if h is not None)

    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """The cached blocks matching the longest prefix of ``hashes[:max_blocks]``."""
        hits: list[int] = []
        get = self._cached.get
        for h in islice(hashes, max_blocks):
            entry = get(h)
            if entry is None:
                break
            hits.append(entry if type(entry) is int else next(iter(entry)))  # type: ignore[arg-type]
        return hits

    def count_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them takes a free block each)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        """Takes one more reference to each of ``blocks`` (prefix hits), unfreeing them."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Pops ``n`` blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks from the pool ({len(self._free)} free)")
        pop = self._free.popitem
        out = [pop(last=False)[0] for _ in range(n)]
        ref, hashes = self._ref, self._hash
        for b in out:
            if hashes[b] is not None:
                self._evict(b)
            ref[b] = 1
        return out

    def _evict(self, block: int) -> None:
        h = self._hash[block]
        self._hash[block] = None
        assert h is not None
        entry = self._cached[h]
        if type(entry) is int:
            del self._cached[h]
        else:
            del entry[block]  # type: ignore[union-attr]
            if not entry:
                del self._cached[h]
        self.evictions += 1
        if self.events is not None and h not in self._cached:
            self.events.append(BlocksRemoved((h,)))

    def cache_block(self, block: int, block_hash: BlockHash) -> None:
        """Registers the full ``block`` under ``block_hash`` (duplicates are kept, as vLLM does)."""
        self._hash[block] = block_hash
        entry = self._cached.get(block_hash)
        if entry is None:
            self._cached[block_hash] = block
        elif type(entry) is int:
            self._cached[block_hash] = {entry: None, block: None}
        else:
            entry[block] = None  # type: ignore[index]

    def free_blocks(self, ordered: list[int]) -> None:
        """Drops one reference to each block; those left unreferenced rejoin the free queue.

        ``ordered`` is in eviction priority (first evicted first): unhashed blocks go to the
        front of the queue in that order, hashed blocks to the back in that order.
        """
        ref, hashes, free = self._ref, self._hash, self._free
        first: list[int] = []
        for b in ordered:
            ref[b] -= 1
            if ref[b] == 0:
                if hashes[b] is None:
                    first.append(b)
                else:
                    free[b] = None
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forgets every cached hash, if no block is held; returns whether it did."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(CacheCleared())
        return True

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, free={len(self._free)}, "
                f"cached={len(self._cached)}, evictions={self.evictions})")


class Status(enum.Enum):
    """Where a simulated request is; it ends in ``FINISHED`` or ``ABORTED``."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class SimRequest:
    """One request's scheduling state (vLLM's ``Request``). Mutated only by :class:`SimScheduler`.

    Invariants: ``num_computed <= num_tokens == num_prompt_tokens + num_output``; ``blocks``
    cover at least ``num_computed`` tokens while running and are empty otherwise; the first
    ``num_cached_blocks`` of them are registered in the pool; ``hashes[i]`` keys block ``i`` of
    prompt + output.

    Args:
        request_id: The engine request id.
        prompt: The prompt token ids.
        max_tokens: Output tokens to produce.
        namespace: Model, LoRA and cache salt; the root of the block-hash chain.
        reads_cache: Whether the request looks up the prefix cache.
        block_size: Tokens per block, for hashing the prompt.
        hash_prompt: Whether to hash the prompt now (off when caching is disabled).
        media: ``(token position, identifier)`` of each media item: the blocks they fall in are
            keyed on them too, as vLLM keys them (:func:`~prefixgate.keys.media_extras`).
    """

    __slots__ = ("blocks", "finish_reason", "finished", "hashes", "max_tokens", "media", "namespace",
                 "num_cached_blocks", "num_cached_tokens", "num_computed", "num_output", "num_preemptions",
                 "num_prompt_tokens", "num_tokens", "prompt", "reads_cache", "request_id", "status",
                 "stream")

    def __init__(self, request_id: str, prompt: tuple[int, ...], max_tokens: int, namespace: Namespace,
                 *, reads_cache: bool = True, block_size: int = 16, hash_prompt: bool = True,
                 media: Sequence[tuple[int, str]] = ()) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.namespace = namespace
        self.reads_cache = reads_cache
        self.num_tokens = len(prompt)
        self.num_output = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        self.media = tuple(media)
        self.hashes: list[BlockHash] = (list(block_hashes(prompt, block_size, namespace, media=self.media))
                                        if hash_prompt else [])
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.status = Status.WAITING
        self.finished = False  # status is FINISHED or ABORTED (a plain slot: read every output)
        self.finish_reason: str | None = None
        self.stream: Any = None  # the async shell's per-request state

    def extend_hashes(self, num_blocks: int, block_size: int) -> None:
        """Hashes full blocks of prompt + output until ``num_blocks`` are known."""
        if len(self.hashes) < num_blocks:
            tokens = self.prompt + (OUTPUT_TOKEN,) * self.num_output
            self.hashes = list(block_hashes(tokens[: num_blocks * block_size], block_size, self.namespace,
                                            known=self.hashes, media=self.media))

    def __repr__(self) -> str:
        return (f"SimRequest({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={len(self.blocks)})")


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one scheduler step runs.

    Attributes:
        scheduled: ``(request, tokens)`` pairs in scheduling order (running, then admitted).
        prefill_tokens: Tokens of prompt (or recomputation) work this step.
        decode_seqs: Requests decoding one token this step.
        preempted: Requests preempted while scheduling this step.
        decode_context: Tokens of KV the decoding requests attend to (their lengths, summed).
        prefill_context: Attention work of the prefill chunks: per chunk, its tokens times the
            context length at its middle (token pairs), summed.
        new_requests: Requests that reached the engine since the previous step (vLLM's engine
            core takes each in before its next step: decodes it and hashes every block of its
            prompt, work that delays that step).
        new_prompt_tokens: Their prompt tokens, summed (cached or not).
        decode_distinct: ``decode_context`` counting each KV block once, however many of the
            decoding requests share it (a common prefix's blocks, read once per step).
    """

    scheduled: tuple[tuple[SimRequest, int], ...]
    prefill_tokens: int
    decode_seqs: int
    preempted: int
    decode_context: int = 0
    prefill_context: int = 0
    new_requests: int = 0
    new_prompt_tokens: int = 0
    decode_distinct: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimScheduler:
    """vLLM v1's FCFS scheduler and KV cache manager for one full-attention group.

    Invariants: ``running`` holds at most ``max_num_seqs`` requests, all holding blocks;
    ``waiting`` requests hold none; every block a live request holds has a reference from it.

    Args:
        block_size: Tokens per KV block.
        num_blocks: Blocks in the pool, the null block included.
        max_num_seqs: The most running requests.
        max_num_batched_tokens: The token budget of one step (chunked prefill).
        max_model_len: The longest prompt + output.
        enable_caching: Prefix caching on or off.
    """

    def __init__(self, *, block_size: int, num_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self.steps = 0
        self._arrived = self._arrived_tokens = 0  # requests in since the last step, and their tokens

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, request: SimRequest) -> None:
        """Queues ``request`` at the back of the waiting queue."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._arrived += 1
        self._arrived_tokens += request.num_prompt_tokens

    def abort(self, request_id: str) -> SimRequest | None:
        """Removes a live request and frees its blocks; ``None`` if it is not live."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free(request)
        request.status = Status.ABORTED
        request.finished = True
        request.finish_reason = "abort"
        return request

    def has_work(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.running or self.waiting)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block if no request holds blocks (vLLM refuses otherwise)."""
        return self.pool.reset()

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Decides one step: allocates blocks, registers them, preempts if blocks run out."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        running = self.running
        bs, max_len, caching = self.block_size, self.max_model_len, self.enable_caching
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed
            n = request.num_tokens - computed
            if n > budget:
                n = budget
            if n > max_len - computed - 1:
                n = max_len - computed - 1
            if n <= 0:
                i += 1
                continue
            end = computed + n  # fast path (most decodes): no new block, nothing to register
            if end <= len(request.blocks) * bs and not (caching and end // bs > request.num_cached_blocks):
                scheduled.append((request, n))
                budget -= n
                i += 1
                continue
            while not self._allocate(request, n):
                victim = running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break
            scheduled.append((request, n))
            budget -= n
            i += 1
        new_requests, new_prompt_tokens = self._arrived, self._arrived_tokens
        self._arrived = self._arrived_tokens = 0
        if not preempted:
            waiting = self.waiting
            while budget > 0 and waiting and len(running) < self.max_num_seqs:
                request = waiting[0]
                hits = self._lookup(request)
                hit_tokens = len(hits) * self.block_size
                if request.num_preemptions == 0:
                    request.num_cached_tokens = hit_tokens
                n = min(request.num_tokens - hit_tokens, budget)
                if not self._allocate(request, n, hits, hit_tokens, full_must_fit=True):
                    break
                if request.reads_cache and self.enable_caching and request.num_preemptions == 0:
                    self.prefix_queries += request.num_tokens
                    self.prefix_hits += hit_tokens
                waiting.popleft()
                running.append(request)
                request.status = Status.RUNNING
                request.num_computed = hit_tokens
                scheduled.append((request, n))
                budget -= n
        prefill = decode = decode_context = prefill_context = shared_blocks = 0
        seen: set[int] = set()
        for request, n in scheduled:
            if n == 1 and request.num_output and request.num_computed == request.num_tokens - 1:
                decode += 1
                decode_context += request.num_tokens
                before = len(seen)
                seen.update(request.blocks)
                shared_blocks += len(request.blocks) - (len(seen) - before)
            else:
                prefill += n
                prefill_context += n * (request.num_computed + n // 2)
            request.num_computed += n
        return StepPlan(tuple(scheduled), prefill, decode, preempted, decode_context, prefill_context,
                        new_requests, new_prompt_tokens,
                        decode_context - shared_blocks * self.block_size)

    def update(self, plan: StepPlan) -> list[SimRequest]:
        """Applies a finished step: samples one token per request whose prefill is complete.

        Returns:
            The requests that got a token, in scheduling order; finished ones have freed their
            blocks (in that order) and left ``running``.
        """
        out: list[SimRequest] = []
        any_finished = False
        max_model_len = self.max_model_len
        for request, _ in plan.scheduled:
            if request.status is not Status.RUNNING or request.num_computed < request.num_tokens:
                continue  # aborted meanwhile, or a partial prefill chunk (no token sampled)
            request.num_output += 1
            request.num_tokens += 1
            if request.num_output >= request.max_tokens or request.num_tokens >= max_model_len:
                request.status = Status.FINISHED
                request.finished = True
                request.finish_reason = "length"
                self._free(request)
                del self.requests[request.request_id]
                any_finished = True
            out.append(request)
        if any_finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        self.steps += 1
        return out

    # -- the KV cache manager -----------------------------------------------------------------

    def _lookup(self, request: SimRequest) -> list[int]:
        if not (self.enable_caching and request.reads_cache):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is recomputed
        request.extend_hashes(max_blocks, self.block_size)
        return self.pool.longest_hit(request.hashes, max_blocks)

    def _allocate(self, request: SimRequest, n: int, hits: list[int] | None = None, hit_tokens: int = 0,
                  *, full_must_fit: bool = False) -> bool:
        """``KVCacheManager.allocate_slots``: slots for ``n`` more tokens, or ``False``."""
        bs, pool = self.block_size, self.pool
        computed = request.num_computed + hit_tokens
        have = len(request.blocks) + (len(hits) if hits else 0)
        evictable = pool.count_evictable(hits) if hits else 0
        free = pool.num_free
        if full_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if max(_cdiv(full, bs) - have, 0) + evictable > free:
                return False
        end = min(computed + n, self.max_model_len)
        num_new = _cdiv(end, bs) - have
        if max(num_new, 0) + evictable > free:
            return False
        if hits:
            pool.touch(hits)
            request.blocks = list(hits)
            request.num_cached_blocks = len(hits)
        if num_new > 0:
            request.blocks += pool.get_new_blocks(num_new)
        if self.enable_caching:
            self._cache_blocks(request, min(computed + n, request.num_tokens))
        return True

    def _cache_blocks(self, request: SimRequest, num_tokens: int) -> None:
        full = num_tokens // self.block_size
        start = request.num_cached_blocks
        if start >= full:
            return
        request.extend_hashes(full, self.block_size)
        cache, blocks, hashes = self.pool.cache_block, request.blocks, request.hashes
        for i in range(start, full):
            cache(blocks[i], hashes[i])
        request.num_cached_blocks = full
        events = self.pool.events
        if events is not None:
            size = self.block_size
            tokens = (request.prompt + (OUTPUT_TOKEN,) * request.num_output)[start * size: full * size]
            namespace = request.namespace
            events.append(BlocksStored(tuple(hashes[start:full]), hashes[start - 1] if start else None,
                                       tokens, namespace.tenant, namespace.lora,
                                       media=bool(request.media)))

    def _free(self, request: SimRequest) -> None:
        if request.blocks:
            self.pool.free_blocks(request.blocks[::-1])  # tail first: evicted first
            request.blocks = []
        request.num_cached_blocks = 0

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.status = Status.PREEMPTED
        request.num_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def __repr__(self) -> str:
        return (f"SimScheduler(running={len(self.running)}, waiting={len(self.waiting)}, "
                f"free={self.pool.num_free}, steps={self.steps}, preemptions={self.num_preemptions})")
