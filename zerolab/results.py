"""The files a finished run leaves in its directory (rank 0), and what it says when they do not fit.

model.safetensors (the consolidated weights), summary.json and the eval digest are written at the
very end, after the last step, when a full disk is most likely and the ranks still have
collectives to do together (the digest's eval, the final eval). A write that fails for lack of
space is therefore recorded, not raised: the ranks finish together, and then one paragraph says
what was written, what was not, and where the final weights still are (the last step's
checkpoint, when checkpoint.every is set). No traceback: the disk is full, nothing is broken.
"""
from __future__ import annotations

import errno
import os
from typing import Callable, Optional

from zerolab.atomic import atomic_path, atomic_write_json
from zerolab.checkpoint import write_safetensors
from zerolab.errors import ZerolabError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class ResultsNotWritten(ZerolabError):
    """The run trained, but some of its final files did not fit on the disk."""


class FinalFiles:
    """Rank 0's writer of a run's final files, keeping what was written and what was not."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.written: list[str] = []
        self.failed: list[tuple[str, str]] = []  # (file name, why)

    def attempt(self, name: str, write: Callable[[], None]) -> bool:
        """Run `write` (which writes the file `name` of the run directory); a full disk is
        recorded and reported later (report()), anything else raises."""
        try:
            write()
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            self.failed.append((name, err.strerror or str(err)))
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
            where = (f"The final weights are in the checkpoint of step {steps}, {last_checkpoint}: write them out "
                     f"with `python -m zerolab export {last_checkpoint} --out {os.path.join(self.run_dir, 'model.safetensors')}` "
                     "once there is room")
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
