"""AdamW kernels side by side: torch's for-loop / foreach / fused and zerolab's for-loop /
foreach / auto / flat, on the parameters of a real model (gpt_small by default), in one process.
With --optim sgd_momentum|lamb|lars|adam, zerolab's variants of that optimizer alone.

    OMP_NUM_THREADS=1 python bench/optim.py [--model gpt_small] [--steps 30] [--warmup 3] [--optim adamw]

The variants are interleaved step by step (every variant takes its step i before any takes
step i+1, in a new random order each step) so they share the machine's conditions; the first
--warmup steps are not timed. Each
variant has its own copy of the weights and sees the same gradients. "flat" is zerolab's AdamW on
one contiguous tensor holding every parameter: what the ZeRO sharder hands the optimizer (there
it is this rank's 1/N slice). Prints p50/p95 time per optimizer step, the ratio of medians to
torch's foreach (torch's default on this machine), optimizer state bytes, and the largest
relative difference of the weights from torch's foreach and fused AdamW after the run (the same
math; "zerolab auto" and "zerolab flat auto" run torch's fused kernel, so they equal torch fused
bitwise), and the machine's load average before and after (a loaded machine slows every variant;
compare ratios from one run, not absolute times across runs).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab.config import OptimConfig, compose  # noqa: E402
from zerolab.models import build_model  # noqa: E402
from zerolab.optim import build_optimizer  # noqa: E402
from zerolab.optim.segments import ShardMap, Segment  # noqa: E402
from zerolab.stats import percentile  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def variants(optim: str) -> dict:
    """name -> factory(list of initial tensors) -> (params, optimizer)."""
    def torch_opt(**kw):
        def make(init):
            ps = [torch.nn.Parameter(t.clone()) for t in init]
            return ps, torch.optim.AdamW(ps, **HP, **kw)
        return make

    def cfg(impl):
        return OptimConfig(name=optim, lr=HP["lr"], betas=list(HP["betas"]), eps=HP["eps"],
                           weight_decay=HP["weight_decay"], impl=impl)

    def ours(impl):
        def make(init):
            ps = [torch.nn.Parameter(t.clone()) for t in init]
            return ps, build_optimizer(cfg(impl), [{"params": ps, "names": [str(i) for i in range(len(ps))]}])
        return make

    def flat(impl):
        def make(init):  # the ZeRO sharder's group at world size 1: one shard, segments for the norms
            p = torch.nn.Parameter(torch.cat([t.flatten() for t in init]))
            segs, off = [], 0
            for i, t in enumerate(init):
                segs.append(Segment(tensor=i, start=off, end=off + t.numel(), offset=0))
                off += t.numel()
            group = {"params": [p], "names": [str(i) for i in range(len(init))],
                     "shard": ShardMap(segs, len(init), lambda t: None)}
            return [p], build_optimizer(cfg(impl), [group])
        return make

    out = {}
    if optim == "adamw":
        out = {"torch for_loop": torch_opt(foreach=False), "torch foreach": torch_opt(foreach=True)}
        try:  # fused AdamW runs on CPU in recent torch; say so if this build lacks it
            probe = torch.nn.Parameter(torch.zeros(2))
            probe.grad = torch.ones(2)
            torch.optim.AdamW([probe], fused=True).step()
            out["torch fused"] = torch_opt(fused=True)
        except (RuntimeError, ValueError) as err:
            print(f"torch fused AdamW unavailable here: {err}")
    # "auto" is zerolab's default: for Adam(W) torch's fused kernel where it applies (fp32 on CPU),
    # else foreach (for the other optimizers auto and foreach run the same code: their gap is noise). A flat
    # group is one tensor, so impl=foreach there runs the composed ops once
    # over the whole shard.
    out.update({"zerolab for_loop": ours("for_loop"), "zerolab foreach": ours("foreach"),
                "zerolab auto": ours("auto"), "zerolab flat composed": flat("foreach"),
                "zerolab flat auto": flat("auto")})
    return out


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.ndim > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optim", default="adamw", choices=["adamw", "adam", "sgd_momentum", "lamb", "lars"],
                    help="zerolab optimizer to time (torch's variants only for adamw)")
    a = ap.parse_args()
    load_before = os.getloadavg()
    torch.manual_seed(0)
    model = build_model(compose([f"model={a.model}"]).model)
    init = [p.detach().clone() for p in model.parameters()]
    n = sum(t.numel() for t in init)
    runs = {name: make(init) for name, make in variants(a.optim).items()}
    times = {name: [] for name in runs}
    gen = torch.Generator().manual_seed(1)
    order, shuffler = list(runs), random.Random(2)
    for step in range(a.warmup + a.steps):
        grads = [torch.randn(t.shape, generator=gen) * 1e-2 for t in init]
        flat_grad = torch.cat([g.flatten() for g in grads])
        # A new order every step: a fixed one biases by position (a variant that follows another
        # reuses the memory it just freed; measured up to 0.5x between two identical variants).
        shuffler.shuffle(order)
        for name in order:
            ps, opt = runs[name]
            if name.startswith("zerolab flat"):
                ps[0].grad = flat_grad.clone()  # its own: LAMB/LARS build their update in a flat shard's grad
            else:
                for p, g in zip(ps, grads):
                    p.grad = g
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= a.warmup:
                times[name].append(dt)
    load_after = os.getloadavg()
    weights = {name: torch.cat([p.detach().flatten() for p in ps]) for name, (ps, _) in runs.items()}
    refs = [r for r in ("torch foreach", "torch fused") if r in weights] or ["zerolab foreach"]
    base_name = refs[0]
    base = statistics.median(times[base_name])
    print(f"{a.optim} on {a.model} parameters: {n:,} params in {len(init)} tensors, fp32 | torch {torch.__version__} | "
          f"{platform.processor() or platform.machine()} | {os.cpu_count()} cores | "
          f"threads {torch.get_num_threads()} | "
          f"{a.steps} timed steps after {a.warmup}, interleaved in a new random order each step | "
          "load average (1/5/15 min) before "
          f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}")
    print(f"{'variant':22s} {'p50 ms':>8s} {'p95 ms':>8s} {'p50 / ' + base_name:>22s} {'state bytes':>13s} "
          f"{'B/param':>8s}" + "".join(f" {'rel diff vs ' + r:>24s}" for r in refs))
    for name, (ps, opt) in runs.items():
        t = times[name]
        diffs = [((weights[name] - weights[r]).abs().max() / weights[r].abs().max()).item() for r in refs]
        sb = state_bytes(opt)
        print(f"{name:22s} {1e3 * statistics.median(t):8.1f} {1e3 * percentile(t, 95):8.1f} "
              f"{statistics.median(t) / base:22.2f} {sb:13,d} {sb / n:8.1f}" + "".join(f" {d:24.2g}" for d in diffs))


if __name__ == "__main__":
    main()
