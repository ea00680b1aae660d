"""Step times without a host synchronisation per step.

Synchronising the device before and after every step (to time it with the host clock) makes the
all-gathers zero1/zero2 leave in flight finish before the next forward starts, cancelling the
overlap the sharders are built for, and stalls the host once per step. On CUDA the clock instead
records a pair of events on the current stream around each step and reads their elapsed time
only when asked: on logged steps and at the end of the run, when the events have long completed
(reading waits for that step's end event alone). On CPU every kernel runs synchronously on the
host and gloo's collectives are waited for inside the step, so the host clock is the step time.
"""
from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._times: list[float] = []
        self._pending: list[tuple] = []  # CUDA (start, end) events not read back yet
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
        else:
            self._times.append(time.perf_counter() - self._start)

    def _read(self) -> None:
        if self._pending:
            self._pending[-1][1].synchronize()  # the newest step's end: every older event is done too
            self._times += [s.elapsed_time(e) / 1000 for s, e in self._pending]  # ms -> s
            self._pending.clear()

    def last(self) -> float:
        """The most recent step's time in seconds (on CUDA: waits for that step to finish)."""
        self._read()
        return self._times[-1]

    def times(self) -> list[float]:
        self._read()
        return list(self._times)
