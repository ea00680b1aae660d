"""The files a finished run leaves in its directory (rank 0), and what it says when they do not fit.

model.safetensors (the consolidated weights), summary.json and the eval digest are written at the
very end, after the last step, when a full disk is most likely and the ranks still have
collectives to do together (the digest's eval, the final eval). A write that fails for lack of
space is therefore recorded, not raised: the ranks finish together, and then one paragraph says
what was written, what was not, and where the final weights still are (the last step's
checkpoint, when checkpoint.every is set). No traceback: the disk is full, nothing is broken.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from zerolab.atomic import atomic_path, atomic_write_json
from zerolab.checkpoint import write_safetensors
from zerolab.errors import ZerolabError
from zerolab.stats import percentile

log = logging.getLogger("zerolab")

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class ResultsNotWritten(ZerolabError):
    """The run trained, but some of its final files did not fit on the disk."""


class FinalFiles:
    """Rank 0's writer of a run's final files, keeping what was written and what was not."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.written: list[str] = []
        self.failed: list[tuple[str, str]] = []  # (file name, why)

    def attempt(self, name: str, write: Callable[[], Optional[str]]) -> bool:
        """Run `write` (which writes the file `name` of the run directory); a full disk is
        recorded and reported later (problem()), anything else raises. A `write` that meets the
        full disk itself returns why instead (zerolab.run.metrics.MetricsSink.log)."""
        try:
            why = write()
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            why = err.strerror or str(err)
        if isinstance(why, str):
            self.failed.append((name, why))
            return False
        if name not in self.written:
            self.written.append(name)
        return True

    def save_tensors(self, name: str, tensors: dict) -> bool:
        """A safetensors file of the run directory, atomically (a partial file never appears),
        written one tensor at a time by zerolab's writer, whose full disk is an OSError (ENOSPC)."""
        entries = [(k, t.dtype, tuple(t.shape), lambda t=t: t) for k, t in tensors.items()]

        def write():
            with atomic_path(os.path.join(self.run_dir, name)) as tmp:
                write_safetensors(tmp, entries)

        return self.attempt(name, write)

    def save_json(self, name: str, obj) -> bool:
        return self.attempt(name, lambda: atomic_write_json(os.path.join(self.run_dir, name), obj))

    @contextlib.contextmanager
    def final_eval(self, summary: dict, last: Optional[dict], log: Callable[[dict], Optional[str]], is_main: bool):
        """Around the run's final evaluations, after the weights and summary.json are written: one
        that fails is said in summary.json (rank 0) and raised; the last step's record `last` (None
        when the last step did not run here) is written with `log` either way."""
        try:
            yield
        except BaseException as err:
            if is_main:  # the weights are saved; say in the summary why eval_loss is missing
                summary["final_eval_error"] = f"{type(err).__name__}: {err}"[:1000]
                self.save_json("summary.json", summary)
            raise
        finally:
            if last is not None:
                self.attempt("metrics.jsonl", lambda: log(last))

    def problem(self, steps: int, last_checkpoint: Optional[str]) -> Optional[ResultsNotWritten]:
        """One paragraph when something did not fit, None when everything was written."""
        if not self.failed:
            return None
        missing = sorted({n for n, _ in self.failed} - set(self.written))
        if not missing:
            return None  # a retry (summary.json is written twice) got through
        why = self.failed[0][1]
        weights = "model.safetensors" in missing
        if weights and last_checkpoint:
            out = os.path.join(self.run_dir, "model.safetensors")
            where = (f"The final weights are in the checkpoint of step {steps}, {last_checkpoint}: write them out "
                     f"with `python -m zerolab export {last_checkpoint} --out {out}` once there is room")
        elif weights:
            where = ("The final weights were not saved anywhere (checkpoint.every=0): set checkpoint.every so that the "
                     "last step is checkpointed, or run with room for the weights")
        else:
            where = "The final weights are in model.safetensors"
        written = ", ".join(self.written) or "nothing"
        return ResultsNotWritten(
            f"the run trained all {steps} steps, but the disk filled while it wrote its results into {self.run_dir} "
            f"({why}): written: {written}; not written: {', '.join(missing)}. {where}. Free space there; "
            f"`python -m zerolab compare` reads what was written.")


