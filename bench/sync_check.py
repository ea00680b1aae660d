"""Does a step that is not logged make the host wait for the device? One in-process rank per case.

    python bench/sync_check.py [--device cuda] [--out bench/RESULTS.md]

For each strategy and precision: a run with trainer.log_every=100 (steps 0 and the last are
logged, the ones between are not), whose unlogged steps run whole (batch to the device, forward,
backward, reduction, clip, update) under torch.cuda.set_sync_debug_mode("error"): the first call
that synchronises the host with the device raises and is reported. tests/test_device_step.py
checks the strategy's step on CPU by counting tensor reads; this is the check that means
something, and it needs a CUDA device. With --device cpu it only runs the steps (nothing can be
caught there). Appends its table to --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab import dist as zdist  # noqa: E402
from zerolab.config import DistConfig, compose  # noqa: E402
from zerolab.trainer import Trainer  # noqa: E402

# (strategy, precision, more overrides): the clip alone, then the skip decided on the device
# (fp16's loss scale, trainer.nonfinite=skip: the fused AdamW's found-inf flag).
CASES = [("ddp", "fp32", ()), ("ddp", "bf16", ()), ("zero1", "bf16", ()), ("zero2", "fp32", ()),
         ("zero2", "bf16", ()), ("zero3", "bf16", ()), ("zero2", "bf16_pure", ()),
         ("ddp", "fp16", ()), ("zero2", "fp16", ()), ("zero3", "fp16", ()),
         ("zero2", "bf16", ("trainer.nonfinite=skip",))]
STEPS = 4


def check(ctx, device: str, strategy: str, precision: str, extra: tuple, run_dir: str) -> str:
    cfg = compose([f"strategy={strategy}", f"precision={precision}", *extra, "model=gpt_tiny", "data=synthetic",
                   f"dist.device={device}", f"trainer.max_steps={STEPS}", "trainer.log_every=100",
                   "trainer.eval_every=0", "optim.grad_clip=0.05", "logging.wandb.mode=disabled",
                   "logging.progress=false", "run.save_model=false", f"run.dir={run_dir}"])
    trainer = Trainer(cfg, ctx)
    try:
        for step in range(STEPS):
            guarded = device == "cuda" and not trainer.logs_step(step)
            if guarded:
                torch.cuda.set_sync_debug_mode("error")
            try:
                trainer.train_step(step)
            finally:
                if guarded:
                    torch.cuda.set_sync_debug_mode("default")
        return "no synchronisation" if device == "cuda" else "ran (CPU: nothing to catch)"
    except RuntimeError as err:
        return f"synchronises: {str(err).splitlines()[0][:160]}"
    finally:
        trainer.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="append the table to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    ctx = zdist.init(DistConfig(device=args.device))
    rows = []
    with tempfile.TemporaryDirectory(prefix="zerolab-sync-") as tmp:
        for i, (strategy, precision, extra) in enumerate(CASES):
            result = check(ctx, args.device, strategy, precision, extra, f"{tmp}/{i}")
            rows.append(f"| {strategy} | {' '.join((precision, *extra))} | {result} |")
    zdist.shutdown(ctx)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    text = [f"\n## Host synchronisation in unlogged steps (bench/sync_check.py), {time.strftime('%Y-%m-%d')}\n",
            f"{name}, torch {torch.__version__}, one rank, gpt_tiny, clip active, trainer.log_every=100.\n",
            "| strategy | precision, settings | unlogged steps |", "|---|---|---|", *rows]
    print("\n".join(text))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
