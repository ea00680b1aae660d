"""What `precision.master=remainder` costs in time per step, against the fp32 master (run under torchrun).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/master_cost.py [--steps 40] [key=value ...]

For each of ddp, zero1, zero2 and zero3 (--strategies), two trainers in bf16 on the same model,
data and optimizer: one with the fp32 master (`precision.master=fp32`, its weights rounded ties
away, `precision.weight_rounding=nearest_away`, so that both runs compute the same numbers:
docs/below-the-floor.md) and one with the remainder (`precision.master=remainder`). All of them
are stepped interleaved, step by step (bench/zero.py's `interleaved`: a barrier, then one step of
each in turn), so every pair sees the same machine conditions; the first --warmup steps of each
are not timed. Prints, per strategy: p50 and p95 step time of each mode, the ratio of p50s
(remainder / fp32 master) with a 95 % bootstrap interval over the timed steps, CPU seconds per
step, and the master bytes per rank (what the remainder saves).

Measure alone on a quiet machine: on 2 shared cores, a neighbour's load moves step times by more
than the difference looked for.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zero import interleaved  # noqa: E402  (bench/zero.py)
from zerolab import dist as zdist  # noqa: E402
from zerolab.config import compose  # noqa: E402
from zerolab.stats import percentile  # noqa: E402
from zerolab.trainer import Trainer  # noqa: E402

DEFAULTS = ["model=gpt_small", "data=synthetic", "data.micro_batch=8", "precision=bf16",
            "precision.weight_rounding=nearest_away", "logging.wandb.mode=disabled", "logging.progress=false",
            "run.save_model=false"]
MODES = {"fp32 master": ["precision.master=fp32"], "remainder": ["precision.master=remainder"]}


def ratio_interval(num: list[float], den: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of median(num) / median(den), resampling each list's steps."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(num, k=len(num))) / statistics.median(rng.choices(den, k=len(den)))
                    for _ in range(draws))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    base = compose(DEFAULTS + args.overrides)
    ctx = zdist.init(base.dist)
    tmp = ctx.broadcast_object(tempfile.mkdtemp(prefix="zerolab-bench-") if ctx.is_main else None)
    trainers = {}
    for strategy in args.strategies.split(","):
        for mode, extra in MODES.items():
            cfg = compose(DEFAULTS + args.overrides + extra + [f"strategy={strategy}",
                                                               f"trainer.max_steps={args.steps + 1}",
                                                               f"run.dir={tmp}/{len(trainers)}"])
            trainers[(strategy, mode)] = Trainer(cfg, ctx)
    load = os.getloadavg()[0]
    times, cpu = interleaved(trainers, args.steps, args.warmup, ctx)
    cpu = ctx.gather_objects({k: statistics.median(c) for k, c in cpu.items()})
    master = {k: ctx.gather_objects(tr.strategy.memory())[0].get("master", 0) for k, tr in trainers.items()}
    if ctx.is_main:
        tr = next(iter(trainers.values()))
        print(f"# conditions: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, world "
              f"{ctx.world_size}, model {base.model.name} ({tr.n_params / 1e6:.2f}M params), micro batch "
              f"{base.data.micro_batch} x {base.model.block_size} tokens, precision bf16, "
              f"{args.steps - args.warmup} timed steps each, interleaved; load average {load:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after")
        print("\n| strategy | fp32 master p50 s (p95) | remainder p50 s (p95) | remainder ÷ fp32 master [95 %] "
              "| CPU s/step, fp32 master / remainder | master bytes per rank, fp32 / remainder |")
        print("|---|---:|---:|---:|---:|---:|")
        for strategy in args.strategies.split(","):
            a, b = times[(strategy, "fp32 master")], times[(strategy, "remainder")]
            lo, hi = ratio_interval(b, a)
            ca = statistics.mean(r[(strategy, "fp32 master")] for r in cpu)
            cb = statistics.mean(r[(strategy, "remainder")] for r in cpu)
            print(f"| {strategy} | {statistics.median(a):.4f} ({percentile(a, 95):.4f}) | "
                  f"{statistics.median(b):.4f} ({percentile(b, 95):.4f}) | "
                  f"{statistics.median(b) / statistics.median(a):.3f} [{lo:.3f}, {hi:.3f}] | {ca:.4f} / {cb:.4f} | "
                  f"{master[(strategy, 'fp32 master')]:,} / {master[(strategy, 'remainder')]:,} |")
    zdist.shutdown(ctx)


if __name__ == "__main__":
    main()
