"""The remainder master on real ranks at gpt_small's size: precision.master=remainder against an
fp32-master run whose weights are rounded as the remainder's (precision.weight_rounding=nearest_away),
under zerolab's zero1/zero2/zero3 with AdamW and LAMB at 2 and 3 ranks, 50 steps.

  python bench/master_exact_runs.py [--steps 50] [--out /tmp/master_exact]

Each pair is two torchrun jobs of train.py (gloo, OMP_NUM_THREADS=1 per rank). Printed per pair:
whether every step's loss and gradient norm are equal (metrics.jsonl, every step logged), whether
the final fp32 master (model.safetensors) is bitwise equal, and the master bytes per rank the run
measured against the fp32 master's (mem/master_bytes: the remainder's are half). tests/test_master_runs.py
checks the same on gpt_tiny in every run of the suite; this is the issue's own size and length.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
CASES = [("zero1", 2, "adamw"), ("zero2", 2, "lamb"), ("zero3", 2, "adamw"), ("zero1", 3, "lamb"),
         ("zero2", 3, "adamw"), ("zero3", 3, "lamb")]


def run(out: Path, world: int, steps: int, *overrides: str) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "train.py"), "model=gpt_small", "precision=bf16", f"trainer.max_steps={steps}",
           "trainer.eval_every=0", "data.micro_batch=4", "logging.wandb.mode=disabled", "logging.progress=false",
           "run.overwrite=true", f"run.dir={out}", *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out


def steps_of(run_dir: Path) -> list[tuple]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r and "grad_norm" in r]


def master_bytes(run_dir: Path, world: int) -> list[int]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(r for r in recs if "rank0/mem/master_bytes" in r)
    return [first[f"rank{r}/mem/master_bytes"] for r in range(world)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default="/tmp/master_exact")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"gpt_small, bf16, {a.steps} steps, data.micro_batch=4, gloo; commit {commit.strip()}; "
          f"torch {torch.__version__}")
    print(f"{'strategy':<8} {'ranks':>5} {'optim':<6} {'steps equal':>11} {'master bitwise':>14}  "
          "master bytes per rank "
          "(remainder / fp32)")
    ok = True
    for strategy, world, optim in CASES:
        base = Path(a.out) / f"{strategy}-{world}-{optim}"
        fp32 = run(base / "fp32", world, a.steps, f"strategy={strategy}", f"optim={optim}",
                   "precision.weight_rounding=nearest_away")
        rem = run(base / "rem", world, a.steps, f"strategy={strategy}", f"optim={optim}",
                  "precision.master=remainder")
        same_steps = steps_of(rem) == steps_of(fp32) and len(steps_of(fp32)) == a.steps
        wa, wb = load_file(str(rem / "model.safetensors")), load_file(str(fp32 / "model.safetensors"))
        same_master = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        ok &= same_steps and same_master
        print(f"{strategy:<8} {world:>5} {optim:<6} {str(same_steps):>11} {str(same_master):>14}  "
              f"{master_bytes(rem, world)} / {master_bytes(fp32, world)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
