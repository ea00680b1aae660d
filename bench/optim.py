"""AdamW kernels side by side: torch's for-loop / foreach / fused and zerolab's for-loop /
foreach / flat, on the parameters of a real model (gpt_small by default), in one process.

    OMP_NUM_THREADS=1 python bench/optim.py [--model gpt_small] [--steps 30] [--warmup 3]

The variants are interleaved step by step (every variant takes its step i before any takes
step i+1) so they share the machine's conditions; the first --warmup steps are not timed. Each
variant has its own copy of the weights and sees the same gradients. "flat" is zerolab's AdamW on
one contiguous tensor holding every parameter: what the ZeRO sharder hands the optimizer (there
it is this rank's 1/N slice). Prints p50/p95 time per optimizer step, the ratio of medians to
torch's foreach (torch's default on this machine), optimizer state bytes, and the largest
relative difference of the weights from torch's foreach after the run (the same math).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab.config import compose  # noqa: E402
from zerolab.models import build_model  # noqa: E402
from zerolab.optim import AdamW  # noqa: E402
from zerolab.stats import percentile  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def variants(shapes: list[torch.Size]) -> dict:
    """name -> factory(list of initial tensors) -> (params, optimizer)."""
    def torch_opt(**kw):
        def make(init):
            ps = [torch.nn.Parameter(t.clone()) for t in init]
            return ps, torch.optim.AdamW(ps, **HP, **kw)
        return make

    def ours(impl):
        def make(init):
            ps = [torch.nn.Parameter(t.clone()) for t in init]
            return ps, AdamW(ps, **HP, impl=impl)
        return make

    def flat(init):
        p = torch.nn.Parameter(torch.cat([t.flatten() for t in init]))
        return [p], AdamW([p], **HP)

    out = {"torch for_loop": torch_opt(foreach=False), "torch foreach": torch_opt(foreach=True)}
    try:  # fused AdamW runs on CPU in recent torch; say so if this build lacks it
        probe = torch.nn.Parameter(torch.zeros(2))
        probe.grad = torch.ones(2)
        torch.optim.AdamW([probe], fused=True).step()
        out["torch fused"] = torch_opt(fused=True)
    except (RuntimeError, ValueError) as err:
        print(f"torch fused AdamW unavailable here: {err}")
    out.update({"zerolab for_loop": ours("for_loop"), "zerolab foreach": ours("foreach"), "zerolab flat": flat})
    return out


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.ndim > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(compose([f"model={a.model}"]).model)
    init = [p.detach().clone() for p in model.parameters()]
    n = sum(t.numel() for t in init)
    runs = {name: make(init) for name, make in variants([t.shape for t in init]).items()}
    times = {name: [] for name in runs}
    gen = torch.Generator().manual_seed(1)
    for step in range(a.warmup + a.steps):
        grads = [torch.randn(t.shape, generator=gen) * 1e-2 for t in init]
        flat_grad = torch.cat([g.flatten() for g in grads])
        for name, (ps, opt) in runs.items():
            if name == "zerolab flat":
                ps[0].grad = flat_grad
            else:
                for p, g in zip(ps, grads):
                    p.grad = g
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= a.warmup:
                times[name].append(dt)
    ref = torch.cat([p.detach().flatten() for p in runs["torch foreach"][0]])
    base = statistics.median(times["torch foreach"])
    print(f"AdamW on {a.model} parameters: {n:,} params in {len(init)} tensors, fp32 | torch {torch.__version__} | "
          f"{platform.processor() or platform.machine()} | threads {torch.get_num_threads()} | "
          f"{a.steps} timed steps after {a.warmup}, interleaved")
    print(f"{'variant':18s} {'p50 ms':>8s} {'p95 ms':>8s} {'p50 / torch foreach':>20s} {'state bytes':>13s} "
          f"{'B/param':>8s} {'max rel diff':>13s}")
    for name, (ps, opt) in runs.items():
        t = times[name]
        w = torch.cat([p.detach().flatten() for p in ps])
        diff = ((w - ref).abs().max() / ref.abs().max()).item()
        sb = state_bytes(opt)
        print(f"{name:18s} {1e3 * statistics.median(t):8.1f} {1e3 * percentile(t, 95):8.1f} "
              f"{statistics.median(t) / base:20.2f} {sb:13,d} {sb / n:8.1f} {diff:13.2g}")


if __name__ == "__main__":
    main()
