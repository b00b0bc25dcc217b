"""What ``RemoteVllm``'s completion streams cost the gateway's process: its aiohttp client
against the httpx one it used before (the same loop over ``aiter_lines``, kept here as the
baseline arm).

A stand-in server in a process of its own answers each ``/v1/completions`` with 32 SSE events
10 ms apart (vLLM's stream shape), so vLLM's own CPU is out of the picture; this process runs N
streams at once (after a warm-up of 64) and measures its own CPU time (``time.process_time``).
The ``aiohttp`` arm is ``RemoteVllm.generate`` itself. Arms alternate within each repeat.
Prints a table, writes JSON and a PNG::

    .venv/bin/python -m benchmarks.remote_client                   # 128 and 512 streams, 5 repeats
    .venv/bin/python -m benchmarks.remote_client --streams 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .servers import free_port

RESULTS = Path(__file__).resolve().parent / "results"
EVENTS = 32
ARMS = ("httpx", "aiohttp")


async def _serve(port: int) -> None:
    """The stand-in server: every request gets ``EVENTS`` SSE events 10 ms apart, then usage
    and ``[DONE]``, over chunked HTTP/1.1 keep-alive connections."""

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(EVENTS):
                    reason = b'"length"' if i == EVENTS - 1 else b"null"
                    writer.write(chunk(b'data: {"choices":[{"index":0,"text":"a","token_ids":[7],'
                                       b'"finish_reason":%s}]}\n\n' % reason))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(chunk(b'data: {"choices":[],"usage":{"prompt_tokens":576,'
                                   b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n'))
                writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=8192)
    async with server:
        await server.serve_forever()


async def _httpx_stream(client: Any, body: dict[str, Any]) -> int:
    """The stream loop ``RemoteVllm.generate`` ran over httpx until aiohttp replaced it."""
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            for choice in json.loads(data).get("choices") or ():
                ids.extend(choice.get("token_ids") or ())
    return len(ids)


async def _measure(url: str, arm: str, streams: int) -> dict[str, float]:
    from prefixgate import RemoteVllm
    from prefixgate.engine import EngineRequest

    ids = list(range(576))
    count = iter(range(10 ** 9))
    if arm == "httpx":
        import httpx

        client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30, read=None),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        body = {"model": "m", "prompt": ids, "stream": True, "max_tokens": EVENTS}

        async def one() -> int:
            return await _httpx_stream(client, body)

        async def close() -> None:
            await client.aclose()
    else:
        from prefixgate.remote import http_session

        engine = RemoteVllm(url, http_session(30.0), model="m", block_size=16, num_blocks=100_000,
                            max_model_len=8192, tokenizer=None)  # type: ignore[arg-type]

        async def one() -> int:
            n = 0
            async for out in engine.generate(EngineRequest(f"r{next(count)}", ids, {"max_tokens": EVENTS})):
                n = len(out.outputs[0].token_ids)
            return n

        async def close() -> None:
            await engine.close()

    try:
        await asyncio.gather(*(one() for _ in range(64)))  # warm: connections, imports
        cpu, wall = time.process_time(), time.monotonic()
        got = await asyncio.gather(*(one() for _ in range(streams)))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        await close()
    if any(n != EVENTS for n in got):
        raise RuntimeError(f"{arm}: a stream lost tokens ({sorted(set(got))})")
    return {"cpu_s": cpu, "wall_s": wall, "cpu_ms_per_stream": 1000 * cpu / streams}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="RemoteVllm's stream cost: aiohttp against httpx")
    p.add_argument("--streams", type=int, nargs="+", default=[128, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=RESULTS / "remote-client.json")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the stand-in server's port
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.remote_client", "--serve", str(port)])
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(1.0)
        for repeat in range(args.repeats):
            for n in args.streams:
                for arm in ARMS:  # interleaved within each repeat
                    got = asyncio.run(_measure(f"http://127.0.0.1:{port}", arm, n))
                    rows.append({"streams": n, "client": arm, "repeat": repeat, **got})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    lines = ["| streams at once | client | CPU ms per stream (median) | per repeat | × httpx |",
             "|---:|---|---:|---|---:|"]
    med: dict[tuple[int, str], float] = {}
    for n in args.streams:
        for arm in ARMS:
            vals = [r["cpu_ms_per_stream"] for r in rows if r["streams"] == n and r["client"] == arm]
            med[n, arm] = statistics.median(vals)
            per = " / ".join(f"{v:.2f}" for v in vals)
            lines.append(f"| {n} | {arm} | {med[n, arm]:.2f} | {per} | {med[n, arm] / med[n, 'httpx']:.2f} |")
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"events_per_stream": EVENTS, "rows": rows}, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for arm in ARMS:
        ax.plot(args.streams, [med[n, arm] for n in args.streams], marker="o", label=arm)
    ax.set_xlabel("streams at once")
    ax.set_ylabel("gateway CPU ms per stream")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
