"""The ingress worker process: ``python -m prefixgate.ingress_worker``.

Reads length-prefixed pickled jobs on stdin and writes length-prefixed pickled replies on stdout
(see :class:`~prefixgate.ingress_pool.ProcessIngressPool`). The first job is ``setup``: the
tokenizer's Rust core as JSON, the block size, the canonicalization rules, a ``nice`` increment
and probe texts, answered with the probes' token ids (both with and without special tokens) so
the pool can check this worker against the engine's tokenizer. Then ``prepare`` jobs: canonicalize,
tokenize, pack and key one prompt; the reply is ``(job, status, payload)``: ``ok`` with packed
token ids and packed keys (bytes: cheap to pickle), ``invalid`` (the prompt cannot be tokenized)
or ``error`` (a bug in the worker) with a message. Exits at end of input.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
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


def main() -> None:
    """Serves jobs until stdin closes."""
    from tokenizers import Tokenizer

    from .canonicalize import canonicalize_text
    from .keys import ChainCache, pack_tokens

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the pipe
    encode = None
    chains: ChainCache | None = None
    rules = None
    while (message := _read(stdin)) is not None:
        job, (kind, args) = message
        try:
            if kind == "setup":
                tokenizer_json, block_size, rules, nice, probes = args
                if nice and hasattr(os, "nice"):
                    os.nice(nice)
                core = Tokenizer.from_str(tokenizer_json)
                batch = getattr(core, "encode_batch_fast", core.encode_batch)

                def encode(text: str, special: bool, batch: Any = batch) -> list[int]:
                    return batch([text], add_special_tokens=special)[0].ids

                chains = ChainCache(block_size)
                _write(stdout, (job, "ok", [[encode(t, s) for s in (True, False)] for t in probes]))
                continue
            assert encode is not None and chains is not None
            text, special, canonical, root = args
            changed, removed, edits = False, 0, {}
            if not canonical:
                canon = canonicalize_text(text, rules)
                text, changed, removed = canon.value, canon.changed, canon.chars_removed
                edits = dict(canon.edits)
            try:
                ids = encode(text, special)
            except Exception as e:
                _write(stdout, (job, "invalid", f"could not tokenize the prompt: {type(e).__name__}: {e}"))
                continue
            try:
                packed = pack_tokens(ids)
            except ValueError as e:
                _write(stdout, (job, "invalid", f"invalid token ids: {e}"))
                continue
            keys = array("Q", chains.chain(packed, root)).tobytes()
            _write(stdout, (job, "ok", (packed, keys, changed, removed, edits)))
        except Exception as e:  # a bug here must not kill the worker silently: report it
            _write(stdout, (job, "error", f"ingress worker failed: {type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
