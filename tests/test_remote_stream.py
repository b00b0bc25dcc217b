"""``RemoteVllm``'s HTTP client against stand-in servers that misbehave in ways vLLM servers can:
events split across reads or packed into one, a stream cut mid-way, a refusal, a server that
accepts and never answers. The happy path over real vLLM is ``test_remote.py``; these need no
vLLM (the ``remote`` extra's aiohttp only).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from prefixgate import EngineDead, EngineError, Overloaded, RemoteVllm
from prefixgate.engine import EngineRequest
from prefixgate.testing import ByteTokenizer

aiohttp = pytest.importorskip("aiohttp")

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def token(i: int, reason: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": f"<{i}>", "token_ids": [i], "finish_reason": reason}]})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}})


async def read_request(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return dict(json.loads(await reader.readexactly(length)))


def chunked(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def start_stream(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")


@asynccontextmanager
async def remote(handler: Handler, **kwargs: Any) -> AsyncIterator[RemoteVllm]:
    """A ``RemoteVllm`` over a stand-in server that runs ``handler`` for each connection."""

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None, connect=5))
    engine = RemoteVllm(f"http://127.0.0.1:{port}", session, model="m", block_size=4, num_blocks=64,
                        max_model_len=512, tokenizer=ByteTokenizer(), **kwargs)
    try:
        yield engine
    finally:
        await engine.close()
        server.close()
        await server.wait_closed()


def request(rid: str = "r1") -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3, 4, 5, 6, 7, 8], {"max_tokens": 3})


async def outputs(engine: RemoteVllm, rid: str = "r1") -> list[Any]:
    return [out async for out in engine.generate(request(rid))]


async def test_events_split_across_reads_or_packed_into_one_are_read_whole() -> None:
    body = token(1) + token(2) + token(3, "length") + USAGE + b"data: [DONE]\n\n"
    sent: list[dict[str, Any]] = []

    async def byte_by_byte(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent.append(await read_request(reader))
        start_stream(writer)
        for b in body:  # one byte a chunk, each flushed: every event split over many reads
            chunked(writer, bytes([b]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def all_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        start_stream(writer)
        chunked(writer, body)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    for handler in (byte_by_byte, all_at_once):
        async with remote(handler) as engine:
            outs = await outputs(engine)
        last = outs[-1]
        assert [o.finished for o in outs] == [False, False, True]
        assert tuple(last.outputs[0].token_ids) == (1, 2, 3) and last.outputs[0].text == "<1><2><3>"
        assert last.outputs[0].finish_reason == "length" and last.num_cached_tokens == 4
    assert sent[0]["prompt"] == [1, 2, 3, 4, 5, 6, 7, 8] and sent[0]["stream"] is True


async def test_a_stream_cut_mid_way_is_engine_dead_and_says_so() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        start_stream(writer)
        chunked(writer, token(1))
        await writer.drain()
        writer.transport.abort()  # no terminating chunk: the server died

    async with remote(cut) as engine:
        got: list[Any] = []
        with pytest.raises(EngineDead, match="mid-stream"):
            async for out in engine.generate(request()):
                got.append(out)
    assert len(got) == 1 and not got[0].finished


async def test_a_stream_that_ends_without_a_finish_reason_is_an_engine_error() -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        start_stream(writer)
        chunked(writer, token(1) + b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with remote(short) as engine:
        with pytest.raises(EngineError, match="without a finish reason"):
            await outputs(engine)


async def test_a_refusal_is_typed_with_the_servers_retry_after() -> None:
    async def busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = json.dumps({"error": {"message": "too many requests"}}).encode()
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                     b"retry-after: 7\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async with remote(busy) as engine:
        with pytest.raises(Overloaded, match="too many requests") as refused:
            await outputs(engine)
    assert refused.value.retry_after == 7.0


async def test_abort_mid_stream_ends_it_with_an_aborted_last_output_and_the_server_sees_it_go() -> None:
    gone = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        start_stream(writer)
        i = 0
        while not reader.at_eof():
            chunked(writer, token(i))
            await writer.drain()
            i += 1
            await asyncio.sleep(0.01)
        gone.set()

    async with remote(endless) as engine:
        got: list[Any] = []
        async for out in engine.generate(request()):
            got.append(out)
            if len(got) == 3:
                await engine.abort("r1")
        await asyncio.wait_for(gone.wait(), 10)  # a hang guard, not a timing claim
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort"
    assert len(got[-1].outputs[0].token_ids) >= 3
    await engine.abort("r1")  # finished: a no-op


async def test_a_server_that_accepts_and_never_answers_fails_its_health_check() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(3600)

    async with remote(silent, timeout=0.2, unhealthy_after=1) as engine:
        heard: list[bool] = []
        engine.watch_health(heard.append)
        assert await asyncio.wait_for(engine.check(), 10) is False  # bounded by timeout=0.2
        assert heard == [False] and not engine.healthy


async def test_a_kept_alive_connection_the_server_closed_is_not_taken_for_a_dead_server() -> None:
    """A server closes idle keep-alive connections on its own clock (uvicorn: 5 s); a request
    sent on one it had just closed is sent again on a new connection, not failed as
    ``EngineDead`` (which would take the replica out with everything queued for it)."""
    connections = 0

    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        start_stream(writer)
        chunked(writer, token(1) + token(2) + token(3, "length") + b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")  # complete: the client keeps the connection for the next request
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: dropped unanswered

    async with remote(one_per_connection) as engine:
        for rid in ("r1", "r2", "r3"):
            outs = await outputs(engine, rid)
            assert tuple(outs[-1].outputs[0].token_ids) == (1, 2, 3)
    assert connections >= 3


async def test_a_server_too_busy_to_take_a_connection_refuses_the_request_and_stays_in() -> None:
    """A server whose accept queue is full (a burst larger than its listen backlog, its event
    loop busy) does not take the connection within ``timeout``: that one request is refused
    with a retry-after, as a 429 would be, and the server is not taken for dead."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: once its queue is full, connections wait unanswered
    host, port = listener.getsockname()
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex((host, port))
        fillers.append(filler)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=0.3, sock_connect=0.3))
    engine = RemoteVllm(f"http://{host}:{port}", session, model="m", block_size=4, num_blocks=64,
                        max_model_len=512, tokenizer=ByteTokenizer(), timeout=0.3)
    try:
        with pytest.raises(Overloaded, match="did not take a connection") as refused:
            await asyncio.wait_for(outputs(engine), 10)  # a hang guard, not a timing claim
        assert refused.value.retry_after > 0
    finally:
        await engine.close()
        for s in (*fillers, listener):
            s.close()
