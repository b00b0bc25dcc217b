"""The engine contract: how outputs are read, and engines written before its optional members."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace

from prefixgate import Engine, Gateway, GatewayConfig, Overloaded, Reason
from prefixgate.engine import Completion, completion_reader, engine_slots, read_completion
from prefixgate.sim import SimEngine
from prefixgate.testing import FakeEngine, FakeSamplingParams, NullEngine

SP = FakeSamplingParams(max_tokens=2)


def _output(finished, finish_reason=None, token_ids=(7, 7), cached=16, n=1):
    completions = [SimpleNamespace(token_ids=list(token_ids), finish_reason=finish_reason)] * n
    return SimpleNamespace(finished=finished, outputs=completions, num_cached_tokens=cached)


class _Kind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1


def test_read_completion_reads_a_request_output_as_vllm_writes_it():
    assert read_completion(_output(False), None) is None
    assert read_completion(_output(True, "length"), None) == Completion(False, 16, [7, 7])
    assert read_completion(_output(True, "abort"), None).aborted
    # Delta outputs and n > 1 completions do not hold the whole output: its tokens are unknown.
    delta = SimpleNamespace(output_kind=_Kind.DELTA)
    assert read_completion(_output(True, "stop"), delta) == Completion(False, 16, None)
    assert read_completion(_output(True, "stop", n=2), None).token_ids is None
    assert read_completion(SimpleNamespace(), None) is None  # no `finished`: never the last


def test_the_shipped_engines_implement_every_member():
    for engine in (FakeEngine(), NullEngine(), SimEngine()):
        assert isinstance(engine, Engine)
        assert completion_reader(engine) is read_completion
    assert engine_slots(FakeEngine(max_num_seqs=8)) == 8 and engine_slots(SimEngine()) == 256


@dataclass
class _OldEngine:
    """An engine written against the protocol before max_num_seqs and completion were in it."""

    inner: FakeEngine = field(default_factory=FakeEngine)

    def __getattr__(self, name):
        if name in ("max_num_seqs", "completion"):
            raise AttributeError(name)
        return getattr(self.inner, name)


async def test_an_engine_without_the_optional_members_still_works():
    engine = _OldEngine()
    assert engine_slots(engine) is None and completion_reader(engine) is read_completion
    async with Gateway(engine, GatewayConfig(stall_timeout=None)) as gw:
        stream = gw.generate("hello world", SP)
        outs = [out async for out in stream]
    assert outs[-1].finished and stream.ticket.output_token_ids == (7, 7)
    assert gw.statistics().completed == 1


def test_reasons_are_strings_and_a_custom_engines_string_reason_becomes_its_member():
    assert Reason.KV_STATS_STALE == "kv_stats_stale" and f"{Reason.ENGINE_BUSY}" == "engine_busy"
    assert Overloaded("busy", retry_after=1, reason="engine_busy").reason is Reason.ENGINE_BUSY
    assert Overloaded("busy", retry_after=1, reason="my_own").reason == "my_own"
