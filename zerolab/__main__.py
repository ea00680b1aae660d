"""`python -m zerolab <command>`: zerolab's tools besides training."""
from __future__ import annotations

import sys


# Each command lives with the code it serves: "module:function(argv) -> exit code", and a line
# for `python -m zerolab --help`.
COMMANDS = {
    "data": ("zerolab.data.cli:cli_main",
             "prepare a token file from text files, byte-level or with a tokenizer.json "
             "(data prepare --src ... --out ...)"),
    "lr": ("zerolab.optim.cli:lr_main", "the peak learning rate a batch-size scaling rule gives"),
    "optim-state": ("zerolab.memory.cli:optim_state_main",
                    "state elements per parameter each optimizer keeps, measured"),
    "memory": ("zerolab.memory:cli_main",
               "predicted bytes per rank by category, for any model, strategy and world size"),
    "dry-run": ("zerolab.rehearsal:cli_main",
                "rehearse rank R of an N-rank job in one process on fake tensors: the memory a real run counts, "
                "beside the ledger"),
    "plan": ("zerolab.plan:cli_main",
             "will it fit: largest micro-batch and peak per rank for each strategy, under a GPU's memory"),
    "compare": ("zerolab.report:cli_main", "compare run or sweep directories: tables, parity, figures"),
    "export": ("zerolab.checkpoint:export_main",
               "consolidated weights (safetensors, or --format hf for from_pretrained) from a finished run's directory "
               "or a (sharded) checkpoint"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m zerolab COMMAND [ARGS...]   (python -m zerolab COMMAND --help for its options)",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "Training itself: python train.py [key=value ...] (python train.py --help lists the config groups)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = "no command given" if not argv else f"unknown command {argv[0]!r}"
        print(f"zerolab: {problem}\n\n{usage()}", file=sys.stderr)
        return 2
    import importlib

    module, func = COMMANDS[argv[0]][0].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
