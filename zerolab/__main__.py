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


# Each command lives with the code it serves: "module:function(argv) -> exit code".
COMMANDS = {
    "data": "zerolab.__main__:_data",
    "lr": "zerolab.optim.cli:lr_main",
    "optim-state": "zerolab.optim.cli:optim_state_main",
    "memory": "zerolab.memory:cli_main",
    "compare": "zerolab.report:cli_main",
    "sweep": "zerolab.sweep:cli_main",
    "export": "zerolab.checkpoint:export_main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m zerolab {{{','.join(sorted(COMMANDS))}}} ...", file=sys.stderr)
        return 2
    import importlib

    module, func = COMMANDS[argv[0]].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
