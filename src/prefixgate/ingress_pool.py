"""Ingress off the event loop: canonicalize, tokenize and key in worker threads or processes.

The event loop that runs the gateway is the one vLLM's ``AsyncLLM`` frontend needs to stream
outputs; on a fast GPU it is the bottleneck. Tokenizing a 2k-token prompt costs milliseconds,
so the gateway hands :func:`~prefixgate.ingress.prepare` to a pool and the loop only decides and
streams. Two pools:

* :class:`ProcessIngressPool` (the default with a Hugging Face fast tokenizer): worker
  processes, each with its own copy of the tokenizer's Rust core, fed over pipes that the event
  loop reads itself. Nothing in them takes the loop's GIL, so a saturated loop cannot starve
  them and they cannot stall it. Prompts over ``bulk_chars`` go to a separate low-priority
  (``nice``) worker, so one huge prompt never delays the others.
* :class:`ThreadIngressPool`: worker threads. Cheaper hand-offs, and the Rust tokenizer releases
  the GIL while it works, but canonicalizing and hashing hold it: when the loop never idles a
  thread waits up to the interpreter's switch interval (5 ms) for the GIL at each hand-off.

Both bound the work waiting for them (``max_pending``): beyond it, callers wait (backpressure).
Chain caches live with the workers (each process has its own; threads share one), and the
gateway interns the chains it gets back so siblings share key objects on the loop side.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import pickle
import signal
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from .canonicalize import CanonicalizeConfig, RuleCount
from .errors import InvalidRequest, PrefixgateError
from .ingress import Encode, IngressRequest, Prepared, ids_from_bytes, prepare
from .keys import BlockHash, ChainCache

__all__ = ["IngressPool", "IngressPoolError", "ProcessIngressPool", "ThreadIngressPool"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
_START_TIMEOUT = 60.0
_BULK_NICE = 19  # the huge-prompt worker yields the CPU to everything else (started with the pool:
# spawning it when the first huge prompt arrives costs the loop a fork of a large process). At
# nice 19 its CFS weight is 15 against 1024: on a 2-core machine at nice 10 (weight 110) it still
# took ~10% of a core from the other workers while it tokenized a 2M-character prompt.


_BULK_MAX_PAUSE = 1.0  # seconds a huge prompt's worker may be held still per job (see _Pauser)
_SPILLED = "spilled"  # a prompt handed over as (_SPILLED, path of its UTF-8 text)


def _spill(text: str) -> str:
    """Writes ``text`` as UTF-8 to a private temporary file (in RAM where ``/dev/shm`` exists);
    returns its path."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="prefixgate-ingress-", suffix=".txt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


class IngressPoolError(PrefixgateError):
    """Raised when an ingress pool cannot start or its worker died; the gateway then prepares
    requests inline instead."""


class IngressPool(Protocol):
    """Prepares requests off the event loop."""

    async def start(self) -> None:
        """Starts the workers. Idempotent.

        Raises:
            IngressPoolError: If they cannot start.
        """
        ...

    async def prepare(self, request: IngressRequest) -> Prepared:
        """:func:`~prefixgate.ingress.prepare` for ``request``, in a worker.

        Raises:
            InvalidRequest: If the prompt cannot be tokenized.
            IngressPoolError: If the worker died.
        """
        ...

    async def aclose(self) -> None:
        """Stops the workers; requests still being prepared fail with ``IngressPoolError``."""
        ...


