"""A run directory is the record of one training run, and it holds one history.

What the record is: metrics.jsonl (the source of truth that `zerolab compare`, the plots and
wandb show), the final results (summary.json, model.safetensors, the eval digest) and the
checkpoints. Three rules keep it one history:

- A fresh start (no checkpoint.resume) in a directory that already holds a record is refused
  before any rank trains, and nothing in it is touched: the message says how to go on (resume,
  a new run.dir, or run.overwrite=true, which says what it removes). A later round of the same
  job (a torchrun restart, a Slurm requeue) starting from scratch is the exception: the record is
  its own, and it is cut back to step 0.
- A resume at step S first cuts the record back to S: metrics lines after S are dropped, by
  writing the kept prefix to a temporary file and renaming it over the old one (a kill at any
  moment leaves the old record or the cut one, never a torn file).
- The run checkpoints its last step too (zerolab.trainer), so resuming a finished run continues
  from where it stopped.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Callable, Optional

from zerolab.atomic import atomic_path
from zerolab.errors import ConfigError
from zerolab.run.metrics import WANDB_ID_FILE  # the wandb run mirroring this record: a new history gets a new one

log = logging.getLogger("zerolab")

METRICS = "metrics.jsonl"
# What a finished run leaves beside its metrics (zerolab.trainer.finish, zerolab.digest).
RESULTS = ("summary.json", "model.safetensors", "eval_logits.safetensors", "grad_noise.safetensors")


class RecordExists(ConfigError):
    """A fresh start in a run directory that holds another run's record."""

    same_on_every_rank = True  # rank 0 decides and shares it (zerolab.run.directory.claim)


