"""Our requests reach vLLM as its current typed input, not the deprecated raw prompt.

vLLM logs "Passing raw prompts to InputProcessor is deprecated" once per process, so the check
runs in a fresh interpreter with an engine of its own (one request through the gateway) and
reads everything vLLM logged there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import asyncio
from vllm import SamplingParams
from prefixgate import Gateway, VllmEngine
from tests.conftest import tiny_engine_args

async def main():
    engine = VllmEngine.from_engine_args(tiny_engine_args())
    try:
        async with Gateway.for_vllm(engine) as gw:
            for prompt in ("hello there " * 20, [11, 12, 13, 14] * 40):
                outs = [o async for o in gw.generate(prompt, SamplingParams(max_tokens=2))]
                assert outs[-1].finished
    finally:
        engine.shutdown()
    print("served")

asyncio.run(main())
"""


def test_requests_reach_vllm_as_typed_inputs_without_a_deprecation_warning():
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    logged = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "served" in proc.stdout, logged[-3000:]
    assert "Passing raw prompts" not in logged
