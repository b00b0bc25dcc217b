"""For tests of a served gateway (ours, the examples', yours): a real uvicorn on 127.0.0.1 in
the running event loop, and an SSE body's payloads."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

__all__ = ["running", "sse_data"]


@contextlib.asynccontextmanager
async def running(app: Any) -> AsyncIterator[str]:
    """Serves ``app`` with uvicorn on a free loopback port of the running loop; yields its URL.

    The server is stopped (and its task awaited) on exit, whatever happened inside.
    """
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()  # it failed to start: raise why
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def sse_data(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
