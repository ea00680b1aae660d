"""How long a preemption takes: from the stop signal to the launcher's exit, per launcher path.

    python bench/stop_time.py [--repeats 3] [--ranks 2,4] [--model gpt_tiny]

Each case starts a real job (gpt_tiny on CPU ranks, gloo), waits until rank 0 has logged step 3,
sends the signal a scheduler would send and times until the launcher exits:

- torchrun, SIGTERM to the agent (a preempting scheduler, `kill`);
- torchrun --shutdown-timeout=120, SIGTERM (what docs/checkpoints.md advises for large models: the
  grace period is an upper bound, not a wait);
- torchrun --signals-to-handle=...,SIGUSR1, SIGUSR1 to the agent;
- launch/torchrun.sh, SIGUSR1 to the script (it passes a TERM on).

Printed per case: p50 and p95 of the seconds from the signal to the exit, the exit code, whether
torchrun had to SIGKILL a worker ("forcefully exiting"), and how many times the stop was said. A
rank that waited for a second signal shows as ~30 s (torchrun's default grace period) and a
SIGKILL. What it does not time: the save of a large model (gpt_tiny's checkpoint is ~1.5 MB).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
USR1 = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# (name, command head given nproc, signal to send)
CASES = [
    ("torchrun, SIGTERM", lambda n: [*TORCHRUN, f"--nproc_per_node={n}", str(ROOT / "train.py")], signal.SIGTERM),
    ("torchrun --shutdown-timeout=120, SIGTERM",
     lambda n: [*TORCHRUN, f"--nproc_per_node={n}", "--shutdown-timeout=120", str(ROOT / "train.py")], signal.SIGTERM),
    ("torchrun --signals-to-handle +USR1, SIGUSR1",
     lambda n: [*TORCHRUN, f"--nproc_per_node={n}", USR1, str(ROOT / "train.py")], signal.SIGUSR1),
    ("launch/torchrun.sh, SIGUSR1", lambda n: [str(ROOT / "launch" / "torchrun.sh")], signal.SIGUSR1),
]


def one(head, sig, nproc: int, model: str) -> tuple[float, int, bool, int]:
    """(seconds from the signal to the exit, exit code, a worker SIGKILLed, times the stop was said)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*head, f"run.dir={tmp}/run", f"model={model}", "data=synthetic", "trainer.max_steps=100000",
               "trainer.eval_every=0", "logging.wandb.mode=disabled", "logging.progress=false"]
        env = dict(os.environ, OMP_NUM_THREADS="1", NPROC=str(nproc), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        lines = []
        for line in proc.stdout:  # until rank 0 has logged step 3
            lines.append(line)
            if "step 3/100000 |" in line:
                break
        t0 = time.monotonic()
        proc.send_signal(sig)
        lines.extend(proc.stdout)
        code = proc.wait()
        elapsed = time.monotonic() - t0
    text = "".join(lines)
    killed = "forcefully exiting" in text
    said = len(re.findall(r"^(?:\[default\d+\]:)?zerolab: stopped after step", text, re.MULTILINE))
    return elapsed, code, killed, said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--model", default="gpt_tiny")
    args = ap.parse_args()
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d')}, commit {commit}; torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; model {args.model}, "
          f"{args.repeats} stops per case")
    print("| ranks | launcher, signal | p50 s | p95 s | exit codes | SIGKILLed | stop said |")
    print("|---:|---|---:|---:|---|---|---|")
    for nproc in map(int, args.ranks.split(",")):
        for name, head, sig in CASES:
            runs = [one(head(nproc), sig, nproc, args.model) for _ in range(args.repeats)]
            times = sorted(r[0] for r in runs)
            p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
            print(f"| {nproc} | {name} | {statistics.median(times):.1f} | {p95:.1f} | "
                  f"{sorted({r[1] for r in runs})} | {sum(r[2] for r in runs)} of {len(runs)} | "
                  f"{sorted({r[3] for r in runs})} |", flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
