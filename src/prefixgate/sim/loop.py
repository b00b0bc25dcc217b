"""The frontend's event loop as one CPU, in virtual time.

A real gateway, vLLM's own frontend (``AsyncLLM``: adding requests, processing each step's
outputs) and an in-process client share one asyncio event loop, which runs one piece of Python
at a time. When that loop is the busiest part of the system (fast GPU steps, cache hits, short
outputs) its CPU time, not the engine, bounds requests per second. SimEngine's steps take
virtual time; this module charges the loop's work too, so that a simulation shows that bound:
:class:`LoopServer` queues work first-come first-served on one virtual CPU, and
:class:`LoopCost` says how much each request and output costs (measured on the machine at hand
by ``python -m benchmarks.fit_step_model``).
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass

from ..clock import Clock

__all__ = ["LoopCost", "LoopServer", "check_costs"]


def check_costs(owner: object, names: tuple[str, ...]) -> None:
    """Raises ``ValueError`` unless each of ``owner``'s ``names`` is a finite number >= 0."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise ValueError(f"{type(owner).__name__}.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class LoopCost:
    """CPU seconds the frontend's event loop spends on each piece of work.

    Attributes:
        request: vLLM's frontend, per request (adding it; its first output).
        output: vLLM's frontend and the client, per further output.
        request_token: vLLM's frontend, per prompt token (of token ids it is handed).
        prompt_token: Tokenizing a text prompt on the loop, per token (what a bare client that
            tokenizes before calling the engine spends; prefixgate tokenizes in workers).
        gateway_request: prefixgate's own work on the loop, per request (checks, keys, queue,
            dispatch, completion; ingress in worker processes).
        gateway_output: prefixgate's own work on the loop, per output it passes on.
        gateway_token: prefixgate's own work on the loop, per prompt token (receiving a worker's
            token ids and keys).
        ingress_token: Seconds per prompt token in one of prefixgate's ingress workers
            (canonicalizing, tokenizing and keying off the loop); a request reaches the gateway's
            queue only once a worker has prepared it.
        ingress_workers: How many ingress workers prepare prompts side by side; ``0`` for none
            (ingress inline, its cost in ``gateway_token``).

    Raises:
        ValueError: If a cost is negative or not finite.
    """

    request: float = 0.0
    output: float = 0.0
    request_token: float = 0.0
    prompt_token: float = 0.0
    gateway_request: float = 0.0
    gateway_output: float = 0.0
    gateway_token: float = 0.0
    ingress_token: float = 0.0
    ingress_workers: int = 0

    def __post_init__(self) -> None:
        check_costs(self, ("request", "output", "request_token", "prompt_token", "gateway_request",
                           "gateway_output", "gateway_token", "ingress_token", "ingress_workers"))
        if not isinstance(self.ingress_workers, int):
            raise ValueError(f"LoopCost.ingress_workers must be an int, got {self.ingress_workers!r}")


class LoopServer:
    """CPUs that run queued work in arrival order, on ``clock``'s (virtual) time: one for the
    event loop, several for a pool of workers.

    :meth:`spend` returns once the work handed to it has run: when a CPU is free, after
    ``seconds``; when all are busy, after the first of them is done with the work queued on it.

    Args:
        clock: The simulation's clock.
        workers: CPUs working side by side.
    """

    __slots__ = ("_clock", "_free_at", "_runs", "busy_seconds")

    def __init__(self, clock: Clock, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"LoopServer needs at least one worker, got {workers}")
        self._clock = clock
        self._free_at = [0.0] * workers  # a heap: when each CPU is next free
        # (start, end) of the work run or queued lately, for busy_between; the oldest go first.
        self._runs: collections.deque[tuple[float, float]] = collections.deque(maxlen=1 << 16)
        self.busy_seconds = 0.0
        """Work charged so far, in seconds."""

    def busy_between(self, start: float, end: float) -> float:
        """Seconds its CPUs were (or, for work queued already, will be) busy between ``start``
        and ``end``, summed over them. Work that ended before ``start`` is forgotten: ask about
        intervals in order of time."""
        runs = self._runs
        while runs and runs[0][1] <= start:
            runs.popleft()
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in runs if a < end)

    async def spend(self, seconds: float) -> None:
        """Runs ``seconds`` of work on the first free CPU, after whatever is queued on it."""
        if seconds <= 0:
            return
        now = self._clock.now()
        begin = max(now, self._free_at[0])
        done = begin + seconds
        heapq.heapreplace(self._free_at, done)
        self._runs.append((begin, done))
        self.busy_seconds += seconds
        await self._clock.sleep(done - now)
