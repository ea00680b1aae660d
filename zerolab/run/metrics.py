"""Metrics: metrics.jsonl in the run directory is the source of truth; wandb mirrors it.

Only rank 0 writes. Per-rank figures are gathered to rank 0 by the trainer and logged as
`rank{r}/...` keys of the same record: one wandb run per job, not one per rank.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import secrets
import sys
from typing import Optional

from zerolab.atomic import atomic_write_text
from zerolab.run.preempt import StopRequest
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


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def append_record(fd: int, line: bytes) -> None:
    """Append one whole record to the open file `fd` (O_APPEND) or nothing: one write per record
    (a short write goes on with the rest), and on a failure what was written of it is cut off
    again, so a reader never sees a torn last line. Raises the write's OSError. A pipe or FIFO
    (metrics.jsonl read live by another process) has no end to seek or cut: there each record is
    one write, whole unless the write itself fails."""
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
    except OSError as err:
        if err.errno != errno.ESPIPE:
            raise
        start = None
    done = 0
    try:
        while done < len(line):
            done += os.write(fd, line[done:])
    except OSError:
        if start is not None:
            os.ftruncate(fd, start)  # frees what the partial record took: it works on a full disk
        raise


class MetricsSink:
    """Rank 0 appends each record to metrics.jsonl (whole or not at all) and mirrors it to wandb.

    A record that does not fit on the disk is cut back and not retried: the sink says what was not
    written through StopRequest.write_failed, so every rank stops after this step
    (zerolab.run.results.DiskFull says it once), and writes nothing more. wandb is a mirror: a
    failure of wandb (its own files in the run directory, its service) is said once as a warning and
    the mirror stops there; metrics.jsonl goes on."""

    def __init__(self, run_dir: str, cfg: LoggingConfig, is_main: bool, experiment: str,
                 job_type: str, config: dict):
        self.is_main = is_main
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if is_main else None
        self.failed: Optional[str] = None  # why a record did not fit (the sink writes nothing after it)
        self.last_written: Optional[int] = None  # the step of the last record written
        self.wandb = None
        if is_main:
            self._mirror(lambda: setattr(self, "wandb", self._init_wandb(cfg, run_dir, experiment, job_type,
                                                                          config)), "starting")

    @staticmethod
    def _init_wandb(cfg: LoggingConfig, run_dir: str, experiment: str, job_type: str, config: dict):
        kwargs = wandb_init_kwargs(cfg, run_dir, experiment, job_type, config)
        if kwargs is None:
            return None
        if not os.environ.get("WANDB_RUN_ID"):  # wandb's own variable for the id wins, as the others do
            kwargs["id"] = wandb_run_id(run_dir)
        import wandb

        return wandb.init(**kwargs)

    def _mirror(self, call, what: str) -> None:
        """A call to wandb; whatever it raises ends the mirror, said once (the run goes on)."""
        try:
            call()
        except Exception as err:  # noqa: BLE001  (wandb raises its own error types, a full disk among them)
            upto = f"after step {self.last_written}" if self.last_written else "before the first record"
            log.warning("wandb failed while %s (%s: %s): its mirror of this run stops here, %s; metrics.jsonl, the "
                        "run's record, is written on", what, type(err).__name__, str(err)[:300], upto)
            self.wandb = None

    def log(self, record: dict) -> Optional[str]:
        """Append `record`; returns None when it was written (or this rank writes nothing), else why
        not (the disk is full: nothing more is written)."""
        if not self.is_main:
            return None
        if self.failed is not None:
            return self.failed
        line = (json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n").encode()
        try:
            append_record(self.fd, line)
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            self.failed = err.strerror or str(err)
            where = f"the record of step {record.get('step')}" if isinstance(record.get("step"), int) else "a record"
            StopRequest.write_failed(self.path, f"{where} did not fit in {self.path} ({self.failed}); the records "
                                                f"up to step {self.last_written or 0} are there, whole")
            return self.failed
        if isinstance(record.get("step"), int):
            self.last_written = record["step"]
        if self.wandb is not None:
            self._mirror(lambda: self.wandb.log({k: v for k, v in record.items() if k != "step"},
                                                step=record.get("step")), f"logging step {record.get('step')}")
        return None

    def close(self, summary: Optional[dict] = None) -> None:
        """Idempotent: the first call closes the file and finishes the wandb run."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.wandb is not None:
            run = self.wandb
            if summary:
                self._mirror(lambda: run.summary.update({k: v for k, v in summary.items()
                                                         if not isinstance(v, (dict, list))}), "finishing")
            self._mirror(run.finish, "finishing")
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
