"""``benchmarks.servers.VllmServers`` without vLLM: a server that exits while starting is started
once more on new ports (a stand-in command in place of vLLM's)."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks.servers import ServerExited, VllmServers

HEALTHY = ("import http.server, sys\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
           "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


class FlakyServers(VllmServers):
    """Each server's first start exits at once; ``fail_every`` makes every start exit."""

    def __init__(self, fail_every: bool = False) -> None:
        super().__init__(1, Path("unused"), cpu=False, start_timeout=30, kv_events=True)
        self.fail_every = fail_every
        self.starts: list[tuple[int, int | None, int | None]] = []

    def command(self, port: int, events_port: int | None = None, replay_port: int | None = None) -> list[str]:
        self.starts.append((port, events_port, replay_port))
        if self.fail_every or len(self.starts) == 1:
            return [sys.executable, "-c", "print('engine core initialization failed'); raise SystemExit(1)"]
        return [sys.executable, "-c", HEALTHY, str(port)]


def test_a_server_that_exits_while_starting_is_started_once_more_on_new_ports() -> None:
    servers = FlakyServers()
    with servers, urllib.request.urlopen(f"{servers.urls[0]}/health", timeout=5) as reply:
        assert reply.status == 200
    (first, second) = servers.starts
    assert first[0] != second[0] and servers.urls[0].endswith(f":{second[0]}")
    assert servers.event_endpoints[0].endswith(f":{second[1]}")
    assert servers.replay_endpoints[0].endswith(f":{second[2]}")
    assert "initialization failed" in servers.tail(0)


def test_a_server_that_exits_on_its_second_start_too_is_an_error_that_shows_its_log() -> None:
    servers = FlakyServers(fail_every=True)
    with pytest.raises(ServerExited, match="initialization failed"):
        servers.start()
    assert len(servers.starts) == 2