def later_round() -> bool:
    """Whether this process is a restart of a job that already ran in this directory: a torchrun
    restart round or a requeued Slurm job. Its record is its own."""
    return any(int(os.environ.get(v, "0") or 0) > 0 for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def _checkpoints(checkpoint_dir: str) -> list[str]:
    from zerolab.checkpoint import list_checkpoints

    return list_checkpoints(checkpoint_dir)


def logged_steps(run_dir: str) -> Optional[tuple[int, int]]:
    """(first, last) step of metrics.jsonl, None when it has no record."""
    steps = [r["step"] for r in _records(os.path.join(run_dir, METRICS)) if isinstance(r.get("step"), int)]
    return (min(steps), max(steps)) if steps else None


def _records(path: str) -> list[dict]:
    if not os.path.isfile(path):  # (a FIFO or a directory under the name is no record to read)
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line a crash cut short (metrics are appended line by line)
    return out


def held_record(run_dir: str, checkpoint_dir: str) -> list[str]:
    """What of a run's record `run_dir` holds, as phrases for a message; [] when nothing."""
    found = []
    steps = logged_steps(run_dir)
    if steps is not None:
        found.append(f"{METRICS} (steps {steps[0]}-{steps[1]})")
    elif os.path.isfile(os.path.join(run_dir, METRICS)) and os.path.getsize(os.path.join(run_dir, METRICS)):
        found.append(METRICS)
    found += [name for name in RESULTS if os.path.exists(os.path.join(run_dir, name))]
    ckpts = _checkpoints(checkpoint_dir)
    if ckpts:
        found.append(f"{len(ckpts)} checkpoint(s) in {checkpoint_dir}, the newest {os.path.basename(ckpts[0])}")
    return found


def removable(run_dir: str, checkpoint_dir: str) -> list[str]:
    """The paths run.overwrite=true removes: the metrics, the results and the checkpoints."""
    paths = [os.path.join(run_dir, n) for n in (METRICS, *RESULTS, WANDB_ID_FILE)]
    paths = [p for p in paths if os.path.exists(p)]
    if os.path.isdir(checkpoint_dir) and _checkpoints(checkpoint_dir):
        paths.append(checkpoint_dir)
    return paths


def check(cfg, run_dir: str, checkpoint_dir: str) -> None:
    """Raise RecordExists if starting this run in `run_dir` would mix two histories: a fresh
    start (or checkpoint.resume=auto with no checkpoint to continue from) over the record of a
    run, unless run.overwrite=true or this is a later round of the job that wrote it. Changes
    nothing: the launch scripts call it before any rank starts, rank 0 again under the lock."""
    held = held_record(run_dir, checkpoint_dir)
    resume, ckpts = cfg.checkpoint.resume, _checkpoints(checkpoint_dir)
    if not held or cfg.run.overwrite or later_round() or (resume and (resume != "auto" or ckpts)):
        return  # nothing held, cleared on purpose, this job's own record, or a resume (cut back later)
    what = "; ".join(held)
    if resume == "auto":
        problem = (f"checkpoint.resume=auto found no checkpoint in {checkpoint_dir} to continue from, and starting "
                   f"at step 0 here would write a second history over the record of the run it holds ({what})")
        ways = []
    else:
        problem = (f"run directory {run_dir} already holds the record of a run ({what}); a fresh start here would "
                   f"append a second history to its metrics and overwrite its results")
        ways = [f"continue that run with checkpoint.resume=auto (from {os.path.basename(ckpts[0])})"] if ckpts else []
    removed = ", ".join(os.path.basename(p) for p in removable(run_dir, checkpoint_dir))
    ways += ["start a new run in another run.dir (or leave run.dir empty for a fresh one)",
             f"or discard the old record and start again here with run.overwrite=true (it removes {removed})"]
    raise RecordExists(f"{problem}. To go on: {'; '.join(ways)}. Nothing in {run_dir} was changed.")


def prepare(cfg, run_dir: str, checkpoint_dir: str) -> None:
    """Rank 0, holding the directory's lock, before anything in it is written: check(), then,
    with run.overwrite=true, remove the old record, saying what goes. A resume keeps the record;
    the trainer cuts it back to the resumed step (cut_back)."""
    check(cfg, run_dir, checkpoint_dir)
    if cfg.run.overwrite:
        for path in removable(run_dir, checkpoint_dir):
            log.warning("run.overwrite=true: removing %s", path)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def cut_back(run_dir: str, step: int, before_replace: Callable[[], None] = lambda: None) -> int:
    """Drop the metrics records after `step` (train and eval lines alike, and a last line a
    crash cut short), atomically: the kept prefix goes to a temporary file, is fsynced and renamed
    over metrics.jsonl. `before_replace` runs between the two (fault injection's hook). Returns
    the number of lines dropped."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if isinstance(record.get("step"), int) and record["step"] > step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    _remove_stale_temps(path)
    if not dropped:
        return 0
    with atomic_path(path) as tmp:
        with open(tmp, "w") as out:
            out.writelines(kept)
        before_replace()
    log.info("%s: cut back to step %d (dropped %d record(s) of steps after it)", path, step, dropped)
    return dropped


def cut_back_agreed(ctx, checkpointer, step: int, before_replace: Callable[[], None] = lambda: None) -> None:
    """Collective: rank 0 cuts the record of `checkpointer.run_dir` back to `step` (cut_back); a
    disk too full for the cut's copy of the kept records stops every rank before any trains, with
    one DiskFull (rank 0 says it) naming the room the run needs. Nothing was changed then: the cut
    writes its copy first and replaces metrics.jsonl only once the copy is whole."""
    from zerolab.checkpoint import list_checkpoints, room
    from zerolab.run.results import NO_SPACE, DiskFull

    problem = None
    if ctx.is_main:
        try:
            cut_back(checkpointer.run_dir, step, before_replace)
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            rest = room.rest_of_run(checkpointer.cfg, checkpointer.layout, checkpointer.run_dir, checkpointer.dir,
                                    step, room.checkpoint_estimate(checkpointer.layout),
                                    len(list_checkpoints(checkpointer.dir)))
            problem = (f"resuming at step {step}: cutting {os.path.join(checkpointer.run_dir, METRICS)} back to that "
                       f"step needs room for a copy of the records it keeps, and the disk is full ({err.strerror}). "
                       f"Nothing was changed: the record and the checkpoints are as they were. To go on: "
                       f"{room.free_advice(rest) or 'free space on that filesystem'}, then resume again")
    problem = ctx.broadcast_object(problem)
    if problem is not None:
        raise DiskFull(problem)


def _remove_stale_temps(path: str) -> None:
    """Temporary files of an earlier cut that was killed before its rename (never read)."""
    directory, name = os.path.split(path)
    for entry in os.listdir(directory or "."):
        if entry.startswith(name + ".tmp."):
            try:
                os.remove(os.path.join(directory, entry))
            except FileNotFoundError:
                pass
