"""One-off (twenty-third session): where W3 p=0's time goes on the simulator's H200 8B profile.

Runs B1, L and O (and L with ``max_prefill_backlog=N`` for each N given) once and splits each
run's engine time into the step-time model's terms. ``intake_excess`` is the engine core's
intake of new requests beyond the prefill compute it overlaps (``StepTimeModel.seconds``):
the only term that differs between B1 and unpaced L.

    PYTHONPATH=src:. python benchmarks/results/pacing/intake.py [N ...]
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
from typing import Any


async def main(backlogs: list[int]) -> None:
    from transformers import AutoTokenizer

    from benchmarks.engines import SIM_PROFILES, SimFactory
    from benchmarks.harness import gateway_config, run_arm
    from benchmarks.workloads import make_trace
    from prefixgate.sim.engine import StepTimeModel

    os.environ["PREFIXGATE_NO_PROGRESS"] = "1"
    model = StepTimeModel(*SIM_PROFILES["gpu"].step_time, overlap=True)
    factory = SimFactory("gpu", AutoTokenizer.from_pretrained("tests/fixtures/tiny-llama"))
    trace = make_trace("W3", "gpu", seed=0, tokenizer=factory.tokenizer(), overrides={"noise_p": 0.0})
    engine = await factory.start(caching=True, kv_cap_tokens=None)
    plans: list[Any] = []
    engine.engine._on_step = lambda start, seconds, plan: plans.append(plan)
    arms: list[tuple[str, str, Any]] = [("B1", "B1", None), ("L", "L", gateway_config("W3"))]
    arms += [(f"L backlog {n}", "L", gateway_config("W3", {"max_prefill_backlog": n})) for n in backlogs]
    arms.append(("O", "O", None))
    for label, arm, config in arms:
        plans.clear()
        run = await run_arm(arm, 0, trace, engine, config=config)
        makespan = max(r.finished for r in run.records) - run.start
        terms: collections.Counter[str] = collections.Counter()
        for p in plans:
            taking_in = model.zeta * p.new_requests + model.eta * p.new_prompt_tokens
            prefill = model.beta * p.prefill_tokens
            terms["alpha"] += model.alpha
            terms["prefill"] += prefill
            terms["intake_excess"] += max(0.0, taking_in - prefill)
            terms["decode"] += model.gamma * p.decode_seqs + model.delta * p.decode_context
            terms["prefill_attention"] += model.epsilon * p.prefill_context
            if p.prefill_tokens and p.decode_seqs:
                terms["mixed"] += model.theta + model.iota * p.decode_context
        print(f"{label:16s} makespan {makespan:.3f} s, {len(plans)} steps, "
              f"{len(run.records) / makespan:.1f} req/s; "
              + ", ".join(f"{k} {v:.3f}" for k, v in terms.items()), flush=True)


if __name__ == "__main__":
    asyncio.run(main([int(a) for a in sys.argv[1:]]))
