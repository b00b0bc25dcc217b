"""Token hit rate per kind of whitespace noise under each canonicalization rule set, on SimEngine.

Usage::

    python -m benchmarks.noise --json benchmarks/results/noise-sim.json --png benchmarks/results/noise-sim.png

One row per noise kind (W3's five, plus Unicode spaces, zero-width characters and JSON
re-indentation), one column per rule set (``off``, ``legacy`` = the 0.1 default, ``safe``,
``prose``, ``aggressive``). Each cell is the L arm's token hit rate (Σcached / Σprompt) on a W3
trace whose noisy requests carry only that kind of noise (the same clean text as W3, the same
shape unless ``--param`` changes it; ``--noise-p`` of the requests get ``--edits`` edits in their
shared part), run through :class:`prefixgate.Gateway` on :class:`prefixgate.sim.SimEngine`
(``sim`` profile, tiny-llama tokenizer). ``meant`` is the ceiling of the clean prompts: what the
user meant to share, reached only if the noise is undone exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from prefixgate import CanonicalizeConfig, GatewayConfig

from .engines import SimFactory
from .harness import code_version, run_arm, trace_ceiling
from .metrics import arm_metrics, jsonable
from .run import TINY_LLAMA
from .text import EDIT_KINDS, EXTRA_EDIT_KINDS, apply_whitespace_edits
from .workloads import Trace, make_trace

__all__ = ["CATEGORIES", "COLUMNS", "format_table", "main", "noise_table", "single_noise"]

CATEGORIES: Mapping[str, str] = MappingProxyType({
    "crlf": "CRLF", "trailing_spaces": "trailing spaces", "double_space": "doubled spaces",
    "tab": "tab for a space", "blank_line": "extra blank lines", "unicode_space": "Unicode spaces",
    "zero_width": "zero-width characters", "json_indent": "JSON indentation",
})
"""Edit kind (:mod:`benchmarks.text`) -> row label."""
assert tuple(CATEGORIES) == EDIT_KINDS + EXTRA_EDIT_KINDS
COLUMNS = ("off", "legacy", "safe", "prose", "aggressive")
_QUESTION = "\n\nQuestion: "


def single_noise(trace: Trace, kind: str, p: float, edits: int, seed: int) -> Trace:
    """``trace`` (clean) with ``edits`` edits of ``kind`` in the shared part of a ``p`` share of
    its requests; the question each request ends with is left alone, as in W3."""
    rng = random.Random(f"noise-table/{seed}/{kind}")
    requests = []
    for r in trace.requests:
        shared, sep, question = r.clean_prompt.rpartition(_QUESTION)
        prompt = r.clean_prompt
        if sep and rng.random() < p:
            prompt = apply_whitespace_edits(shared, rng, edits, kinds=(kind,)) + sep + question
        requests.append(dataclasses.replace(r, prompt=prompt))
    noisy = sum(r.prompt != r.clean_prompt for r in requests)
    params = {**trace.params, "noise_kind": kind, "noise_p": p, "noise_edits": edits, "noisy_requests": noisy}
    return dataclasses.replace(trace, workload=f"{trace.workload}-{kind}", requests=tuple(requests),
                               params=MappingProxyType(params))


async def noise_table(*, seed: int = 0, p: float = 0.5, edits: int = 3,
                      overrides: Mapping[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Runs every (noise kind, rule set) cell and returns the JSON-ready result."""
    from transformers import AutoTokenizer

    wall0 = time.perf_counter()
    factory = SimFactory("sim", AutoTokenizer.from_pretrained(str(TINY_LLAMA)))
    clean = make_trace("W3", "sim", seed=seed, tokenizer=factory.tokenizer(),
                       overrides={**(overrides or {}), "noise_p": 0.0})
    engine = await factory.start(caching=True, kv_cap_tokens=clean.kv_cap_tokens)
    ceil = trace_ceiling(clean, engine)
    rows = []
    try:
        for kind, label in CATEGORIES.items():
            trace = single_noise(clean, kind, p, edits, seed)
            row: dict[str, Any] = {"kind": kind, "category": label,
                                   "noisy_requests": trace.params["noisy_requests"], "hit_rate": {},
                                   "cached_tokens": {}, "canonicalized": {}}
            for column in COLUMNS:
                config = GatewayConfig(canonicalize=CanonicalizeConfig.named(column))
                run = await run_arm("L", 0, trace, engine, config)
                metrics = arm_metrics(run)
                row["hit_rate"][column] = metrics["hit_rate"]
                row["cached_tokens"][column] = metrics["cached_tokens"]
                row["canonicalized"][column] = run.gateway.get("canonicalized")
            rows.append(row)
            if progress:
                cells = "  ".join(f"{c} {row['hit_rate'][c]:.3f}" for c in COLUMNS)
                print(f"  {label}: {cells}", flush=True)
    finally:
        await engine.close()
    params = {k: v for k, v in clean.params.items() if k not in ("noise_p", "noisy_requests")}
    params.update(noise_p=p, noise_edits=edits, engine=engine.describe(),
                  tokenizer="tests/fixtures/tiny-llama")
    return {"params": jsonable(params), "columns": list(COLUMNS), "ceiling": ceil.as_dict(),
            "rows": rows, "code": code_version(), "runtime_s": time.perf_counter() - wall0}


def format_table(result: Mapping[str, Any]) -> str:
    """One row per noise kind, one column per rule set, then the ceiling."""
    params = result["params"]
    lines = [f"Token hit rate by noise kind and rule set (SimEngine, W3 text: {params['groups']} groups x "
             f"{params['per_group']}, prefix {params['prefix_tokens']} tokens; {params['noise_p']:.0%} of "
             f"requests get {params['noise_edits']} edits of one kind)",
             f"{'noise':<24}" + "".join(f"{c:>11}" for c in result["columns"]) + f"{'meant':>9}"]
    for row in result["rows"]:
        cells = "".join(f"{row['hit_rate'][c]:>11.3f}" for c in result["columns"])
        lines.append(f"{row['category']:<24}{cells}{result['ceiling']['hit_rate']:>9.3f}")
    return "\n".join(lines)


def plot(result: Mapping[str, Any], out: Path) -> None:
    """The table as an annotated heat map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(result["columns"])
    rows = result["rows"]
    values = [[row["hit_rate"][c] for c in columns] for row in rows]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), [row["category"] for row in rows])
    for i, line in enumerate(values):
        for j, value in enumerate(line):
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=9)
    ax.set_title(f"Token hit rate by noise kind and rule set (meant: {result['ceiling']['hit_rate']:.3f})")
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.noise", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--png", type=Path, help="plot the table here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise-p", type=float, default=0.5, help="share of requests with noise (W3: 0.5)")
    p.add_argument("--edits", type=int, default=3, help="edits per noisy request (W3: 3)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="W3 shape override, e.g. groups=8 (repeatable)")
    args = p.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.param)
    result = asyncio.run(noise_table(seed=args.seed, p=args.noise_p, edits=args.edits, overrides=overrides))
    print(format_table(result))
    print(f"({result['runtime_s']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
