"""A save that fails (Checkpointer.save): every rank raises together, and one paragraph says why.

What the paragraph names is read from the checkpointer whose save failed: its cfg, layout,
run_dir, dir (the checkpoint directory) and ctx.rank.
"""
from __future__ import annotations

import errno
import os
import shutil

from zerolab.checkpoint import room
from zerolab.checkpoint.format import CheckpointError
from zerolab.checkpoint.store import bytes_of, list_checkpoints


def on_every_rank(err: CheckpointError) -> CheckpointError:
    """Every rank raises this same error at the same point (the verdict was shared by a collective):
    rank 0 alone prints it (zerolab.job.run)."""
    err.same_on_every_rank = True
    return err


def agree(failures: list, tmp: str) -> None:
    """Every rank holds the same list of failures (one collective gave it to all): if any rank
    failed, all remove the temp directory and raise together, nobody waits in a collective."""
    failed = [f for f in failures if f]
    if failed:
        shutil.rmtree(tmp, ignore_errors=True)  # shared or node-local: each rank removes what it sees
        raise on_every_rank(CheckpointError(
            failed[0] + (f" ({len(failed) - 1} other rank(s) failed too)" if len(failed) > 1 else "")))


def save_failure(ckpt, step: int, err: Exception, writing: str) -> str:
    """One paragraph: where, what happened, how much room the rest of the run needs and where it
    can be made, what to do. `ckpt`: the Checkpointer whose save of `step` failed writing `writing`."""
    where = getattr(err, "filename", None) or writing  # a failed write() names no file
    kept = list_checkpoints(ckpt.dir)
    prev = kept[0] if kept else None
    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        try:
            what, fix = _room_advice(ckpt, step, prev, kept, what)
        except OSError:  # the filesystem cannot even be measured
            fix = f"free space under {ckpt.dir}, or point checkpoint.dir at a larger filesystem"
    else:
        what = getattr(err, "strerror", None) or f"{type(err).__name__}: {err}"
        fix = f"check that {ckpt.dir} is writable and has space"
    intact = (f"The previous checkpoint {prev} is intact: continue from it with checkpoint.resume=auto (or "
              f"checkpoint.resume={prev} with another checkpoint.dir)" if prev else
              f"No earlier checkpoint exists: start again with run.overwrite=true run.dir={ckpt.run_dir} (the "
              "run directory holds this run's record, so the same command, or checkpoint.resume=auto, is "
              "refused)")
    return (f"rank {ckpt.ctx.rank}: saving the checkpoint of step {step} failed writing {where}: {what}. "
            f"The unfinished save was removed. To fix: {fix}. {intact}.")


def _room_advice(ckpt, step: int, prev: "str | None", kept: list, what: str) -> tuple[str, str]:
    """(what happened, what to do) for a full disk: the bytes the rest of the run writes on each
    filesystem after a resume from `prev` (zerolab.checkpoint.room), against what is free there."""
    keep = ckpt.cfg.checkpoint.keep_last
    held = max(keep - 1, 1) if keep > 0 else len(kept)
    resume_at = room.step_of(prev) if prev else 0
    # A checkpoint of this run on this disk (with a margin for what a save writes beside it), or
    # before the first one an estimate from the model's size.
    need = bytes_of(prev) + room.SAVE_MARGIN_BYTES if prev else room.checkpoint_estimate(ckpt.layout)
    rest = room.rest_of_run(ckpt.cfg, ckpt.layout, ckpt.run_dir, ckpt.dir, resume_at, need, len(kept))
    elsewhere = room.saves_beyond_kept(ckpt.cfg, resume_at, 0)  # an empty checkpoint.dir, resumed from prev
    mount = room.mount_point(ckpt.dir)
    tmp = os.path.join(ckpt.dir, f".tmp-step_{step:08d}")  # removed before the error is raised
    freed = bytes_of(tmp) if os.path.isdir(tmp) else 0
    rest = [(m, n, f + freed if f is not None and m == mount else f, parts) for m, n, f, parts in rest]
    free = next(f for m, _, f, _ in rest if m == mount)
    what += (f"; a checkpoint of this run takes {need} bytes on this disk ("
             + (f"the previous one, plus {room.SAVE_MARGIN_BYTES // 1024} KiB of margin" if prev else "estimated")
             + f") and {free} bytes are free beside what is kept: while it writes a checkpoint zerolab keeps "
             f"{held} older one(s) (checkpoint.keep_last={keep}; the newest good one always)")
    shared = len(rest) == 1
    fix = (room.free_advice(rest) or f"free space on the filesystem mounted at {mount}") + (
        f" ({ckpt.dir} holds only what must be kept" + (f"; the run directory {ckpt.run_dir} is on the same "
                                                        "filesystem)" if shared else ")"))
    fix += (f", or point checkpoint.dir at a filesystem with room for {elsewhere} checkpoints "
            f"({elsewhere * need} bytes)" + (" and leave the run directory's filesystem the room its end "
                                             "needs" if shared else ""))
    return what, fix
