"""What profiling costs, and where the step goes per strategy (zerolab/profile/; bench/RESULTS.md).

  OMP_NUM_THREADS=1 .venv/bin/python bench/step_profile.py cost [--base-rev ff9a6b0] [--rounds 4] [--steps 20]
  OMP_NUM_THREADS=1 .venv/bin/python bench/step_profile.py breakdown [--strategies ddp,zero1,zero2,zero3,deepspeed,fsdp]
  OMP_NUM_THREADS=1 .venv/bin/python bench/step_profile.py hooks
  .venv/bin/python bench/step_profile.py check [--out bench/RESULTS.md] RUN_DIR...   (bench/gpu_check.sh runs it)

hooks: what the trainer's profiler calls cost per step with profiling off, in this process (no
ranks): the step context (the shared null context), profiles() twice (logs_step), rank_figures()
and rates() (MFU, on every logged step), averaged over 200,000 steps.

cost: 2-rank torchrun jobs of train.py (zero2 on --model, fp32, 8×128 tokens per rank per step),
interleaved in alternating order over --rounds: `base` (the tree of --base-rev, unpacked with
`git archive` into a temporary directory: the same run before profiling existed), `off` (this
tree, profile.steps empty), `on` (every step after the warm-up profiled), `trace` (the same with
profile.trace=true). Prints p50/p95 of the steps after --warmup, pooled over rounds, and each
variant's p50 over base's with its 95 % bootstrap interval (zerolab.report.intervals).

breakdown: one sweep (`train.py -m experiment=compare`, one round) of the strategies on
gpt_small with steps --profile profiled, then the report's breakdown table (zerolab compare).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerolab.run.metrics import read_jsonl  # noqa: E402
from zerolab.report.intervals import bootstrap_ratio  # noqa: E402
from zerolab.stats import percentile  # noqa: E402

COMMON = ["strategy=zero2", "data.micro_batch=8", "trainer.eval_every=0", "trainer.eval_batches=1",
          "run.save_model=false", "logging.wandb.mode=disabled", "logging.progress=false"]


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def unpack(rev: str, into: Path) -> str:
    """The tree of commit `rev` in `into` (git archive: the checkout is not touched); its short sha."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return sha.stdout.strip()


def job(tree: Path, run_dir: Path, overrides: list[str], env: dict) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(tree / "train.py"),
           f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [(m["step"], m["step_time_s"]) for m in read_jsonl(str(run_dir / "metrics.jsonl")) if "step_time_s" in m]


def cost(args, env: dict) -> None:
    work = Path(tempfile.mkdtemp(prefix="zerolab-bench-profile-"))
    base_tree = work / "base"
    base_tree.mkdir()
    sha = unpack(args.base_rev, base_tree)
    timed = list(range(args.warmup + 1, args.steps + 1))
    steps = [f"trainer.max_steps={args.steps}", f"model={args.model}"]
    variants = {"base": (base_tree, [*COMMON, *steps]), "off": (ROOT, [*COMMON, *steps]),
                "on": (ROOT, [*COMMON, *steps, f"profile.steps=[{','.join(map(str, timed))}]"]),
                "trace": (ROOT, [*COMMON, *steps, f"profile.steps=[{','.join(map(str, timed))}]",
                                 "profile.trace=true"])}
    names = args.variants.split(",")
    rounds: dict[str, list[list[float]]] = {n: [] for n in names}
    print(f"base: {sha} ({base_tree}); load average before: {loadavg()}", flush=True)
    for k in range(args.rounds):
        for n in (names if k % 2 == 0 else names[::-1]):
            tree, overrides = variants[n]
            t0 = time.time()
            times = job(tree, work / f"{n}-r{k}", overrides, env)
            rounds[n].append([t for s, t in times if s > args.warmup])
            print(f"round {k} {n}: p50 {statistics.median(rounds[n][-1]):.4f} s ({time.time() - t0:.0f} s wall)",
                  flush=True)
    print(f"load average after: {loadavg()}\n")
    print("| variant | rounds × steps | p50 s | p95 s | p50 ÷ base [95 % interval] | verdict |")
    print("|---|---|---:|---:|---|---|")
    for n in names:
        pooled = [t for r in rounds[n] for t in r]
        b = bootstrap_ratio(rounds[n], rounds["base"]) if "base" in rounds else None
        ratio = "1" if n == "base" or b is None else f"{b['ratio']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]"
        print(f"| {n} | {len(rounds[n])} × {len(rounds[n][0])} | {statistics.median(pooled):.4f} | "
              f"{percentile(pooled, 95):.4f} | {ratio} | {'' if n == 'base' or b is None else b['verdict']} |")


