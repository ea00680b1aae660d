"""`python -m zerolab.predict calibrate`: this machine's figures for the `cpu` hardware entry.

Measured the way a real run uses the machine: for each number of ranks n (1, 2, 3), n processes
of one thread each (OMP_NUM_THREADS=1, as zerolab's CPU runs) start together and measure at once,
so each figure is what one rank gets while the others work beside it. Per n:

- matmul_fp32 / matmul_bf16: FLOP/s of torch.mm, the median over GEMM shapes of a small
  transformer's (rows 512-2048, inner and outer sizes 256-1536, both orientations), best of 5 each;
- attention_fp32: FLOP/s of the CPU flash attention, forward and backward (torch's SDPA FLOP
  counts, causal, half of them, as zerolab.predict.ops counts), at 8 x 6 heads x 128 x 64;
- memory_bandwidth: bytes/s of elementwise ops on 32 MiB tensors that already exist (in place, and
  into a preallocated output: a training step reuses its buffers), the median of add, mul, copy;
- fused_adamw_bandwidth: bytes/s of torch's fused AdamW kernel over a transformer's parameter
  sizes (3M elements), bytes counted as zerolab.predict.ops counts them: the optimizer step of
  ddp and zerolab's ZeRO stages (fp32), which computes too much per element to run at the memory
  bandwidth on one core;
- op_overhead_s: what one kernel costs beyond its roofline: a tiny MLP's forward, backward and
  AdamW step (tensors of a few elements) timed, divided by the kernels zerolab.predict.ops counts
  in it (module calls, autograd and the dispatcher included);
- kernels, host_s_per_kernel and host_s_per_kernel_step: every op of reference training steps
  timed as dispatched, by name and shape, and the host time beyond them per kernel, over the whole
  step and over what follows its backward (zerolab.predict.kernels): what prices
  an op where its name was measured (matmuls by shape, GELU and the norms at their own rates,
  elementwise ops and copies by their size), the figures above where it was not;
- meeting_s (n >= 2): what each collective adds because the ranks must meet for it (meeting_cost:
  compute chunks each followed by a tiny all-reduce, against both alone); more ranks than cores
  reach a meeting at different times, and the cores idle while the first ones wait;
- gloo (n >= 2): all-reduce, reduce-scatter, all-gather and broadcast at 4 KiB to 32 MiB, each
  alone (a barrier before it) after a warm-up, as latency + bytes / bandwidth (bytes: the full
  buffer): the latency from the sizes up to 64 KiB, the mean of 40 calls each; the bandwidth from
  1 MiB on, the median of 5 (_fit). A mean for the latency: with ranks sharing cores a call now and
  then stalls for milliseconds (a gloo thread waits for a core), a step of many small collectives
  pays those stalls, and the median leaves them out (2 ranks here, 2026-12-06: means 1.2-3x the
  medians at 4-64 KiB, calls up to 9 ms against ~0.3 ms typical; bench/RESULTS.md);
- queued_s (n >= 2): what a collective costs beyond that when it is issued behind others of its
  group, as strategies issue many small ones in a row (torch's ZeroRedundancyOptimizer broadcasts
  every parameter; a sharder launches a collective per bucket): 16 collectives of 64 KiB to 1 MiB
  issued at once and then waited for, per collective, less the same collective alone; the median
  over the kinds and sizes.

The result is a JSON file (hardware.calibration_path()); `--hardware cpu` reads it. Nothing in the
test suite depends on it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from zerolab.predict.kernels import measure_table, merge_tables

SHAPES = [(1024, 384, 384), (1024, 384, 1536), (1024, 1536, 384), (384, 1024, 1536), (2048, 512, 512),
          (512, 256, 1024), (1536, 1024, 384), (1024, 1024, 1024)]
GLOO_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
QUEUED_SIZES, QUEUED_CALLS = [64 << 10, 256 << 10, 1 << 20], 16  # a parameter's or a bucket's size, many in a row
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
LATENCY_BYTES, LATENCY_CALLS = 64 << 10, 40  # the sizes whose time is latency (_fit), timed this many times


def _seconds_per_call(fn, seconds: float = 0.3) -> float:
    """The mean time of `fn` over at least `seconds` of calls (after one untimed). A mean, not a
    best: with more ranks than cores the ranks take turns, and a best would catch a rank alone."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and calls >= 3:
            return elapsed / calls


