"""``python -m prefixgate serve ...``: the same as the ``prefixgate`` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs a ``prefixgate`` subcommand (``serve``); returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "serve":
        print("usage: prefixgate serve [--help] ...", file=sys.stderr)
        return 2
    from .serve.cli import main as serve

    return serve(args[1:])


if __name__ == "__main__":
    sys.exit(main())
