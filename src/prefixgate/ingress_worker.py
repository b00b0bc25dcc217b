"""The ingress worker process: ``python -m prefixgate.ingress_worker``.

Reads length-prefixed pickled batches of jobs on stdin (each job ``(job id, (kind, args))``)
and writes one length-prefixed pickled reply per job on stdout, as soon as it is done (see
:class:`~prefixgate.ingress_pool.ProcessIngressPool`). The first job is ``setup``: the
tokenizer's Rust core as JSON, the block size, the canonicalization rules, a ``nice`` increment
and probe texts, answered with the probes' token ids (both with and without special tokens) so
the pool can check this worker against the engine's tokenizer. Then ``prepare`` jobs:
canonicalize, tokenize, pack and key one prompt (a huge one arrives as the path of a file
holding its UTF-8 text, which the worker deletes once read) and its media items, given as
``(character offset, identifier)`` pairs; the reply is ``(job, status, payload)``: ``ok``
with packed token ids and packed keys (bytes: cheap to pickle), the tokenizer's CPU time and
the media items' token positions,
``invalid`` (the prompt cannot be tokenized) or ``error`` (a bug in the worker) with a message.
Exits at end of input.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import sys
import time
from array import array
from typing import Any, BinaryIO

_HEADER = struct.Struct("<I")


def _read(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _write(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


class _Worker:
    """What a worker keeps between jobs: its tokenizer, chain cache and rules."""

    def __init__(self) -> None:
        self.encode: Any = None
        self.chains: Any = None
        self.rules: Any = None

    def setup(self, args: Any) -> Any:
        from tokenizers import Tokenizer

        from .keys import ChainCache

        tokenizer_json, block_size, self.rules, nice, probes = args
        if nice and hasattr(os, "nice"):
            os.nice(nice)
        if nice and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
            with contextlib.suppress(OSError):  # below nice 19 where Linux allows: runs only on
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # CPU no one else wants
        core = Tokenizer.from_str(tokenizer_json)
        batch = getattr(core, "encode_batch_fast", core.encode_batch)

        def encode(text: str, special: bool) -> list[int]:
            return batch([text], add_special_tokens=special)[0].ids

        self.encode = encode
        self.chains = ChainCache(block_size)
        return "ok", [[encode(t, s) for s in (True, False)] for t in probes]

    def prepare(self, args: Any) -> tuple[str, Any]:
        from .canonicalize import canonicalize_text
        from .keys import media_extras, media_positions, pack_tokens

        text, special, canonical, root, media = args
        if isinstance(text, tuple):  # ("spilled", path): a huge prompt the pool wrote to a file
            with open(text[1], "rb") as f:
                data = f.read()
            os.unlink(text[1])
            text = data.decode("utf-8")
        changed, removed, counts = False, 0, {}
        if not canonical:
            canon = canonicalize_text(text, self.rules)
            text, changed, removed = canon.value, canon.changed, canon.chars_removed
            counts = {name: (c.edits, c.chars_changed, c.chars_removed) for name, c in canon.rules.items()}
        t0 = time.thread_time_ns()
        try:
            ids = self.encode(text, special)
        except Exception as e:
            return "invalid", f"could not tokenize the prompt: {type(e).__name__}: {e}"
        tokenize_ns = time.thread_time_ns() - t0
        try:
            packed = pack_tokens(ids)
        except ValueError as e:
            return "invalid", f"invalid token ids: {e}"
        positions: tuple[int, ...] = ()
        extras = None
        if media:
            try:
                positions = media_positions(text, ids, [c for c, _ in media], self.encode, special)
            except Exception as e:
                return "invalid", f"could not tokenize the prompt: {type(e).__name__}: {e}"
            extras = media_extras([(p, i) for p, (_, i) in zip(positions, media, strict=True)],
                                  self.chains.block_size)
        keys = array("Q", self.chains.chain(packed, root, extras)).tobytes()
        return "ok", (packed, keys, changed, removed, counts, tokenize_ns, positions)


def main() -> None:
    """Serves jobs until stdin closes."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the pipe
    worker = _Worker()
    while (batch := _read(stdin)) is not None:
        for job, (kind, args) in batch:
            try:
                status, payload = worker.setup(args) if kind == "setup" else worker.prepare(args)
            except Exception as e:  # a bug here must not kill the worker silently: report it
                status, payload = "error", f"ingress worker failed: {type(e).__name__}: {e}"
            _write(stdout, (job, status, payload))


if __name__ == "__main__":
    main()
