"""Which steps of a run do what: log, evaluate, save, and what a logged step measures (the
trainer asks; zerolab/trainer.py)."""
from __future__ import annotations

from typing import Callable

from zerolab.numerics import Measure
from zerolab.schema import Config


class StepCadence:
    """Which steps do what: log, evaluate, save, and what a logged step measures, from the settings,
    the step a run starts at and whether the profiler wants a step (Instruments.profiles)."""

    def __init__(self, cfg: Config, start_step: int, profiles: Callable[[int], bool]):
        self.cfg, self.start_step, self.profiles = cfg, start_step, profiles

    def evals_step(self, step: int) -> bool:
        t = self.cfg.trainer
        return bool(t.eval_every and (step + 1) % t.eval_every == 0) or step + 1 == t.max_steps

    def logs_step(self, step: int) -> bool:
        return self._reports_step(step) or self.profiles(step)

    def _reports_step(self, step: int) -> bool:
        # An eval step is always a logged step: its eval_loss needs a record to land in, whatever
        # trainer.log_every says (eval_every need not be a multiple of log_every).
        t, every = self.cfg.trainer, self.cfg.logging.layer_stats_every
        return ((step + 1) % t.log_every == 0 or step == self.start_step or self.evals_step(step)
                or bool(every and (step + 1) % every == 0))

    def saves_step(self, step: int) -> bool:
        # Every `every` steps, and the last step too: a finished run can be continued from its end.
        every = self.cfg.checkpoint.every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.cfg.trainer.max_steps)

    def measure(self, step: int, logged: bool) -> Measure:
        """What the strategy measures about the update (Strategy.step): optimizer statistics cost
        norms and a device sync, so only on logged steps; per-tensor ratios every layer_stats_every.
        A step logged only because it is profiled measures none: its parts are then those of the
        steps a run does not log (most of them), which is also the step the time model predicts."""
        every = self.cfg.logging.layer_stats_every
        if not logged or not self._reports_step(step):
            return Measure.NOTHING
        return Measure.PER_TENSOR if every and (step + 1) % every == 0 else Measure.OPTIMIZER
