"""Room on disk: what the rest of a run will write, and where that room can be made.

A disk that fills during a run is said in one paragraph that ends with what to do. "Free N bytes"
must be enough for everything the run still writes after a resume, not only for the write that
failed: the checkpoints it saves from there (with checkpoint.keep_last=K a save needs room for one
more beside the ones kept; with K=0 every save adds one), and the files it writes at its end into
the run directory (zerolab.run.results.FinalFiles, zerolab.digest): the final weights, the eval
digest's logits and gradient-noise index, summary.json, and the metrics records of the steps
still to come. Those land on the filesystem of the run directory, which may or may not be the
checkpoint directory's; each filesystem is named by its mount point, the place room can be made
(the checkpoint directory itself holds only the checkpoints that must be kept).
"""
from __future__ import annotations

import math
import os
import shutil
from typing import Optional

BLOCK = 4096  # what a file's last block can take beyond its bytes (tmpfs and ext4 allocate 4 KiB)
SAVE_MARGIN_BYTES = 64 * 1024  # a save beyond the previous checkpoint: meta.json, `latest`, its temporary copy
SUMMARY_BYTES = 64 * 1024  # summary.json and preempted.json: a few KB each, bounded generously
RECORD_BYTES = 4096  # a metrics.jsonl record when none was written yet to measure (rank keys make them long)


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def mount_point(path: str) -> str:
    """The mount point of the filesystem that holds `path` (or would, for a path not made yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    dev = os.stat(path).st_dev
    while path != os.path.dirname(path) and os.stat(os.path.dirname(path)).st_dev == dev:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(mount_point(path)).free
    except OSError:
        return None


def _metrics_left(cfg, run_dir: str, step: int) -> int:
    """The records of the steps after `step` (every log_every-th, every eval and the last), at the
    length of the longest record written so far, twice over (a record grows with what is logged)."""
    t = cfg.trainer
    left = max(t.max_steps - step, 0)
    records = -(-left // max(t.log_every, 1)) + (-(-left // t.eval_every) if t.eval_every else 0) + 2
    longest = RECORD_BYTES
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as fh:
            longest = max([len(line) for line in fh] + [longest])
    except OSError:
        pass
    return _blocks(2 * records * longest)


def end_of_run_bytes(cfg, layout: dict, run_dir: str, step: int) -> dict[str, int]:
    """Upper bounds of what a run that resumes at `step` writes into its run directory, by file."""
    from zerolab.digest import DIGEST_BATCHES, DIGEST_SEQS, MAX_LOGIT_ELEMENTS, PROBE_MAX_PARAMS

    params, buffers = layout["params"], layout.get("buffer_shapes", {})
    tensors = {**params, **{a: params[p] for a, p in layout["aliases"].items() if p in params}}
    n_params = sum(math.prod(s) for s in params.values())
    header = 256 * (len(tensors) + len(buffers)) + BLOCK  # safetensors' JSON header, per tensor
    out = {}
    if cfg.run.save_model:  # fp32 weights under every state-dict name (a tied one twice), buffers up to 8 bytes
        out["model.safetensors"] = _blocks(4 * sum(math.prod(s) for s in tensors.values())
                                           + 8 * sum(math.prod(s) for s in buffers.values()) + header)
    vocab, window = cfg.model.vocab_size, cfg.model.block_size
    kept = max(1, min(window, MAX_LOGIT_ELEMENTS // (DIGEST_SEQS * vocab)))
    out["eval_logits.safetensors"] = _blocks(DIGEST_BATCHES * DIGEST_SEQS * kept * vocab * 4 + BLOCK)
    if n_params <= PROBE_MAX_PARAMS:  # the gradient-noise index: int64 flat indices, at most one per element
        out["grad_noise.safetensors"] = _blocks(8 * n_params + header)
    out["summary.json"] = SUMMARY_BYTES
    out["config.yaml"] = SUMMARY_BYTES  # rewritten when the run starts again
    out["metrics.jsonl"] = _metrics_left(cfg, run_dir, step)
    try:  # a resume cuts the record back through a temporary copy of what it keeps
        out["metrics.jsonl"] += _blocks(os.path.getsize(os.path.join(run_dir, "metrics.jsonl")))
    except OSError:
        pass
    return out


def step_of(checkpoint: str) -> int:
    """The step of a checkpoint directory (step_00000020 -> 20)."""
    return int(os.path.basename(os.path.normpath(checkpoint)).split("_")[-1])


def saves_left(cfg, step: int) -> int:
    """How many checkpoints a run resumed at `step` saves from there on (the last step's included)."""
    every, last = cfg.checkpoint.every, cfg.trainer.max_steps
    return len({s for s in range(step + 1, last + 1) if every and (s % every == 0 or s == last)})


def saves_beyond_kept(cfg, step: int, kept: int) -> int:
    """How many checkpoints, beyond the `kept` ones on disk now, the rest of a run resumed at `step`
    (or started afresh at 0) needs room for at once. Before each save the oldest are removed down to
    the newest max(K-1, 1) (checkpoint.keep_last=K; zerolab.checkpoint.store.make_room), so the disk
    holds at most min(that, what exists by then) + 1 while a save writes; with K=0 every save stays.
    A run with no checkpoint yet needs room for the ones it keeps as well as the one it writes."""
    keep, saves = cfg.checkpoint.keep_last, saves_left(cfg, step)
    if not saves:
        return 0
    if keep <= 0:
        return saves
    held = max(keep - 1, 1)
    return max(min(held, kept + saves - 1) + 1 - kept, 0)


def describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name}: {n}" for name, n in sizes.items())


