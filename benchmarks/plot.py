"""Plot benchmark results: one row per JSON file, three panels per row.

Workload panels: throughput (req/s) per arm; token hit rate per arm against the ceiling H*; TTFT
p50 and p99 per arm. A scenario's row draws the three metrics its JSON names under ``panels``,
one bar per variant. Error bars span the repeats (min to max)::

    python -m benchmarks.plot benchmarks/results/W1-sim.json benchmarks/results/W3-sim.json \\
        --out benchmarks/results/sim.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "plot"]

_COLORS = {"B0": "#9e9e9e", "B1": "#e57373", "L": "#1e88e5", "O": "#43a047"}


def _spread(arm: Mapping[str, Any], metric: str) -> tuple[float, float]:
    """(below, above) the median: the repeats' range, for error bars."""
    values = [r[metric] for r in arm.get("repeats", ()) if r.get(metric) is not None]
    mid = arm.get(metric)
    if not values or mid is None:
        return (0.0, 0.0)
    return (max(0.0, mid - min(values)), max(0.0, max(values) - mid))


def _bars(ax: Any, result: Mapping[str, Any], metric: str, title: str) -> None:
    arms = list(result["arms"])
    values = [result["arms"][a].get(metric) or 0.0 for a in arms]
    spreads = [_spread(result["arms"][a], metric) for a in arms]
    err = [[s[0] for s in spreads], [s[1] for s in spreads]]
    ax.bar(range(len(arms)), values, color=[_color(a) for a in arms], yerr=err, capsize=3)
    ax.set_xticks(range(len(arms)), arms, rotation=30 if len(arms) > 4 else 0,
                  ha="right" if len(arms) > 4 else "center", fontsize=7 if len(arms) > 4 else 9)
    for i, (v, (_, above)) in enumerate(zip(values, spreads, strict=True)):
        ax.annotate(f"{v:.3g}", (i, v + above), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.margins(y=0.15)
    ax.set_title(title, fontsize=9)


def _color(label: str) -> str:
    return _COLORS.get(label.split(" ")[0], "#7e57c2")


def plot(results: Sequence[Mapping[str, Any]], out: Path) -> None:
    """Draws every result as one row of three panels and saves a PNG at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(results)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.8 * rows), squeeze=False)
    for row, result in zip(axes, results, strict=True):
        if "panels" in result:
            label = (f"{result['scenario']} ({result.get('workload')}) · {result['engine']} · "
                     f"size {result['params'].get('size')}")
            for ax, (metric, title) in zip(row, result["panels"], strict=False):
                _bars(ax, result, metric, f"{label}\n{title}" if ax is row[0] else title)
            continue
        label = (f"{result['workload']} · {result['engine']} · size {result['params'].get('size')}")
        kappa = (result.get("ratios") or {}).get("kappa")
        _bars(row[0], result, "req_per_s", f"{label}\nthroughput (req/s)"
              + (f", κ = {kappa:.2f}" if kappa is not None else ""))
        _bars(row[1], result, "hit_rate", "token hit rate vs ceiling H*")
        ceiling = result["ceiling"]["hit_rate"]
        row[1].axhline(ceiling, color="black", linestyle="--", linewidth=1)
        row[1].annotate(f"H* = {ceiling:.3f}", (0, ceiling), xytext=(2, 3), textcoords="offset points",
                        fontsize=8)
        row[1].set_ylim(0, 1.08)
        arms = list(result["arms"])
        p50 = [result["arms"][a].get("ttft_p50_s") or 0.0 for a in arms]
        p99 = [result["arms"][a].get("ttft_p99_s") or 0.0 for a in arms]
        x = range(len(arms))
        row[2].bar([i - 0.2 for i in x], p50, width=0.4, label="p50",
                   color=[_COLORS.get(a, "#7e57c2") for a in arms], alpha=0.6)
        row[2].bar([i + 0.2 for i in x], p99, width=0.4, label="p99",
                   color=[_COLORS.get(a, "#7e57c2") for a in arms])
        row[2].set_xticks(list(x), arms)
        row[2].set_title("TTFT from arrival (s): p50 light, p99 dark", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.plot A.json [B.json …] --out FIG.png``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    plot([json.loads(path.read_text()) for path in args.results], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
