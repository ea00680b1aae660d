"""Hydra launcher `torchrun`: every job of a multirun is a separate `torchrun ... train.py` run.

Why a launcher and not Hydra's basic one: the basic launcher runs the jobs one after another
inside the `python train.py -m` process, so they would share one process (one rank, one process
group, DeepSpeed's process-global state) instead of each getting N fresh ranks. This launcher
keeps Hydra's sweep syntax (`-m strategy=ddp,zero1,...`) and its sweeper, and for each job starts
`torchrun --standalone --nproc_per_node=N train.py <the job's overrides> run.dir=<sweep>/<job>`,
one job at a time (they would compete for the same cores). With `hydra.launcher.rounds=R` the
job list runs R times, every other round in reverse order, into `<n>-<label>-r<k>` directories;
the report pools the rounds' step times (its intervals then hold the spread between rounds).
sweep.json records the load average before and after the sweep and around each job. Results:

  <hydra.sweep.dir>/            multirun.yaml (Hydra's), sweep.json (jobs, run dirs, exit codes)
  <hydra.sweep.dir>/<n>-<label>/   one zerolab run directory per job (config, metrics, weights)
  <hydra.sweep.dir>/<n>-<label>.log   the job's console output
  <hydra.sweep.dir>/report/     `python -m zerolab compare` of the sweep (hydra.launcher.report=false: none)

Selected by `hydra/launcher=torchrun` (conf/experiment/compare.yaml selects it for the sweep).
(No `from __future__ import annotations`: Hydra loads plugin modules without registering them
in sys.modules, which dataclasses with string annotations cannot handle.)
"""

import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from zerolab.errors import ZerolabError

log = logging.getLogger(__name__)


class SweepJobFailed(ZerolabError):
    """A job of the sweep failed: train.py says it in one line and exits 1 (Hydra raises it when it
    reads the job's return value, after the launcher has run every job and printed each failure)."""


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.zerolab_torchrun.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: int = 2
    extra_args: List[str] = field(default_factory=list)  # more torchrun arguments
    timeout_s: float = 0  # per job; 0: none
    stop_on_failure: bool = False  # false: run the remaining jobs, report failures at the end
    report: bool = True  # after the jobs: python -m zerolab compare <sweep dir> --out <sweep dir>/report
    rounds: int = 2  # run the job list this many times, alternating its order; the report pools timings


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="zerolab")