class DiskFull(ZerolabError):
    """A write during the run did not fit on the disk: every rank stopped after the same step
    (zerolab.run.preempt.StopRequest.agreed), and rank 0 says what was written, what was not and
    what to do."""

    same_on_every_rank = True


def disk_full(ctx, cfg, done: int, saved: Optional[str], checkpointer, save: Optional[Callable[[], str]]) -> DiskFull:
    """Collective, after every rank agreed to stop on a write that did not fit (StopRequest): the
    failures of every rank, a checkpoint of step `done` when one can be had (this step's own save
    `saved`, else `save()` when checkpoint.dir is on another filesystem than what filled; a
    CheckpointError there is said as part of this), and the room the rest of the run needs."""
    from zerolab.checkpoint import CheckpointError, list_checkpoints
    from zerolab.checkpoint import room
    from zerolab.checkpoint.store import bytes_of
    from zerolab.run.preempt import StopRequest

    failures = [f for f in ctx.gather_objects(StopRequest.write_failure) if f]
    full = {room.mount_point(path) for path, _ in failures}
    attempt = ctx.broadcast_object(saved is None and save is not None and room.mount_point(checkpointer.dir) not in full
                                   if ctx.is_main else None)  # rank 0 decides: a save is collective
    path, save_error = saved, None
    if attempt:
        try:
            path = save()
        except CheckpointError as err:
            save_error = str(err)
    said = "; ".join(what for _, what in failures)
    kept = list_checkpoints(checkpointer.dir)
    newest = path or (kept[0] if kept else None)
    if path:
        ckpt = f"a checkpoint of step {done}, {path}"
    elif save_error:
        ckpt = f"no checkpoint of step {done}: saving one failed too ({save_error})"
    else:
        ckpt = (f"no checkpoint of step {done}" + (" (checkpoint.dir is on the filesystem that filled)" if save else
                                                   " (this strategy writes none)"))
    need = bytes_of(newest) + room.SAVE_MARGIN_BYTES if newest else room.checkpoint_estimate(checkpointer.layout)
    rest = room.rest_of_run(cfg, checkpointer.layout, checkpointer.run_dir, checkpointer.dir,
                            room.step_of(newest) if newest else 0, need, len(kept))
    free = room.free_advice(rest) or f"free space on the filesystem mounted at {room.mount_point(checkpointer.run_dir)}"
    go_on = (f"continue with checkpoint.resume=auto run.dir={checkpointer.run_dir} (from {newest}; the record is cut "
             "back to it and the steps after it run again)" if newest else
             f"start again with run.overwrite=true run.dir={checkpointer.run_dir} (no checkpoint exists to continue "
             "from; checkpoint.every=N saves one every N steps)")
    return DiskFull(f"every rank stopped after step {done} of {cfg.trainer.max_steps}: the disk is full: {said}. "
                    f"Written: {ckpt}. Not written: the rest of the run (the steps after {done}, its final weights "
                    f"and results). To go on: {free}, then {go_on}.")


def save_model_config(model_cfg, run_dir: str) -> bool:
    """config.json of a model=hf run (rank 0, when the trainer is built, before the first step): with
    model.safetensors, whose keys are the model's own parameter names, the run directory is a
    directory AutoModelForCausalLM.from_pretrained loads; a checkpoint of the run exports with it
    (`python -m zerolab export CKPT --format hf`). Other models have no transformers config."""
    if model_cfg.kind != "hf":
        return False
    from zerolab.models.sources import hf_config_json
    from zerolab.run.preempt import StopRequest

    path = os.path.join(run_dir, "config.json")
    try:
        atomic_write_json(path, hf_config_json(model_cfg))
    except OSError as err:
        if err.errno not in NO_SPACE:
            raise
        # rank 0 alone writes it: the ranks stop together after the first step (StopRequest.agreed)
        StopRequest.write_failed(path, f"config.json (the transformers config beside the weights) did not fit in "
                                       f"{run_dir} ({err.strerror})")
        return False
    return True


