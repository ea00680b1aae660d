"""Transient bytes a strategy holds during a step, recorded by the strategy as it runs: the
trainer's CPU peak accounting (zerolab.memory.peak) adds them to the model states and the
activations. Every Strategy inherits it; one that records nothing (DeepSpeed, FSDP2 and
torch_zero keep their buffers to themselves) reports zeros.

Two moments, as in the prediction's Term.when: "backward" (with the activations alive: buckets
copied for reduction, gathered weights) and "step" (inside the optimizer step: fp32 gradient
copies, all-gather inputs). Each keeps the largest sum of bytes alive at once since the last
reset_transient_peak()."""
from __future__ import annotations

PHASES = ("backward", "step")


class TransientPeak:
    _transient_live = 0
    _transient_max: dict | None = None

    def reset_transient_peak(self) -> None:
        """Start a new step: the maxima start from what is alive now (an all-gather input the last
        step left in flight counts in the next backward only while it lives)."""
        self._transient_max = {p: self._transient_live for p in PHASES}

    def transient_peak_bytes(self) -> dict[str, int]:
        """{"backward": bytes, "step": bytes}: the most transient bytes alive at once in each
        moment since the last reset."""
        return dict(self._transient_max or {p: 0 for p in PHASES})

    def _transient_alloc(self, nbytes: int, phase: str) -> None:
        self._transient_live += nbytes
        if self._transient_max is None:
            self.reset_transient_peak()
        self._transient_max[phase] = max(self._transient_max[phase], self._transient_live)

    def _transient_free(self, nbytes: int) -> None:
        self._transient_live = max(0, self._transient_live - nbytes)