def job_labels(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Name each job by the values that differ between jobs (e.g. the strategy)."""
    parsed = [dict(o.split("=", 1) for o in ov if "=" in o) for ov in job_overrides]
    keys = sorted({k for p in parsed for k in p})
    varying = [k for k in keys if len({p.get(k) for p in parsed}) > 1] or keys[:1]
    labels = []
    for p in parsed:
        parts = [p.get(k, "") if len(varying) == 1 else f"{k.split('.')[-1]}={p.get(k, '')}" for k in varying]
        labels.append(re.sub(r"[^A-Za-z0-9_.=,-]+", "_", "_".join(parts))[:80] or "job")
    return labels


class TorchrunLauncher(Launcher):
    def __init__(self, nproc_per_node: int = 2, extra_args: Optional[list] = None, timeout_s: float = 0,
                 stop_on_failure: bool = False, report: bool = True, rounds: int = 2) -> None:
        self.nproc_per_node, self.extra_args = nproc_per_node, list(extra_args or [])
        self.timeout_s, self.stop_on_failure, self.report = timeout_s, stop_on_failure, report
        if rounds < 1:
            raise ValueError(f"hydra.launcher.rounds={rounds}: must be at least 1")
        self.rounds = rounds
        self.config: Optional[DictConfig] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        script = os.path.abspath(sys.argv[0])
        index_path = sweep_dir / "sweep.json"
        index = json.loads(index_path.read_text()) if index_path.exists() else {"jobs": []}
        results, failed = {}, False
        # What the machine was doing (the report prints it): load averages around the sweep.
        index.setdefault("loadavg", {"before": list(os.getloadavg()), "cores": os.cpu_count()})
        jobs = list(enumerate(zip(job_overrides, job_labels(job_overrides))))
        # Round k runs the list in reverse when k is odd: a drift of the machine's load during the
        # sweep then does not always favour the same jobs (the report pools the rounds' timings).
        schedule = [(k, job) for k in range(self.rounds) for job in (jobs if k % 2 == 0 else jobs[::-1])]
        for n_done, (rnd, (i, (overrides, label))) in enumerate(schedule):
            num = initial_job_idx + i
            name = f"{num}-{label}" + (f"-r{rnd}" if rnd else "")
            run_dir = sweep_dir / name
            # hydra.* overrides configure this process's sweep, not the job.
            job_args = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={self.nproc_per_node}", *self.extra_args, script, *job_args,
                   f"run.dir={run_dir}"]
            entry = {"num": num, "round": rnd, "name": name, "overrides": list(overrides), "run_dir": str(run_dir),
                     "log": str(sweep_dir / f"{name}.log"), "command": cmd}
            ret = JobReturn(overrides=list(overrides), working_dir=str(run_dir), task_name=name)
            if failed and self.stop_on_failure:
                entry["status"] = "not run"
                ret.status, ret._return_value = JobStatus.FAILED, SweepJobFailed(
                    f"{name}: not run (an earlier job failed)")
            else:
                print(f"[sweep {n_done + 1}/{len(schedule)}] {' '.join(job_args)}"
                      + (f" (round {rnd + 1}/{self.rounds})" if self.rounds > 1 else ""), flush=True)
                t0 = time.time()
                entry["loadavg_before"] = list(os.getloadavg())
                with open(entry["log"], "w") as out:
                    # one wandb group per sweep (zerolab.run.metrics reads it)
                    env = dict(os.environ, ZEROLAB_WANDB_GROUP=f"{self.config.experiment}/{sweep_dir.name}")
                    try:
                        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              timeout=self.timeout_s or None).returncode
                    except subprocess.TimeoutExpired:
                        code = 124
                entry.update(returncode=code, seconds=round(time.time() - t0, 1), loadavg_after=list(os.getloadavg()))
                if code == 0:
                    entry["status"] = "ok"
                    ret.status = JobStatus.COMPLETED
                    summary = run_dir / "summary.json"
                    ret._return_value = json.loads(summary.read_text()) if summary.exists() else None
                    print(f"    ok in {entry['seconds']:.0f}s -> {run_dir}", flush=True)
                else:
                    failed, entry["status"] = True, "failed"
                    tail = Path(entry["log"]).read_text(errors="replace")[-3000:]
                    print(f"    FAILED (exit {code}) after {entry['seconds']:.0f}s; log: {entry['log']}\n{tail}",
                          file=sys.stderr, flush=True)
                    ret.status = JobStatus.FAILED
                    ret._return_value = SweepJobFailed(f"sweep job {name} exited with {code}; its output is in "
                                                       f"{entry['log']} (the sweep's index: {index_path})")
            index["jobs"] = [j for j in index["jobs"] if (j["num"], j.get("round", 0)) != (num, rnd)] + [entry]
            index["loadavg"]["after"] = list(os.getloadavg())
            tmp = index_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(index, indent=2))
            os.replace(tmp, index_path)
            if i not in results or ret.status == JobStatus.FAILED:  # one return per job; a failed round fails it
                results[i] = ret
        results = [results[i] for i in sorted(results)]
        if self.report and any(r.status == JobStatus.COMPLETED for r in results):
            # The comparison of everything in the sweep directory (earlier batches included).
            print(f"[sweep] report: python -m zerolab compare {sweep_dir} --out {sweep_dir / 'report'}", flush=True)
            subprocess.run([sys.executable, "-m", "zerolab", "compare", str(sweep_dir), "--out",
                            str(sweep_dir / "report")], check=False)
        return results
