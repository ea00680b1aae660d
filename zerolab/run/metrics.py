"""Metrics: metrics.jsonl in the run directory is the source of truth; wandb mirrors it.

Only rank 0 writes. Per-rank figures are gathered to rank 0 by the trainer and logged as
`rank{r}/...` keys of the same record: one wandb run per job, not one per rank.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
from typing import Optional

from zerolab.atomic import atomic_write_text
from zerolab.schema import LoggingConfig

log = logging.getLogger(__name__)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/nan; keep them readable instead of failing
    return v


# wandb.init's keywords and the environment variables wandb reads for them when they are not given
WANDB_ENV = {"mode": "WANDB_MODE", "project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "dir": "WANDB_DIR",
             "name": "WANDB_NAME", "group": "WANDB_RUN_GROUP", "job_type": "WANDB_JOB_TYPE"}


def wandb_init_kwargs(cfg: LoggingConfig, run_dir: str, experiment: str, job_type: str, config: dict,
                      environ=os.environ) -> Optional[dict]:
    """wandb.init's arguments, or None when wandb is off. With logging.wandb.mode=auto, wandb's
    convention holds: a WANDB_* variable set in the environment (WANDB_MODE=disabled, WANDB_PROJECT,
    WANDB_DIR, ...) wins over zerolab's default, which is then not passed; without WANDB_MODE the
    mode is online with WANDB_API_KEY, else offline. An explicit mode (online, offline,
    disabled) is zerolab's config speaking, and it is passed as given."""
    kwargs = dict(project=cfg.wandb.project, entity=cfg.wandb.entity or None, dir=run_dir,
                  # a sweep's jobs share one group (set by hydra_plugins/zerolab_torchrun)
                  group=environ.get("ZEROLAB_WANDB_GROUP") or experiment, job_type=job_type, config=config,
                  mode=cfg.wandb.mode, name=os.path.basename(run_dir), reinit="finish_previous",
                  # one run directory, one wandb run: a resumed run continues the same id (MetricsSink)
                  resume="allow")
    mode = cfg.wandb.mode
    if mode == "auto":
        for key, var in WANDB_ENV.items():
            if environ.get(var):
                del kwargs[key]
        if environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):  # wandb's older switch
            return None
        mode = environ.get("WANDB_MODE") or ("online" if environ.get("WANDB_API_KEY") else "offline")
        if "mode" in kwargs:
            kwargs["mode"] = mode
    return None if mode == "disabled" else kwargs


WANDB_ID_FILE = "wandb_run_id"  # in the run directory: the wandb run that mirrors its metrics


def wandb_run_id(run_dir: str) -> str:
    """The wandb run id of this run directory, made on first use and kept in the directory, so a
    resume (or a restart round) logs into the same wandb run. run.overwrite=true removes it with
    the rest of the record (zerolab.run.record): a new history gets a new wandb run."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(path):
        with open(path) as fh:
            found = fh.read().strip()
        if found:
            return found
    run_id = secrets.token_hex(4)  # 8 characters of [0-9a-f]: valid as a wandb id
    atomic_write_text(path, run_id + "\n")
    return run_id


class MetricsSink:
    def __init__(self, run_dir: str, cfg: LoggingConfig, is_main: bool, experiment: str,
                 job_type: str, config: dict):
        self.is_main = is_main
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1) if is_main else None
        self.wandb = self._init_wandb(cfg, run_dir, experiment, job_type, config) if is_main else None

    @staticmethod
    def _init_wandb(cfg: LoggingConfig, run_dir: str, experiment: str, job_type: str, config: dict):
        kwargs = wandb_init_kwargs(cfg, run_dir, experiment, job_type, config)
        if kwargs is None:
            return None
        if not os.environ.get("WANDB_RUN_ID"):  # wandb's own variable for the id wins, as the others do
            kwargs["id"] = wandb_run_id(run_dir)
        import wandb

        return wandb.init(**kwargs)

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        self.file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record.get("step"))

    def close(self, summary: Optional[dict] = None) -> None:
        """Idempotent: the first call closes the file and finishes the wandb run."""
        if self.file:
            self.file.close()
            self.file = None
        if self.wandb is not None:
            if summary:
                self.wandb.summary.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
            self.wandb.finish()
            self.wandb = None


class Progress:
    """What the training loop shows as it goes, on rank 0: a tqdm bar when logging.progress is set
    and stdout and stderr are terminals; otherwise (output redirected to a file or a pipe, Slurm,
    or logging.progress=false) one plain log line per logged step, since a bar's carriage returns
    would make one endless line there. Launch scripts and tests wait on those lines."""

    def __init__(self, is_main: bool, bar: bool, total: int, initial: int, desc: str):
        self.total, self.bar, self.lines = total, None, False
        if is_main and bar and sys.stdout.isatty() and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=desc)
        else:
            self.lines = is_main

    def logged(self, step: int, loss: float, step_s: float, lr: float, skipped: bool = False) -> None:
        """A logged step (1-based `step`, as in metrics.jsonl)."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{step_s:.3f}")
        elif self.lines:
            log.info("step %d/%d | loss %.4f | step %.3f s | lr %.3g%s", step, self.total, loss, step_s, lr,
                     " | update skipped" if skipped else "")

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