def matmul_rate(dtype: torch.dtype) -> float:
    rates = []
    for m, k, n in SHAPES if dtype == torch.float32 else SHAPES[:2]:  # 16-bit matmuls are slow on most CPUs
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        rates.append(2 * m * k * n / _seconds_per_call(lambda: torch.mm(a, b)))
    return statistics.median(rates)


def attention_rate() -> float:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (8, 6, 128, 64)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    flops = (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)) / 2

    def fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return flops / _seconds_per_call(fwd_bwd, 0.5)


def memory_rate() -> float:
    n = 8 << 20  # 32 MiB of fp32
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    rates = [3 * 4 * n / _seconds_per_call(lambda: torch.add(a, b, out=c)),
             2 * 4 * n / _seconds_per_call(lambda: a.mul_(1.0)), 2 * 4 * n / _seconds_per_call(lambda: c.copy_(a))]
    return statistics.median(rates)


def fused_adamw_rate() -> float:
    """Bytes/s of torch's fused AdamW kernel (what zerolab's AdamW runs on fp32 tensors), bytes as
    zerolab.predict.ops counts them, over a transformer's parameter sizes: it computes a dozen
    operations per element, so on a CPU core it runs below the memory bandwidth."""
    from zerolab.predict.ops import cost

    sizes = [384 * 384] * 8 + [384 * 1536] * 4 + [512 * 384]  # 3.0M elements, 12 MiB per list
    params, grads, m, v = ([torch.randn(n) for n in sizes] for _ in range(4))
    steps = [torch.tensor(1.0) for _ in sizes]

    def step():
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False)
    op = torch.ops.aten._fused_adamw_.default
    moved = cost(op, (params, grads, m, v, [], steps), {}, None)[1]
    return moved / _seconds_per_call(step)


