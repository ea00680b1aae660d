"""What watches the training loop without changing what it computes, behind one object the loop
calls at named points (zerolab/trainer.py):

  the progress board  where this rank is (step and phase), so a rank that stops is named (fault.py)
  faults              deliberate failures and stragglers, for testing recovery (fault.py)
  the memory monitor  model states, activations and the step's peak on logged steps (monitor.py)
  the step profiler   MFU on logged steps, where profiled steps' time goes (zerolab/profile/)
  progress            what rank 0 shows as the loop goes (metrics.py's Progress)

Steps are 0-based here, as the loop counts them; records and settings name them from 1
(numerics.step_name).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zerolab.profile import StepProfiler
from zerolab.run.fault import DONE, FaultInjector, ProgressBoard
from zerolab.run.metrics import Progress
from zerolab.run.monitor import MemoryMonitor


class Instruments:
    def __init__(self, cfg, ctx, model: torch.nn.Module, run_dir: str, dtype: torch.dtype):
        """`model`: the module about to be trained, before a strategy wraps or shards it.
        Collective: the profiler may measure the device's peak on every rank at once."""
        self.cfg = cfg
        self.memory = MemoryMonitor(cfg, ctx, model)
        self.profiler = StepProfiler(cfg, ctx, model, run_dir, dtype)
        self.fault = FaultInjector(cfg.fault, ctx.rank, ctx.world_size)
        self.board = ProgressBoard(ctx.rank, ctx.world_size, ctx.store, cfg.dist.timeout_s)
        self.bar = None
        self._step = 0

    def attach(self, strategy) -> None:
        self.memory.attach(strategy)

    # ---- around a step ---------------------------------------------------------------------------
    def step(self, step: int, strategy, model):
        """The context of one whole step: a fault before it starts, the profiler around it."""
        self._step = step
        self.fault.before_step(step)
        return self.profiler.step(step, strategy, model)

    def begin(self, step: int, logged: bool) -> None:
        """Step `step`'s first forward is next: per-step peaks start over."""
        self._step = step
        self.memory.begin_step(logged)

    @contextmanager
    def forward(self, model: torch.nn.Module, metered: bool):
        """A micro-batch's forward through `model`. Metered, the bytes it saves for backward are
        counted (logged steps, the first micro-batch: every micro-batch has the same shapes; no
        hook exists otherwise); `seen(logits)` gives the meter the logits' size."""
        self.at("forward")
        numel = []
        with self.memory.meter(model, enabled=metered) as meter:
            yield lambda logits: numel.append(logits.numel())
        self.memory.measured(meter, numel[-1] if numel else 0)

    def backward(self, loss: torch.Tensor, last: bool) -> torch.Tensor:
        """The loss backward will run on: the last micro-batch's may be poisoned (fault.inf_grad_step)."""
        if last:
            loss = self.fault.poison(loss, self._step)
        self.board.at(self._step, "backward")
        self.fault.in_phase(self._step, "backward", loss)
        return loss

    def at(self, phase: str) -> None:
        """This rank has reached `phase` of the current step (forward, optimizer, log, eval, checkpoint)."""
        self.board.at(self._step, phase)
        if phase in ("forward", "optimizer"):
            self.fault.in_phase(self._step, phase)

    # ---- what a logged step records -------------------------------------------------------------
    def profiles(self, step: int) -> bool:
        return self.profiler.profiles(step)

    def rank_figures(self, step: int, comm: dict) -> dict:
        """This rank's memory, communication and profiled figures of a logged step (to be gathered)."""
        return {**self.memory.rank_figures(comm), **self.profiler.rank_figures(step)}

    def summary(self, per_rank: list[dict], step_times: list[float]) -> dict:
        """summary.json's memory and profile sections."""
        return {**self.memory.summary(per_rank), **self.profiler.summary(step_times)}

    # ---- what rank 0 shows ------------------------------------------------------------------------
    def show(self, is_main: bool, total: int, start: int, desc: str) -> None:
        self.bar = Progress(is_main, self.cfg.logging.progress, total, start, desc)

    def logged(self, record: dict, skipped) -> None:
        self.bar.logged(record["step"], record["loss"], record["step_time_s"], record["lr"], skipped)

    def advance(self) -> None:
        """The step is over: the progress bar moves, and the board says so (a rank that dies before
        the next step begins is named "after step N", not "in step N")."""
        self.bar.advance()
        self.board.at(self._step, DONE)

    def end_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        """The progress shown and the heartbeat end (idempotent)."""
        self.end_progress()
        self.board.close()
