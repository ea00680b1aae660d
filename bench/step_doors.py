"""How far one training step walks through zerolab's files: the files it enters, its doors (distinct
caller-file -> callee-file pairs, the caller being the nearest frame inside zerolab/: a hook that
autograd or a module calls is a door from the zerolab code that started it), its hops (file
changes between successive calls) and how many hops go back into a file already entered.

It traces the Python calls of one unlogged step (the third by default) of train.py in this process
(world size 1), the zerolab tree being the current directory, so one copy of this script measures
any checkout (docs/architecture.md records the ZeRO package's figures before and after a change):

    python bench/step_doors.py strategy=zero2
    cd /tmp/before && python /path/to/bench/step_doors.py strategy=zero3 --names

The step runs on synthetic tokens (data=synthetic: no corpus is read), gpt_tiny, logging every
tenth step (so the step traced records nothing); other Hydra overrides follow the defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile

DEFAULTS = ["data=synthetic", "model=gpt_tiny", "trainer.max_steps=4", "trainer.log_every=10", "trainer.eval_every=0",
            "logging.wandb.mode=disabled", "logging.progress=false", "run.save_model=false"]


class Walk:
    """The zerolab files one traced stretch of calls enters, and how."""

    def __init__(self, root: str):
        self.root, self.package = root, os.path.join(root, "zerolab") + os.sep
        self.files: list[str] = []  # entered, in order, a file repeated only after another one
        self.doors: set[tuple[str, str]] = set()

    def __call__(self, frame, event, _arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(self.package):
            return
        here = os.path.relpath(frame.f_code.co_filename, self.root)
        if not self.files or self.files[-1] != here:
            self.files.append(here)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(self.package):
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename != frame.f_code.co_filename:
            self.doors.add((os.path.relpath(caller.f_code.co_filename, self.root), here))

    def figures(self, names: bool) -> dict:
        seen, back = set(), 0
        for f in self.files:
            back += f in seen
            seen.add(f)
        out = {"files": len(seen), "doors": len(self.doors), "hops": max(len(self.files) - 1, 0), "back": back}
        return {**out, "door_list": sorted(self.doors)} if names else out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="other arguments: Hydra overrides")
    parser.add_argument("--step", type=int, default=3, help="which call of Trainer.train_step to trace (1-based)")
    parser.add_argument("--names", action="store_true", help="also list the doors")
    args, overrides = parser.parse_known_args()
    root = os.getcwd()
    sys.path.insert(0, root)
    import zerolab.trainer as trainer

    walk, untraced, calls = Walk(root), trainer.Trainer.train_step, [0]

    def train_step(self, step):
        calls[0] += 1
        if calls[0] != args.step:
            return untraced(self, step)
        sys.setprofile(walk)
        try:
            return untraced(self, step)
        finally:
            sys.setprofile(None)

    trainer.Trainer.train_step = train_step
    with tempfile.TemporaryDirectory(prefix="zerolab-step-doors-") as tmp:
        sys.argv = ["train.py", *DEFAULTS, f"run.dir={tmp}/run", *overrides]
        try:
            runpy.run_path(os.path.join(root, "train.py"), run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    print(json.dumps(walk.figures(args.names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