class ThreadIngressPool:
    """:func:`~prefixgate.ingress.prepare` in ``workers`` threads sharing one chain cache.

    Args:
        workers: Threads.
        encode: The tokenizer call (its Rust core, which releases the GIL, when there is one).
        block_size: The engine's block size.
        canonicalize: The canonicalization rules.
        max_pending: The most requests handed to the pool and not yet back.
    """

    def __init__(self, workers: int, encode: Encode, block_size: int, canonicalize: CanonicalizeConfig,
                 max_pending: int) -> None:
        self.workers = workers
        self._prepare = functools.partial(prepare, encode=encode, chains=ChainCache(block_size),
                                          canonicalize=canonicalize)
        self._executor: ThreadPoolExecutor | None = None
        self._slots = asyncio.Semaphore(max_pending)
        self.prepared = 0

    async def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="prefixgate-ingress")

    async def prepare(self, request: IngressRequest) -> Prepared:
        if self._executor is None:
            await self.start()
        assert self._executor is not None
        async with self._slots:
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(self._executor, self._prepare, request)
        self.prepared += 1
        return out

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"ThreadIngressPool(workers={self.workers}, prepared={self.prepared})"


class _Worker:
    """One worker process and the futures of the jobs it holds."""

    def __init__(self, process: asyncio.subprocess.Process, name: str) -> None:
        self.process = process
        self.name = name
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.chars = 0  # characters of the jobs it holds
        self.reader: asyncio.Task[None] | None = None
        self.dead: BaseException | None = None
        self.outbox: list[tuple[int, Any]] = []  # jobs to write at the end of this loop iteration


class _Pauser:
    """Holds the bulk worker still (``SIGSTOP``) while ordinary prompts are being prepared, and
    lets it go on (``SIGCONT``) when none are, or once it has been held ``max_pause`` seconds in
    all for its current job, so a huge prompt is delayed a bounded time and never starves.

    Even at the lowest CPU priority a busy process slows the others where CPUs are few or are
    hyperthreads of one core: on this project's 2-CPU machine a 2M-character prompt being
    tokenized raised 100 ordinary requests' p99 time to first output by ~15 ms.
    """

    def __init__(self, max_pause: float) -> None:
        self.max_pause = max_pause
        self.enabled = hasattr(signal, "SIGSTOP")
        self.pid: int | None = None  # the bulk worker, while it holds a job
        self.stopped_at: float | None = None
        self.paused = 0.0  # seconds held still during the current job
        self._timer: asyncio.TimerHandle | None = None
        self.pauses = 0

    def job_started(self, pid: int, ordinary_busy: bool) -> None:
        self.pid, self.paused = pid, 0.0
        if ordinary_busy:
            self.pause()

    def job_ended(self) -> None:
        self.resume()
        self.pid = None

    def pause(self) -> None:
        if not self.enabled or self.pid is None or self.stopped_at is not None:
            return
        left = self.max_pause - self.paused
        if left <= 0:
            return
        try:
            os.kill(self.pid, signal.SIGSTOP)
        except OSError:
            return
        self.stopped_at = time.monotonic()
        self.pauses += 1
        self._timer = asyncio.get_running_loop().call_later(left, self.resume)

    def resume(self) -> None:
        if self.stopped_at is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.paused += time.monotonic() - self.stopped_at
        self.stopped_at = None
        if self.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGCONT)