def op_overhead(bandwidth: float) -> float:
    """Seconds per kernel beyond the roofline, from a tiny model's step (module docstring)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zerolab.predict.ops import cost

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(2, 8)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    counted = {"kernels": 0, "bytes": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            _, moved, kernels, _, _ = cost(func, args, kwargs or {}, out)
            counted["kernels"] += kernels
            counted["bytes"] += moved
            return out

    step()
    with Count():
        step()
    t = _seconds_per_call(step, 0.5)
    return max(0.0, (t - counted["bytes"] / bandwidth) / counted["kernels"])


def gloo_fits(world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for kind in KINDS:
        points = []
        for size in GLOO_SIZES:
            n = size // 4 // world * world
            full, part = torch.ones(n), torch.ones(n // world)
            call = {"all_reduce": lambda: dist.all_reduce(full),
                    "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
                    "all_gather": lambda: dist.all_gather_single(full, part),
                    "broadcast": lambda: dist.broadcast(full, 0)}[kind]
            call()
            times = []
            for _ in range(LATENCY_CALLS if size <= LATENCY_BYTES else 5):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            # A small collective's time is its latency, and a step pays the latencies of all its
            # collectives: their mean, stalls included (module docstring), not a median.
            points.append((4 * n, statistics.mean(times) if size <= LATENCY_BYTES else statistics.median(times)))
        out[kind] = _fit(points)
    return out


def queued_cost(fits: dict, world: int) -> float:
    """Seconds a collective costs beyond its own (alone, `fits`' points) when QUEUED_CALLS of its
    kind are issued at once and then waited for (module docstring): the median over kinds and sizes."""
    import torch.distributed as dist

    extra = []
    for kind in KINDS:
        alone = dict((int(x), y) for x, y in fits[kind]["points"])
        for size in QUEUED_SIZES:
            n = size // 4 // world * world
            full, part = torch.ones(n), torch.ones(n // world)
            issue = {"all_reduce": lambda: dist.all_reduce(full, async_op=True),
                     "reduce_scatter": lambda: dist.reduce_scatter_single(part, full, async_op=True),
                     "all_gather": lambda: dist.all_gather_single(full, part, async_op=True),
                     "broadcast": lambda: dist.broadcast(full, 0, async_op=True)}[kind]
            times = []
            for _ in range(5):
                dist.barrier()
                t0 = time.perf_counter()
                for work in [issue() for _ in range(QUEUED_CALLS)]:
                    work.wait()
                times.append((time.perf_counter() - t0) / QUEUED_CALLS)
            extra.append(statistics.median(times) - alone.get(4 * n, min(alone.values())))
    return max(0.0, statistics.median(extra))


def aligned_seconds(fn, n: int) -> float:
    """The mean time of `n` calls of `fn` after one untimed, every rank starting together (a
    barrier): a fixed count on every rank, as the calls may issue collectives all must join."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def meeting_cost(trials: int = 9, iterations: int = 12) -> float:
    """Seconds a collective costs beyond its own time because the ranks must meet for it: every
    rank runs a chunk of compute (32 matmuls of 384 x 384, some 20 ms of one core's) and then a
    4-byte all-reduce, `iterations` times; less the same chunks alone (timed before and after) and
    the all-reduce alone. Where ranks outnumber the cores the scheduler runs them in turns, so they
    reach each meeting at different times and the cores sit partly idle while the first wait; with
    a core each, ~0. The median of `trials` such differences: one difference of two ~20 ms means
    read 2.0-5.6 ms in five trials of one quiet minute here (2026-12-06), and the prediction of a
    strategy that waits for ~30 collectives a step moved with it (bench/RESULTS.md)."""
    import torch.distributed as dist

    a, b, flag = torch.randn(384, 384), torch.randn(384, 384), torch.zeros(1)

    def chunk():
        for _ in range(32):
            torch.mm(a, b)

    differences = []
    for _ in range(trials):
        before = aligned_seconds(chunk, iterations)
        alone = aligned_seconds(lambda: dist.all_reduce(flag), 5 * iterations)
        both = aligned_seconds(lambda: (chunk(), dist.all_reduce(flag)), iterations)
        after = aligned_seconds(chunk, iterations)
        differences.append(both - (before + after) / 2 - alone)
    return max(0.0, statistics.median(differences))


def _fit(points: list[tuple[int, float]]) -> dict:
    """t = latency + bytes / bandwidth: the latency the median time of the sizes up to 64 KiB (where
    the bytes cost next to nothing: one disturbed size among three does not move it), the bandwidth
    the least-squares slope over the sizes from 1 MiB (where they cost most of it); all points kept."""
    small = [y for x, y in points if x <= 64 << 10]
    large = [(x, y) for x, y in points if x >= 1 << 20] or points
    xs, ys = [p[0] for p in large], [p[1] for p in large]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs) if len(xs) > 1 else 0.0
    latency = statistics.median(small) if small else max(0.0, my - slope * mx)
    return {"latency_s": latency, "bandwidth": 1.0 / slope if slope > 0 else float("inf"),
            "points": [[x, y] for x, y in points]}


