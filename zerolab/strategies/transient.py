"""Transient bytes a strategy holds during a step, recorded by the strategy as it runs: the
trainer's CPU peak accounting (zerolab.memory.peak) adds them to the model states and the
activations. Every strategy has one (Strategy.transient); one that records nothing (DeepSpeed,
FSDP2 and torch_zero keep their buffers to themselves) reports zeros.

Two moments, as in the prediction's Term.when: "backward" (with the activations alive: buckets
copied for reduction, gathered weights) and "step" (inside the optimizer step: fp32 gradient
copies, all-gather inputs). Each keeps the largest sum of bytes alive at once since the last
reset()."""
from __future__ import annotations

PHASES = ("backward", "step")


class TransientPeak:
    def __init__(self):
        self.live = 0
        self._max: dict | None = None

    def reset(self) -> None:
        """Start a new step: the maxima start from what is alive now (an all-gather input the last
        step left in flight counts in the next backward only while it lives)."""
        self._max = {p: self.live for p in PHASES}

    def peak(self) -> dict[str, int]:
        """{"backward": bytes, "step": bytes}: the most transient bytes alive at once in each
        moment since the last reset."""
        return dict(self._max or {p: 0 for p in PHASES})

    def alloc(self, nbytes: int, phase: str) -> None:
        self.live += nbytes
        if self._max is None:
            self.reset()
        self._max[phase] = max(self._max[phase], self.live)

    def free(self, nbytes: int) -> None:
        self.live = max(0, self.live - nbytes)