class ProcessIngressPool:
    """:func:`~prefixgate.ingress.prepare` in worker processes with their own tokenizer.

    Each worker runs ``python -m prefixgate.ingress_worker`` and gets the tokenizer's Rust
    core as JSON, the block size and the rules; the pool checks at start that it tokenizes a set
    of probe texts exactly as ``encode`` does. Jobs of prompts that start alike go to the same
    worker (its chain cache then reuses their keys) unless it holds far more than another.

    Args:
        workers: Worker processes for ordinary prompts.
        tokenizer_json: The tokenizer's Rust core, serialized (``tokenizers.Tokenizer.to_str``).
        encode: The loop side's tokenizer call, to check the workers against.
        block_size: The engine's block size.
        canonicalize: The canonicalization rules.
        max_pending: The most requests handed to the pool and not yet back.
        bulk_chars: Prompts longer than this go to one extra worker at low CPU priority.
    """

    def __init__(self, workers: int, tokenizer_json: str, encode: Encode, block_size: int,
                 canonicalize: CanonicalizeConfig, max_pending: int, bulk_chars: int) -> None:
        self.workers = workers
        self.bulk_chars = bulk_chars
        self._setup = (tokenizer_json, block_size, canonicalize)
        self._encode = encode
        self._slots = asyncio.Semaphore(max_pending)
        self._workers: list[_Worker] = []
        self._bulk: _Worker | None = None
        self._started: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._closed = False
        self.prepared = 0
        self.tokenize_ns = 0  # CPU the workers' tokenizer took: the rest of their work is ours
        self._ordinary = 0  # ordinary jobs handed over and not back
        self._pauser = _Pauser(_BULK_MAX_PAUSE)

    async def start(self) -> None:
        if self._closed:
            raise IngressPoolError("the ingress pool is closed")
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        try:
            *workers, bulk = await asyncio.gather(
                *(self._spawn(f"ingress-{i}", nice=0) for i in range(self.workers)),
                self._spawn("ingress-bulk", nice=_BULK_NICE))
            self._workers, self._bulk = list(workers), bulk
        except BaseException:
            await self.aclose()
            raise

    async def _spawn(self, name: str, *, nice: int) -> _Worker:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "prefixgate.ingress_worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env)
        except OSError as e:
            raise IngressPoolError(f"cannot start an ingress worker: {e}") from e
        worker = _Worker(process, name)
        worker.reader = asyncio.ensure_future(self._read(worker))
        probes = ("Hello world", "  two  spaces\tand a tab\n\nnew paragraph", "déjà vu — ✓ 中文",
                  'def f(x):\n    return {"key": [1, 2.5, None]}')
        setup = (*self._setup, nice, probes)
        try:
            reply = await asyncio.wait_for(self._call(worker, ("setup", setup)), _START_TIMEOUT)
        except (TimeoutError, IngressPoolError) as e:
            self._kill(worker)
            raise IngressPoolError(f"ingress worker {name} did not start: {e}") from e
        expected = [[list(self._encode(t, s)) for s in (True, False)] for t in probes]
        if reply != expected:
            self._kill(worker)
            raise IngressPoolError(f"ingress worker {name} tokenizes differently from the engine's "
                                   "tokenizer")
        return worker

    async def _call(self, worker: _Worker, message: Any, chars: int = 0) -> Any:
        if worker.dead is not None:
            raise IngressPoolError(f"ingress worker {worker.name} died") from worker.dead
        job = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        worker.pending[job] = future
        worker.chars += chars
        if not worker.outbox:  # jobs handed over in one loop iteration go in one write
            loop.call_soon(self._flush, worker)
        worker.outbox.append((job, message))
        try:
            stdin = worker.process.stdin
            if stdin is not None and stdin.transport.get_write_buffer_size() > 1 << 20:
                await stdin.drain()
            return await future
        finally:
            worker.pending.pop(job, None)
            worker.chars -= chars

    def _flush(self, worker: _Worker) -> None:
        batch, worker.outbox = worker.outbox, []
        stdin = worker.process.stdin
        if not batch or stdin is None or worker.dead is not None:
            return
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            stdin.write(_HEADER.pack(len(data)) + data)
        except (ConnectionError, RuntimeError) as e:  # the worker's end is gone: its reader reports it
            worker.dead = e

    async def _read(self, worker: _Worker) -> None:
        stdout = worker.process.stdout
        assert stdout is not None
        try:
            while True:
                header = await stdout.readexactly(_HEADER.size)
                job, status, payload = pickle.loads(await stdout.readexactly(_HEADER.unpack(header)[0]))
                future = worker.pending.get(job)
                if future is None or future.done():
                    continue
                if status == "ok":
                    future.set_result(payload)
                elif status == "invalid":
                    future.set_exception(InvalidRequest(payload))
                else:
                    future.set_exception(IngressPoolError(payload))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            worker.dead = e
        except asyncio.CancelledError:
            worker.dead = IngressPoolError("the ingress pool closed")
            raise
        finally:
            error = IngressPoolError(f"ingress worker {worker.name} stopped")
            for future in worker.pending.values():
                if not future.done():
                    future.set_exception(error)

    def _choose(self, request: IngressRequest) -> _Worker:
        workers = self._workers
        alive = [w for w in workers if w.dead is None]
        if not alive:
            raise IngressPoolError("every ingress worker died")
        text = request.text or ""
        home = workers[hash(text[:256]) % len(workers)]
        least = min(alive, key=lambda w: w.chars)
        if home.dead is not None or home.chars > least.chars + 64 * max(1, len(text)):
            return least  # keep siblings together unless their worker is far behind
        return home

    async def prepare(self, request: IngressRequest) -> Prepared:
        await self.start()
        assert request.text is not None, "pre-tokenized prompts are prepared inline"
        size = len(request.text)
        spill: str | None = None
        async with self._slots:
            text: Any = request.text
            if size > self.bulk_chars:
                if self._bulk is None or self._bulk.dead is not None:
                    self._bulk = await self._spawn("ingress-bulk", nice=_BULK_NICE)
                worker = self._bulk
                # Pickling a 2M-character prompt and copying it into the pipe's buffer held the
                # loop for ~17 ms: a thread writes it to a file the worker reads and deletes.
                spill = await asyncio.get_running_loop().run_in_executor(None, _spill, request.text)
                text = (_SPILLED, spill)
            else:
                worker = self._choose(request)
            media = tuple((c, m.identifier) for c, m in zip(request.media_chars, request.media, strict=True))
            message = ("prepare", (text, request.add_special_tokens, request.canonical, request.root, media))
            bulk = spill is not None
            if bulk:
                self._pauser.job_started(worker.process.pid, self._ordinary > 0)
            else:
                self._ordinary += 1
                if self._ordinary == 1:
                    self._pauser.pause()
            try:
                packed, chain, changed, removed, counts, tokenize_ns, positions = await self._call(
                    worker, message, size)
            finally:
                if bulk:
                    self._pauser.job_ended()
                else:
                    self._ordinary -= 1
                    if not self._ordinary:
                        self._pauser.resume()
                if spill is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(spill)  # the worker deletes it once read; not if it died first
        self.prepared += 1
        self.tokenize_ns += tokenize_ns
        if request.canonical:
            changed, removed, rules = request.canonicalized, request.chars_removed, request.rules
        else:
            rules = {name: RuleCount(*count) for name, count in counts.items()}
        keys: Sequence[BlockHash] = array("Q", chain)  # type: ignore[assignment]
        return Prepared(ids_from_bytes(packed), tuple(keys), changed, removed, rules, positions)

    def _kill(self, worker: _Worker) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        if worker.reader is not None:
            worker.reader.cancel()

    async def aclose(self) -> None:
        self._closed = True
        self._pauser.job_ended()  # a stopped worker would not see its input close
        workers = [*self._workers, *([self._bulk] if self._bulk is not None else [])]
        self._workers, self._bulk = [], None
        for worker in workers:
            stdin = worker.process.stdin
            if stdin is not None:
                with contextlib.suppress(Exception):
                    stdin.close()  # the worker exits at end of input
        for worker in workers:
            try:
                await asyncio.wait_for(worker.process.wait(), 2.0)
            except (TimeoutError, ProcessLookupError):
                self._kill(worker)
            if worker.reader is not None:
                worker.reader.cancel()
                with contextlib.suppress(BaseException):
                    await worker.reader

    def __repr__(self) -> str:
        alive = sum(w.dead is None for w in self._workers)
        return (f"ProcessIngressPool(workers={alive}/{self.workers}, bulk={self._bulk is not None}, "
                f"prepared={self.prepared})")
