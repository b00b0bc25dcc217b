"""Top frames of a py-spy ``--format raw`` profile (collapsed stacks): self and inclusive share.

Usage::

    python -m benchmarks.profile_top benchmarks/results/gpu/profile-L.txt --top 15

Each line of a raw profile is ``frame;frame;...;frame count``. A frame's *self* share is the
samples in which it is the innermost frame; its *inclusive* share, the samples in which it
appears at all. Frames are ``function (file:line)``; ``--by-function`` drops the line number.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["main", "top_frames"]

_LINE = re.compile(r":\d+\)$")


def top_frames(lines: Iterable[str], *, by_function: bool = True) -> tuple[int, Counter[str], Counter[str]]:
    """(total samples, self samples per frame, inclusive samples per frame)."""
    total = 0
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [_LINE.sub(")", f) if by_function else f for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n
    return total, own, incl


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: prints the top frames by self and by inclusive share."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_top", description=__doc__.split("\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--by-line", action="store_true", help="keep line numbers in frames")
    p.add_argument("--match", default="", help="only frames containing this text (inclusive table)")
    args = p.parse_args(argv)
    total, own, incl = top_frames(args.profile.read_text().splitlines(), by_function=not args.by_line)
    print(f"{args.profile}: {total} samples")
    print("self:")
    for frame, n in own.most_common(args.top):
        print(f"  {100 * n / total:5.1f}%  {frame}")
    print("inclusive:" + (f" (frames containing {args.match!r})" if args.match else ""))
    shown = [(f, n) for f, n in incl.most_common() if args.match in f][: args.top]
    for frame, n in shown:
        print(f"  {100 * n / total:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
