"""How long the time model takes at scale, on this machine (docs/predict.md, bench/RESULTS.md).

  flock /tmp/zerolab-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/predict_scale.py [--hardware h100]

Llama-2-7B's shape (bench/fit.py's config.json) at 64 ranks on 8 nodes of 8: first
`python -m zerolab dry-run --hardware ... --gpus-per-node 8` for zero3, bf16, AdamW, sequence
4096, micro-batch 1, checkpointed blocks (memory and time predicted, rank 0 rehearsed and
recorded); then `python -m zerolab plan --hardware ...` over zero1, zero2, zero3 and fsdp x
micro-batches 1, 2, 4 x checkpointing off and on (each row that fits rehearsed and priced). Each
runs as its own process; printed: its wall time and peak RSS (getrusage of the finished child),
the load average around it, and its output. Measured, not asserted: the bars (90 s and 2 GB for
the dry run, 10 minutes for the plan) are read off the table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from fit import LLAMA_7B  # noqa: E402


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """(seconds, peak RSS in bytes, stdout) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    # ru_maxrss (kB on Linux) is the largest of the children waited for: each command here is larger than the last
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, 1024 * max(rss, before), proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="h100")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(LLAMA_7B))
        model = ["model=hf", f"model.config={config}"]
        hw = ["--hardware", args.hardware, "--gpus-per-node", "8"]
        dry = [sys.executable, "-m", "zerolab", "dry-run", "--world", "64", *hw, *model, "model.block_size=4096",
               "strategy=zero3", "precision=bf16", "optim=adamw", "data.micro_batch=1",
               "model.activation_checkpointing=blocks"]
        plan = [sys.executable, "-m", "zerolab", "plan", "--world", "64", "--seq", "4096", "--gpu-mem", "80GB",
                "--precision", "bf16", *hw, "--strategies", "zero1,zero2,zero3,fsdp", "--micro-batches", "1,2,4",
                *model]
        for name, cmd in (("dry-run", dry), ("plan", plan)):
            load = os.getloadavg()[0]
            seconds, rss, out = timed(cmd)
            print(f"## {name}: {seconds:.1f} s, peak RSS {rss / 2**30:.2f} GiB, load average {load:.2f} -> "
                  f"{os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)\n", flush=True)
            print("    " + " ".join(c.replace(str(config), "llama7b/config.json") for c in cmd[1:]) + "\n")
            print(out, flush=True)


if __name__ == "__main__":
    main()
