"""How far apart the ranks run inside a profiled step: each collective's issue on each rank, on the
one clock the ranks of a machine share (docs/predict.md, "What it still misses here").

  flock /tmp/zerolab-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/rank_lag.py strategy=zero3 [overrides]

Runs the default job's settings (experiment=compare: gpt_mid, 8 x 128 tokens a rank, steps 4, 6,
... profiled) on 2 ranks with every collective's issue timed (zerolab.profile.commwatch, as the
profile times it), then prints per profiled step: the most rank 1 ran behind rank 0 and ahead of
it at an issue, and each rank's time inside waits and launches (its exposed communication);
and the middle step collective by collective. time.perf_counter is CLOCK_MONOTONIC on Linux: the
ranks' readings compare directly.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rank_main(out_dir: str, overrides: list[str]) -> None:
    """One rank: train.py with CommWatch's launcher also keeping each collective's name and issue."""
    import runpy

    sys.path.insert(0, str(ROOT))
    from zerolab.profile import commwatch

    log = open(os.path.join(out_dir, f"rank{os.environ['RANK']}.jsonl"), "a")
    launcher, keep_running = commwatch.CommWatch._launcher, commwatch.CommWatch.keep_running

    def named_launcher(watch, original):
        wrapped = launcher(watch, original)

        def collective(pg, *args, **kwargs):
            watch.__dict__.setdefault("issued", []).append((original.__name__, time.perf_counter()))
            return wrapped(pg, *args, **kwargs)
        return collective

    def logged_keep_running(watch, end: float, carry: bool) -> None:
        if watch.__dict__.get("issued"):
            log.write(json.dumps({"issued": watch.issued, "waits": watch.waits}) + "\n")
            log.flush()
        watch.issued = []
        keep_running(watch, end, carry)

    commwatch.CommWatch._launcher = named_launcher
    commwatch.CommWatch.keep_running = logged_keep_running
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def main(overrides: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="zerolab-lag-") as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--rank-main", d, "experiment=compare", "run.save_model=false", "logging.wandb.mode=disabled",
               f"run.dir={d}/run", *overrides]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        steps = [[json.loads(line) for line in open(os.path.join(d, f"rank{r}.jsonl"))] for r in (0, 1)]
    print(f"{' '.join(overrides)}: 2 ranks, load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("\n| profiled step | rank 1 behind rank 0 at most, ms | ahead at most, ms | waits rank 0, ms "
          "| waits rank 1, ms |")
    print("|---:|---:|---:|---:|---:|")
    behind, ahead = [], []
    for i, (s0, s1) in enumerate(zip(*steps)):
        lags = [b[1] - a[1] for a, b in zip(s0["issued"], s1["issued"])]
        behind.append(max(0.0, max(lags)))
        ahead.append(max(0.0, -min(lags)))
        waits = [sum(t1 - t0 for t0, t1 in s["waits"]) for s in (s0, s1)]
        print(f"| {i + 1} | {behind[-1] * 1e3:.1f} | {ahead[-1] * 1e3:.1f} | {waits[0] * 1e3:.1f} "
              f"| {waits[1] * 1e3:.1f} |")
    print(f"\nmedian over the steps: rank 1 behind at most {statistics.median(behind) * 1e3:.1f} ms, "
          f"ahead at most {statistics.median(ahead) * 1e3:.1f} ms")
    s0, s1 = steps[0][len(steps[0]) // 2], steps[1][len(steps[1]) // 2]
    t0 = s0["issued"][0][1]
    print(f"\nprofiled step {len(steps[0]) // 2 + 1}, each collective's issue (ms from rank 0's first):")
    print("\n| collective | rank 0 | rank 1 | rank 1 - rank 0 |\n|---|---:|---:|---:|")
    for a, b in zip(s0["issued"], s1["issued"]):
        print(f"| {a[0]} | {(a[1] - t0) * 1e3:.1f} | {(b[1] - t0) * 1e3:.1f} | {(b[1] - a[1]) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-main":
        _rank_main(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main(sys.argv[1:]))
