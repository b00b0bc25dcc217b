"""``benchmarks.serve_ab``'s table: medians per dataset and arm, engine steps and each process's
CPU seconds side by side (the runs themselves need vLLM servers and are a benchmark, not a test)."""

from __future__ import annotations

from benchmarks.serve_ab import CPU_KEYS, KEYS, table


def row(dataset: str, arm: str, rps: float, steps: float, gateway_cpu: float) -> dict:
    out = {k: 1.0 for k in KEYS}
    out.update(dataset=dataset, arm=arm, request_throughput=rps, hit_rate=0.5, engine_steps=steps,
               cpu_s={k: (gateway_cpu if k == "gateway" else 1.0) for k in CPU_KEYS})
    return out


def test_the_table_shows_medians_with_engine_steps_and_cpu_per_process():
    rows = [row("random", "vllm", r, s, 0.0) for r, s in ((100, 200), (300, 400), (200, 250))]
    gateway = ((50, 900, 2.0), (150, 100, 3.0), (90, 500, 2.5))
    rows += [row("random", "prefixgate", r, s, g) for r, s, g in gateway]
    lines = table(rows).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 11
    assert lines[2].startswith("| random | vllm | 200.0 |")
    assert lines[2].endswith("| 250 | 0.00 / 1.00 / 1.00 / 1.00 |")
    assert lines[3].startswith("| random | prefixgate | 90.0 |")
    assert lines[3].endswith("| 500 | 2.50 / 1.00 / 1.00 / 1.00 |")
