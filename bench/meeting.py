"""What a collective costs because the ranks must meet for it, on this machine (docs/predict.md).

  flock /tmp/zerolab-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/meeting.py [--ranks 2] [--trials 7]

Every rank runs a chunk of compute (k matmuls of 384 x 384) and then a collective, in a loop; the
meeting is that loop's time per iteration less the chunk alone (timed before and after) and the
collective alone, the median over --trials rounds. Two tables:

- by the compute between meetings (a 4-byte all-reduce after 2, 8, 32 and 128 matmuls): the
  difference above, and the time the ranks spent inside the all-reduce less its time alone, which
  is what a profile counts as exposed communication;
- by the collective (all-reduce, all-gather, reduce-scatter of 4 B to 3 MiB after 32 matmuls);
- each collective alone at the sizes the calibration takes its latency from (4-64 KiB), 40 calls
  with a barrier before each: the median of the first 5 (what the calibration kept before
  2f03e4b), the median and the mean of all 40, the slowest.

The calibration (zerolab/predict/calibrate.py, meeting_cost) measures the second table's first
cell: a 4-byte all-reduce after 32 matmuls.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerolab.predict.calibrate import aligned_seconds  # noqa: E402

CHUNKS = (2, 8, 32, 128)
SIZES = (4, 64 << 10, 768 << 10, 3 << 20)
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
LATENCY_SIZES, LATENCY_CALLS = (4 << 10, 16 << 10, 64 << 10), 40


def _meeting(chunk, call, n: int) -> tuple[float, float]:
    """(the loop's time less the chunk's and the call's alone, the mean time inside the call in the
    loop less its time alone), seconds."""
    before = aligned_seconds(chunk, n)
    alone = aligned_seconds(call, 30)
    inside = []

    def both():
        chunk()
        t0 = time.perf_counter()
        call()
        inside.append(time.perf_counter() - t0)
    loop = aligned_seconds(both, n)
    after = aligned_seconds(chunk, n)
    return loop - (before + after) / 2 - alone, statistics.mean(inside) - alone


def _worker(rank: int, world: int, init: str, trials: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def chunk_of(k: int):
        def chunk():
            for _ in range(k):
                torch.mm(a, b)
        return chunk

    def call_of(kind: str, size: int):
        n = max(size // 4 // world * world, world)
        full, part = torch.ones(n), torch.ones(n // world)
        if kind.startswith("broadcast"):
            return lambda: dist.broadcast(full, 0)
        return {"all_reduce": lambda: dist.all_reduce(full),
                "all_gather": lambda: dist.all_gather_single(full, part),
                "reduce_scatter": lambda: dist.reduce_scatter_single(part, full)}[kind]

    rows = []
    flag = call_of("all_reduce", 4)
    for k in CHUNKS:
        c = chunk_of(k)
        got = [_meeting(c, flag, max(4, 512 // k)) for _ in range(trials)]
        rows.append(("chunk", k, aligned_seconds(c, max(4, 512 // k)), [g[0] for g in got], [g[1] for g in got]))
    for kind in KINDS:
        for size in SIZES:
            got = [_meeting(chunk_of(32), call_of(kind, size), 12) for _ in range(trials)]
            rows.append((kind, size, 0.0, [g[0] for g in got], [g[1] for g in got]))
    for kind in (*KINDS, "broadcast"):
        for size in LATENCY_SIZES:
            call = call_of(kind, size) if kind != "broadcast" else call_of("broadcast_" + str(size), size)
            call()
            times = []
            for _ in range(LATENCY_CALLS):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            rows.append(("alone " + kind, size, 0.0, times, [statistics.median(times[:5])]))
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        with open(out, "w") as f:
            for i, (what, x, chunk_s, _, _) in enumerate(rows):
                if what.startswith("alone"):  # rank 0's calls: each call's time is the same on every rank, within skew
                    t = rows[i][3]
                    f.write(f"{what}\t{x}\t{rows[i][4][0]}\t{statistics.median(t)}\t{statistics.mean(t)}\t"
                            f"{max(t)}\t0\n")
                    continue
                loops = [statistics.median(r[i][3]) for r in every]
                insides = [statistics.median(r[i][4]) for r in every]
                spread = [min(min(r[i][3]) for r in every), max(max(r[i][3]) for r in every)]
                f.write(f"{what}\t{x}\t{chunk_s}\t{statistics.mean(loops)}\t{spread[0]}\t{spread[1]}\t"
                        f"{statistics.mean(insides)}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--trials", type=int, default=7)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.tsv")
        mp.start_processes(_worker, args=(args.ranks, "file://" + os.path.join(d, "store"), args.trials, out),
                           nprocs=args.ranks, start_method="spawn")
        rows = [line.rstrip("\n").split("\t") for line in open(out)]
    print(f"{args.ranks} ranks, {os.cpu_count()} cores, torch {torch.__version__}, {args.trials} trials; "
          f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; ms, the ranks' mean of their medians "
          "[lowest, highest trial of any rank]")
    print("\n| compute between meetings | meeting (loop less both alone) | inside the all-reduce, less alone |")
    print("|---:|---:|---:|")
    for what, x, chunk_s, loop, lo, hi, inside in rows:
        if what == "chunk":
            print(f"| {x} matmuls, {float(chunk_s) * 1e3:.1f} ms | {float(loop) * 1e3:.2f} "
                  f"[{float(lo) * 1e3:.2f}, {float(hi) * 1e3:.2f}] | {float(inside) * 1e3:.2f} |")
    print("\n| collective after 32 matmuls | bytes | meeting | inside, less alone |")
    print("|---|---:|---:|---:|")
    for what, x, _, loop, lo, hi, inside in rows:
        if what != "chunk" and not what.startswith("alone"):
            print(f"| {what} | {int(x)} | {float(loop) * 1e3:.2f} [{float(lo) * 1e3:.2f}, {float(hi) * 1e3:.2f}] "
                  f"| {float(inside) * 1e3:.2f} |")
    print(f"\n| alone, {LATENCY_CALLS} calls (rank 0) | bytes | median of the first 5 | median | mean | slowest |")
    print("|---|---:|---:|---:|---:|---:|")
    for what, x, first5, median, mean, slowest, _ in rows:
        if what.startswith("alone"):
            print(f"| {what[6:]} | {int(x)} | {float(first5) * 1e3:.2f} | {float(median) * 1e3:.2f} | "
                  f"{float(mean) * 1e3:.2f} | {float(slowest) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