def run_summary(cfg, ctx, *, n_params: int, global_batch: int, loss: float, eval_loss: Optional[float],
                step_times: list[float], skipped: int, run_dir: str, metrics_path: str, memory: dict) -> dict:
    """summary.json: what the run was, how it ended, how long its steps took, its memory."""
    steps_run = len(step_times)  # this process's steps (a resumed run counts from its resume step)
    return {
        "final_loss": loss, "eval_loss": eval_loss, "steps": cfg.trainer.max_steps,
        "world_size": ctx.world_size, "strategy": cfg.strategy.name, "precision": cfg.precision.name,
        "optimizer": cfg.optim.name, "model": cfg.model.name, "n_params": n_params, "global_batch": global_batch,
        "steps_run": steps_run, "skipped_steps": skipped, "applied_steps": steps_run - skipped,
        "step_time_p50_s": statistics.median(step_times) if step_times else None,
        "step_time_p95_s": percentile(step_times, 95) if step_times else None,
        **memory, "run_dir": run_dir, "metrics": metrics_path, "eval_digest": None,
    }


def skipped_error(cfg, scaler, start_step: int, skipped: int, steps: int) -> Optional[str]:
    """Why this run must not count as a result: it applied no update at all, or skipped more
    than trainer.max_skipped_share of its steps. None when it is fine."""
    share = cfg.trainer.max_skipped_share
    if not steps or (skipped < steps and skipped <= share * steps):
        return None
    if scaler.enabled:
        why = (f"fp16 gradients overflowed at each of those steps, with the loss scale halving every time "
               f"(now {scaler.scale:g}); lower precision.initial_scale (default 65536) or use precision=bf16")
    else:
        why = ("the gradients were not finite at those steps (trainer.nonfinite=skip); lower the lr or "
               "enable clipping (optim.grad_clip)")
    where = f"steps {start_step + 1}-{cfg.trainer.max_steps}"  # numbered as in metrics.jsonl
    if skipped == steps:
        return (f"no update was applied: all {steps} steps of this run ({where}) were skipped, so the weights "
                f"are the ones it started from; {why}. summary.json records skipped_steps.")
    return (f"{skipped} of {steps} steps ({100 * skipped / steps:.0f}%) skipped their update, more than "
            f"trainer.max_skipped_share={share:g}; {why}, or raise trainer.max_skipped_share if this is "
            "expected. summary.json records skipped_steps.")


def say_where(summary: dict, vocab: int, eval_loss: float) -> None:
    """The run's last lines on rank 0: the final eval against a uniform guess over the model's own
    vocabulary, and where the record is."""
    log.info("eval loss %.4f (uniform baseline ln %d = %.3f) | p50 step %.3fs", eval_loss, vocab, math.log(vocab),
             summary["step_time_p50_s"] or 0)
    log.info("metrics: %s", summary["metrics"])
    if "weights" in summary:
        log.info("weights: %s", summary["weights"])
    log.info("summary: %s", os.path.join(summary["run_dir"], "summary.json"))


@dataclass
class RunSoFar:
    """What the loop carries from step to step to the run's end."""
    loss: float = float("nan")  # the last logged mean loss
    eval_loss: float = float("nan")
    skipped: int = 0  # updates skipped (every rank agrees); a device tensor once one was decided there
    per_rank: list = field(default_factory=list)  # the last logged step's figures of every rank
    last_record: Optional[dict] = None  # the final step's record: logged by finish, with the final eval
