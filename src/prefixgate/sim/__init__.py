"""The simulator: vLLM v1's block pool and scheduler on a virtual clock, apart from the product.

:class:`SimEngine` (:mod:`prefixgate.sim.engine`) is the async shell: the virtual clock, the step
loop and the :class:`~prefixgate.engine.Engine` surface. :mod:`prefixgate.sim.scheduler` holds
the block pool and scheduler it drives. :mod:`prefixgate.sim.loop` charges the frontend's
event-loop CPU time (vLLM's, a client's and the gateway's) to virtual time. The gateway never
imports this package; tests, benchmarks and fleet-scale what-ifs do.
"""

from __future__ import annotations

from .engine import SimClock, SimEngine, StepTimeModel
from .loop import CoreThread, LoopCost, LoopServer, SharedCore

__all__ = ["CoreThread", "LoopCost", "LoopServer", "SharedCore", "SimClock", "SimEngine", "StepTimeModel"]