def _worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        figures = {}
        for name, bench in (("matmul_fp32", lambda: matmul_rate(torch.float32)),
                            ("matmul_bf16", lambda: matmul_rate(torch.bfloat16)), ("attention_fp32", attention_rate),
                            ("memory_bandwidth", memory_rate), ("fused_adamw_bandwidth", fused_adamw_rate)):
            dist.barrier()  # every rank measures at once, as a real run's ranks compute at once
            figures[name] = bench()
        dist.barrier()
        figures["op_overhead_s"] = op_overhead(figures["memory_bandwidth"])
        dist.barrier()
        figures["table"] = measure_table()
        dist.barrier()
        if world > 1:
            figures["gloo"] = {str(world): gloo_fits(world)}
            dist.barrier()
            figures["queued_s"] = queued_cost(figures["gloo"][str(world)], world)
            dist.barrier()
            figures["meeting_s"] = meeting_cost()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(figures, f)
        # No rank tears its connections down while another is still in a collective: gloo's
        # threads abort the process (std::terminate) when a peer vanishes under them.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(ranks: int) -> dict:
    """The figures of `ranks` ranks measuring at once: each the median over the ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="zerolab-calibrate-") as d:
        init = "file://" + os.path.join(d, "store")
        mp.start_processes(_worker, args=(ranks, init, d), nprocs=ranks, start_method="spawn")
        per_rank = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(ranks)]
    out = {k: statistics.median(p[k] for p in per_rank) for k in per_rank[0] if k not in ("gloo", "table")}
    out.update(merge_tables([p["table"] for p in per_rank]))  # kernels, host_s_per_kernel
    if ranks > 1:
        out["gloo"] = {kind: {str(ranks): per_rank[0]["gloo"][str(ranks)][kind]} for kind in KINDS}
    return out


def calibrate(counts=(1, 2, 3)) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers' (spawned processes inherit it)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "cores": os.cpu_count(),
              "date": datetime.date.today().isoformat(), "load_average_before": os.getloadavg()[0], "ranks": {}}
    for n in counts:
        result["ranks"][str(n)] = measure(n)
    # each entry keeps gloo at every size measured, for a group size other than its own rank count
    gloo = {kind: {} for kind in KINDS}
    for n in counts:
        for kind, by_size in result["ranks"][str(n)].get("gloo", {}).items():
            gloo[kind].update(by_size)
    for entry in result["ranks"].values():
        entry["gloo"] = gloo
    result["load_average_after"] = os.getloadavg()[0]
    return result


def cli_main(argv: list[str]) -> int:
    from zerolab.predict.hardware import calibration_path

    p = argparse.ArgumentParser(prog="python -m zerolab.predict calibrate",
                                description="Measure this machine for --hardware cpu (matmul, attention, memory, "
                                            "per-kernel overhead, gloo collectives), with 1, 2 and 3 ranks at once.")
    p.add_argument("--out", default="", help=f"where to write the figures (default {calibration_path()})")
    p.add_argument("--ranks", default="1,2,3", help="rank counts to measure (default 1,2,3)")
    args = p.parse_args(argv)
    counts = tuple(int(n) for n in args.ranks.split(","))
    result = calibrate(counts)
    path = args.out or calibration_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    for n, c in result["ranks"].items():
        print(f"{n} rank(s): matmul fp32 {c['matmul_fp32'] / 1e9:.1f} GFLOP/s, bf16 {c['matmul_bf16'] / 1e9:.1f}, "
              f"attention {c['attention_fp32'] / 1e9:.1f}, memory {c['memory_bandwidth'] / 1e9:.1f} GB/s, "
              f"fused AdamW {c['fused_adamw_bandwidth'] / 1e9:.1f} GB/s, "
              f"{c['op_overhead_s'] * 1e6:.1f} us per kernel, {len(c['kernels'])} kinds of kernel timed "
              f"(+{c['host_s_per_kernel'] * 1e6:.1f} us of host each, "
              f"{c['host_s_per_kernel_step'] * 1e6:.1f} in the optimizer step)"
              + (f", {c['meeting_s'] * 1e3:.2f} ms per meeting, +{c['queued_s'] * 1e3:.2f} ms per queued "
                 "collective" if "meeting_s" in c else ""))
    for kind, by_size in result["ranks"][str(counts[-1])]["gloo"].items():
        print(f"gloo {kind}: " + ", ".join(f"{n} ranks {f['latency_s'] * 1e6:.0f} us + bytes / "
                                           f"{f['bandwidth'] / 1e9:.2f} GB/s" for n, f in sorted(by_size.items())))
    print(f"written: {path} (load average {result['load_average_before']:.2f} before, "
          f"{result['load_average_after']:.2f} after)", file=sys.stderr)
    return 0