def breakdown(args, env: dict) -> None:
    from zerolab.report import build_report

    sweep = Path(tempfile.mkdtemp(prefix="zerolab-bench-breakdown-"))
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "experiment=compare", f"strategy={args.strategies}",
           "model=gpt_small", f"trainer.max_steps={args.breakdown_steps}", "trainer.eval_every=0",
           "trainer.eval_batches=1",
           f"profile.steps={args.profile}", "hydra.launcher.rounds=1", "hydra.launcher.report=false",
           "logging.wandb.mode=disabled", f"hydra.sweep.dir={sweep}"]
    print(" ".join(cmd), f"\nload average before: {loadavg()}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    print(f"load average after: {loadavg()}\n")
    result = build_report([str(sweep)], str(sweep / "report"))
    print(result["breakdown_table"])
    print(f"\nreport: {result['report']}; figure: {result['figures'].get('breakdown')}")


def hooks(args, env: dict) -> None:
    import torch

    from zerolab.config import compose
    from zerolab.models import build_model
    from zerolab.profile import StepProfiler

    cfg = compose(["model=gpt_small", "trainer.peak_flops=1e12", "trainer.max_steps=200000"])
    ctx = argparse.Namespace(device=torch.device("cpu"), world_size=2, rank=0, gather_objects=lambda x: [x, x])
    prof = StepProfiler(cfg, ctx, build_model(cfg.model, device="meta"), "/nonexistent", torch.float32)
    n = cfg.trainer.max_steps
    t0 = time.perf_counter()
    for s in range(n):
        with prof.step(s, None, None):
            pass
        prof.profiles(s)
        prof.profiles(s)
        prof.rank_figures(s)
        prof.rates(0.9)
    per_step = (time.perf_counter() - t0) / n
    print(f"profiling off: {per_step * 1e9:.0f} ns of profiler calls per logged step (torch {torch.__version__}, "
          f"load average {loadavg()})")


def check(args, env: dict) -> None:
    """Each run's profiled steps: do the four parts add up to the step (5 %), is exposed within
    in flight, is rank 0's window the trainer's step time; a table, appended to --out when given."""
    import json

    rows, ok = [], True
    for d in map(Path, args.runs):
        metrics = read_jsonl(str(d / "metrics.jsonl"))
        summary = json.loads((d / "summary.json").read_text())
        for m in (m for m in metrics if "rank0/time/step_s" in m):
            for r in range(summary["world_size"]):
                p = {k: m[f"rank{r}/time/{k}"] for k in
                     ("compute_s", "optimizer_s", "comm_exposed_s", "other_s", "comm_s", "step_s")}
                four = p["compute_s"] + p["optimizer_s"] + p["comm_exposed_s"] + p["other_s"]
                good = abs(four - p["step_s"]) <= 0.05 * p["step_s"] and 0 <= p["comm_exposed_s"] <= p["comm_s"]
                ok &= good
                rows.append(f"| {summary['strategy']} | {m['step']} | {r} | " + " | ".join(
                    f"{p[k] * 1e3:.1f}" for k in p) + f" | {m['step_time_s'] * 1e3:.1f} | {m['mfu'] * 100:.1f} % | "
                    f"{'ok' if good else 'FAILED'} |")
        traces = sorted(x.name for x in (d / "traces").glob("*.json.gz")) if (d / "traces").exists() else []
        rows.append(f"| {summary['strategy']} | traces: {', '.join(traces) or 'none'} | | | | | | | | | | "
                    f"peak {summary['peak_flops'] / 1e12:.1f} TFLOP/s ({summary['peak_flops_source']}) |")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    text = (f"\n## Where the step goes on CUDA (bench/step_profile.py check), {time.strftime('%Y-%m-%d')}, "
            f"commit {sha}\n\n"
            "| strategy | step | rank | compute ms | optimizer ms | exposed comm ms | other ms | comm ms | step ms | "
            "step_time_s ms | MFU | parts add up |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text)
    if not ok:
        sys.exit("some profiled step's parts do not add up to it, or exposed exceeds in flight")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["cost", "breakdown", "hooks", "check"])
    p.add_argument("runs", nargs="*", help="check: run directories with profiled steps")
    p.add_argument("--out", default="", help="check: append the table to this file")
    p.add_argument("--base-rev", default="HEAD", help="cost: the commit before profiling (default HEAD)")
    p.add_argument("--variants", default="base,off,on,trace", help="cost: which of base, off, on, trace")
    p.add_argument("--rounds", type=int, default=4, help="cost: rounds, in alternating order")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="gpt_mid", help="cost: the model (short steps: more rounds in the same time)")
    p.add_argument("--warmup", type=int, default=2, help="cost: steps left out of the timing")
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,deepspeed,fsdp", help="breakdown: the sweep's")
    p.add_argument("--profile", default="[8,9,10]", help="breakdown: profile.steps")
    p.add_argument("--breakdown-steps", type=int, default=12, help="breakdown: trainer.max_steps")
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_MODE="disabled")
    {"cost": cost, "breakdown": breakdown, "hooks": hooks, "check": check}[args.what](args, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
