"""`python -m zerolab <command>`: zerolab's tools besides training."""
from __future__ import annotations

import argparse
import sys


def _data(argv: list[str]) -> int:
    from zerolab.data import prepare

    p = argparse.ArgumentParser(prog="zerolab data prepare", description="byte-tokenize text into a token file")
    p.add_argument("action", choices=["prepare"])
    p.add_argument("--src", nargs="+", required=True, help="files or directories (*.py, *.txt, *.md, *.rst)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, default=None)
    args = p.parse_args(argv)
    n = prepare(args.src, args.out, args.max_bytes)
    print(f"wrote {n} tokens to {args.out}")
    return 0


COMMANDS = {"data": _data}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m zerolab {{{','.join(sorted(COMMANDS))}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
