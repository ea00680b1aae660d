"""ddp vs zerolab's own ZeRO stages (zero1, zero2, zero3), side by side in one run (run under torchrun).

    torchrun --standalone --nproc_per_node=2 bench/zero.py [--steps 20] [key=value ...]
    torchrun ... bench/zero.py --strategies "zero3,deepspeed@strategy.stage=3,zero3@strategy.offload_optimizer=true"

A strategy may carry its own overrides after `@` (several: `name@a=1@b=2`), so variants of one
strategy (offload, DeepSpeed's stage) run interleaved like strategies; the entry is its label.
`--versus deepspeed@strategy.stage=3` adds a column: each entry's p50 over that of the entry made
of the --versus label and the entry's own overrides (zero3@X against deepspeed@strategy.stage=3@X).

The strategies are interleaved step by step (ddp, zero1, zero2, ..., ddp, ...) so all of them
see the same machine conditions; the first --warmup steps of each are not timed. Prints, per
strategy: p50/p95 step time, the ratio of medians to ddp and to the compute-only floor,
measured memory per rank by category (after a step, optimizer state allocated), and comm bytes
per rank per step next to the 2Ψ(N−1)/N theory.

The floor is ddp's own step with its gradient all-reduce switched off (every micro-batch under
DDP's no_sync): the same model, per-rank batch, kernels and optimizer, and no communication. A
strategy's ratio to it is what its collectives and bookkeeping cost on top of the compute; a
ZeRO stage that shards the optimizer's work can go below it, since the floor updates every
parameter on every rank.

CPU s/step is each rank's process CPU time per step (all its threads, gloo's included), p50,
averaged over ranks. On a CPU backend the collectives are CPU work: when every core already runs a
rank, overlap can hide the waiting but not that work, so a strategy's wall ratio to the floor
stays at or above about its CPU ratio there (on a GPU the collectives run beside the compute, and
only the wall ratio matters).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab import dist as zdist  # noqa: E402
from zerolab.comm import theory_bytes_per_step  # noqa: E402
from zerolab.config import compose  # noqa: E402
from zerolab.stats import percentile  # noqa: E402
from zerolab.strategies import names_where, reference_strategy  # noqa: E402
from zerolab.trainer import Trainer  # noqa: E402

FLOOR = "floor (no comm)"

DEFAULTS = ["model=gpt_small", "data=synthetic", "data.micro_batch=8", "precision=fp32",
            "logging.wandb.mode=disabled", "logging.progress=false", "run.save_model=false"]


def one_step(name: str, tr: Trainer, step: int) -> None:
    if name == FLOOR:
        with tr.strategy.no_sync():  # ddp without its all-reduce: compute only
            tr.train_step(step)
    else:
        tr.train_step(step)


def interleaved(trainers: dict, steps: int, warmup: int, ctx) -> tuple[dict, dict]:
    """Wall seconds per step, and this process's CPU seconds per step (every thread: the gloo
    threads that run the collectives count too)."""
    times = {name: [] for name in trainers}
    cpu = {name: [] for name in trainers}
    for step in range(steps):
        for name, tr in trainers.items():
            ctx.synchronize()
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            one_step(name, tr, step)
            ctx.synchronize()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if step >= warmup:
                times[name].append(dt)
                cpu[name].append(dc)
    return times, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    own = ",".join([reference_strategy(), *names_where(zerolab_sharder=True)])
    p.add_argument("--strategies", default=own, help=f"default: the reference and zerolab's own sharders ({own})")
    p.add_argument("--no-floor", action="store_true", help="skip the compute-only floor")
    p.add_argument("--versus", default="", help="the label each entry is also compared with (docstring)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    base = compose(DEFAULTS + args.overrides)
    ctx = zdist.init(base.dist)
    tmp = tempfile.mkdtemp(prefix="zerolab-bench-") if ctx.is_main else None
    tmp = ctx.broadcast_object(tmp)
    trainers = {}
    names = args.strategies.split(",") + ([] if args.no_floor else [FLOOR])
    for i, name in enumerate(names):
        strategy, *own = ("ddp" if name == FLOOR else name).split("@")
        cfg = compose(DEFAULTS + args.overrides + [f"strategy={strategy}", *own, f"trainer.max_steps={args.steps}",
                                                    f"run.dir={tmp}/{i}"])
        trainers[name] = Trainer(cfg, ctx)
    times, cpu = interleaved(trainers, args.steps, args.warmup, ctx)
    cpu = ctx.gather_objects({name: statistics.median(c) for name, c in cpu.items()})  # per rank
    for tr in trainers.values():
        tr.strategy.comm.pop_step()
    # one more step each, to read one step's comm bytes and the memory right after it
    comm, mem = {}, {}
    for name, tr in trainers.items():
        one_step(name, tr, args.steps)
        comm[name] = tr.strategy.comm.pop_step()
        mem[name] = ctx.gather_objects(tr.strategy.memory())
    if ctx.is_main:
        report(base, ctx, trainers, times, cpu, comm, mem, args)
    zdist.shutdown(ctx)


def report(base, ctx, trainers, times, cpu, comm, mem, args) -> None:
    any_tr = next(iter(trainers.values()))
    n, psi = ctx.world_size, any_tr.n_params
    print(f"# conditions: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, backend {ctx.backend}, "
          f"world {n}, model {base.model.name} ({psi / 1e6:.2f}M params), micro batch {base.data.micro_batch} x "
          f"{base.model.block_size} tokens, accum {base.trainer.grad_accum_steps}, precision {base.precision.name}, "
          f"bucket {base.strategy.bucket_mb} MB, {args.steps - args.warmup} timed steps each, interleaved")
    ddp_p50 = statistics.median(times["ddp"]) if "ddp" in times else None
    floor_p50 = statistics.median(times[FLOOR]) if FLOOR in times else None
    cpu_of = {name: statistics.mean(r[name] for r in cpu) for name in times}  # mean over ranks of p50
    print("\n| strategy | p50 s/step | p95 s/step | p50 ÷ ddp | p50 ÷ floor | CPU s/step | CPU ÷ floor "
          f"| comm MB/step/rank | ÷ theory |{f' p50 ÷ {args.versus} |' if args.versus else ''}")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.versus else ""))
    elem = 2 if base.precision.name in ("bf16", "fp16") else 4
    theory = theory_bytes_per_step(psi, elem, n)
    for name, ts in times.items():
        p50, p95 = statistics.median(ts), percentile(ts, 95)
        ratio = f"{p50 / ddp_p50:.3f}" if ddp_p50 else "-"
        to_floor = f"{p50 / floor_p50:.3f}" if floor_p50 else "-"
        c = comm[name].get("total", 0.0)
        vs_theory = f"{c / theory:.3f}" if theory and c else "-"
        cpu_ratio = f"{cpu_of[name] / cpu_of[FLOOR]:.3f}" if FLOOR in cpu_of else "-"
        other = "@".join([args.versus, *name.split("@")[1:]])
        versus = f" {p50 / statistics.median(times[other]):.3f} |" if other in times else " - |"
        print(f"| {name} | {p50:.4f} | {p95:.4f} | {ratio} | {to_floor} | {cpu_of[name]:.4f} | {cpu_ratio} "
              f"| {c / 1e6:.2f} | {vs_theory} |{versus if args.versus else ''}")
    cats = ("params", "grads", "master", "optim_state", "buffers", "model_states")
    print("\nmemory per rank after a step, MB (" + ", ".join(cats) + ")")
    print("| strategy | rank | " + " | ".join(cats) + " |")
    print("|---|---:|" + "---:|" * len(cats))
    for name, per_rank in mem.items():
        if name == FLOOR:
            continue  # ddp's memory
        for r, m in enumerate(per_rank):
            print(f"| {name} | {r} | " + " | ".join(f"{m[c] / 1e6:.1f}" for c in cats) + " |")


if __name__ == "__main__":
    main()
