"""Whether a step-time verdict may be called: how busy the machine was during each job.

A bootstrap interval over steps and rounds (intervals.py) holds the noise of the runs it was
given; it cannot hold a load that slowed one strategy's job and not another's. On a shared
machine such a load flips verdicts (2 cores at a load average of 4: DeepSpeed and torch_zero
"faster" than ddp, the reverse of a quiet machine's). So a verdict is called only when no job of
either run (any round) found the machine busier than it has cores: the mean number of runnable
processes during the job, read from the 1-minute load average before and after it (the sweep's
record, sweep.json), is at most max(cores, the job's ranks) + LOADED_MARGIN. Otherwise the
verdict is "not called", naming the job and its load. Each round's own ratio (the two runs of one
round ran minutes apart, the rounds further) is kept beside the pooled one for the reader.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

from zerolab.report.runs import step_times

# Runnable processes beyond the cores (or the job's own ranks) before a job counts as loaded. A quiet
# sweep's own two ranks hold the 1-minute average near 2 on 2 cores (1.6-2.3 in quiet runs of the
# default job); jobs beside other work read 2.7-7.8 runnable processes (both in bench/RESULTS.md, "The
# default job beside a CPU-heavy job"): the margin lies between.
LOADED_MARGIN = 0.5
LOAD_WINDOW_S = 60.0  # the kernel's 1-minute average decays as exp(-t / 60 s)
NOT_CALLED = "not called"


def busy_during(job: dict) -> Optional[float]:
    """The mean number of runnable processes during a sweep job, from its 1-minute load average
    before and after it and its seconds: the average moves from `before` towards the mean it was
    fed, by 1 - exp(-seconds / 60). A job too short to move it (under 6 s) reads as the larger of
    the two; without a load recorded before it, the one after. None when nothing was recorded."""
    before, after, secs = job.get("loadavg_before"), job.get("loadavg_after"), job.get("seconds")
    if not after:
        return None
    if not before or not secs:
        return float(after[0])
    moved = 1.0 - math.exp(-float(secs) / LOAD_WINDOW_S)
    if moved < 0.1:
        return float(max(before[0], after[0]))
    return max(0.0, (after[0] - before[0] * (1.0 - moved)) / moved)


def job_loads(paths: list[str]) -> dict[Path, dict]:
    """Each sweep job's load, by its run directory (resolved): {"busy", "cores", "name",
    "before", "after", "seconds"}, from the sweep.json of every sweep directory in `paths`."""
    out: dict[Path, dict] = {}
    for p in map(Path, paths):
        index = p / "sweep.json"
        if not index.exists():
            continue
        sweep = json.loads(index.read_text())
        cores = sweep.get("loadavg", {}).get("cores")
        for j in sweep.get("jobs", []):
            busy = busy_during(j)
            if busy is not None and cores:
                out[Path(j["run_dir"]).resolve()] = {
                    "busy": busy, "cores": int(cores), "name": j.get("name", Path(j["run_dir"]).name),
                    "before": (j.get("loadavg_before") or [None])[0], "after": j["loadavg_after"][0],
                    "seconds": j.get("seconds")}
    return out


def _loaded(run, base, loads: dict[Path, dict]) -> str:
    """The jobs of `run` and `base` (every round) that ran on a loaded machine, in words ('' when
    none did): each job's name and the mean of runnable processes during it, by core count."""
    by_cores: dict[int, list[str]] = {}
    for x in [run, *run.repeats, base, *base.repeats]:
        job = loads.get(x.path.resolve())
        if job is not None and job["busy"] > max(job["cores"], x.world) + LOADED_MARGIN:
            by_cores.setdefault(job["cores"], []).append(f"{job['name']} {job['busy']:.1f}")
    return "; ".join(f"on {cores} cores: {', '.join(jobs)}" for cores, jobs in by_cores.items())


def round_ratios(run, base) -> dict[int, float]:
    """p50 ÷ the baseline's p50 within each round both ran (a sweep round: the same minutes)."""
    mine = {x.round: step_times(x) for x in [run, *run.repeats]}
    theirs = {x.round: step_times(x) for x in [base, *base.repeats]}
    return {k: statistics.median(mine[k]) / statistics.median(theirs[k])
            for k in sorted(mine) if k in theirs and mine[k] and theirs[k]}


def judge(timing: dict, run, base, loads: dict[Path, dict]) -> dict:
    """`timing` (bootstrap_ratio's) with the verdict the load allows: the interval's own verdict
    kept as "interval_verdict", the rounds' ratios as "round_ratios" and, when the verdict is not
    called, "why" (the jobs and their load)."""
    out = {**timing, "interval_verdict": timing["verdict"]}
    if run is base or timing["verdict"] == "no timings":
        return out
    out["round_ratios"] = round_ratios(run, base)
    loaded = _loaded(run, base, loads)
    if loaded:
        out["verdict"] = NOT_CALLED
        out["why"] = (f"the machine was loaded (runnable processes on average during each job, from the 1-minute "
                      f"load average before and after it, {loaded}), so the ratio measures the load as much as "
                      "the strategies; rerun the sweep with nothing beside it")
    return out
