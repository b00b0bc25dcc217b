"""One-off (twenty-third session): a simulator scenario with pacing on by default (what-if).

Runs ``benchmarks.scenarios``' scenario ``NAME`` once on the simulator's H200 8B profile with
``GatewayConfig``'s default ``max_prefill_backlog`` set to ``N`` (0: the library's default, off),
so every L variant the scenario builds is paced.

    PYTHONPATH=src:. python benchmarks/results/pacing/default_on.py overload-short 8192

``routing N ARGS...`` runs ``python -m benchmarks.routing ARGS...`` the same way (every gateway
of every arm paced), e.g. ``default_on.py routing 8192 --replicas 4 --popularity zipf even
--pair-even --repeats 1 --arms RR L``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys


def _default_backlog(value: int) -> None:
    from prefixgate import config

    init = config.GatewayConfig.__init__
    names = [f.name for f in dataclasses.fields(config.GatewayConfig)]
    defaults = list(init.__defaults__ or ())
    defaults[names[len(names) - len(defaults):].index("max_prefill_backlog")] = value
    init.__defaults__ = tuple(defaults)
    assert config.GatewayConfig().max_prefill_backlog == value


async def main(name: str, backlog: int) -> None:
    from transformers import AutoTokenizer

    from benchmarks.engines import SimFactory
    from benchmarks.scenarios import format_scenario, run_scenario

    os.environ["PREFIXGATE_NO_PROGRESS"] = "1"
    if backlog:
        _default_backlog(backlog)
    factory = SimFactory("gpu", AutoTokenizer.from_pretrained("tests/fixtures/tiny-llama"))
    print(format_scenario(await run_scenario(name, factory, size="gpu", seed=0, repeats=1)), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "routing":
        from benchmarks.routing import main as routing

        if int(sys.argv[2]):
            _default_backlog(int(sys.argv[2]))
        sys.exit(routing(sys.argv[3:]))
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