def checkpoint_estimate(layout: dict) -> int:
    """A checkpoint's bytes before one exists to measure: fp32 master weights and two optimizer
    moments per parameter (AdamW's; others keep fewer), the buffers, the margin."""
    n = sum(math.prod(s) for s in layout["params"].values())
    return _blocks(12 * n + 8 * sum(math.prod(s) for s in layout.get("buffer_shapes", {}).values())) + \
        SAVE_MARGIN_BYTES


def rest_of_run(cfg, layout: dict, run_dir: str, ckpt_dir: str, resume_step: int, ckpt_bytes: int,
                kept: int) -> list[tuple[str, int, Optional[int], dict]]:
    """(mount point, bytes the rest of a run resumed at `resume_step` writes there, bytes free
    there, those bytes by what) for the checkpoint directory's filesystem (first) and the run
    directory's, one entry when they are the same. `ckpt_bytes`: what one checkpoint takes;
    `kept`: the checkpoints on disk now (saves_beyond_kept counts the room the rest needs)."""
    saves = saves_beyond_kept(cfg, resume_step, kept)
    parts_of: dict[str, dict] = {mount_point(ckpt_dir): {}}
    if saves:
        parts_of[mount_point(ckpt_dir)][f"{saves} checkpoint(s) beyond those kept"] = saves * ckpt_bytes
    parts_of.setdefault(mount_point(run_dir), {}).update(end_of_run_bytes(cfg, layout, run_dir, resume_step))
    return [(mount, sum(parts.values()), free_bytes(mount), parts) for mount, parts in parts_of.items()]


def free_advice(rest: list[tuple[str, int, Optional[int], dict]]) -> str:
    """"free at least N bytes on the filesystem mounted at M (...)" for each filesystem short of
    room for the rest of the run (rest_of_run); "" when every one has room."""
    out = []
    for mount, need, free, parts in rest:
        if free is None or need >= free:
            short = need - (free or 0) + 1
            out.append(f"free at least {short} bytes on the filesystem mounted at {mount} (the rest of the run "
                       f"writes up to {need} bytes there: {describe(parts)}; {free} are free)")
    return " and ".join(out)
