"""The trainer's step profiler: MFU on every logged step, and the parts of each profiled step."""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn

from zerolab.profile.commwatch import CommWatch
from zerolab.profile.flops import flops_per_token, peak_flops
from zerolab.profile.intervals import COMPUTE, NULL, OPTIMIZER, STEP, device_parts, kineto_device_events, step_parts
from zerolab.schema import Config, global_batch


def _mark(name: str, on: bool):
    """A record_function range (a trace's span; on CUDA also the device span device_parts reads)."""
    return torch.profiler.record_function(name) if on else NULL


def profiled_steps(steps, every: int, max_steps: int) -> list[int]:
    """The 1-based steps profiled: `steps`, and with `every` the steps after the last of them at that
    interval, to `max_steps` (profile.every)."""
    out = set(steps)
    if every and steps:
        out.update(range(max(steps) + every, max_steps + 1, every))
    return sorted(out)


class Phases:
    """The compute windows (the model's forward pre-hook to the strategy's backward returning,
    one per micro-batch) and the optimizer window (the strategy's step) of one profiled step:
    a forward pre-hook on the model and wrappers on the strategy's instance, removed by undo()."""

    def __init__(self, watch: Optional[CommWatch], mark: bool):
        self.watch, self.mark = watch, mark
        self.compute: list[tuple[float, float]] = []
        self.optimizer: list[tuple[float, float]] = []
        self._start, self._range = None, None

    def _forward(self, module, args) -> None:
        if self._start is None:  # the first forward of a micro-batch (not a recomputation, not a nested call)
            self._range = _mark(COMPUTE, self.mark)
            self._range.__enter__()
            self._start = time.perf_counter()

    def _end_compute(self) -> None:
        if self._start is not None:
            self.compute.append((self._start, time.perf_counter()))
            self._range.__exit__(None, None, None)
            self._start = None

    def _backward_started(self, grad) -> None:
        # Runs first in backward: a callback queued now runs at its end, before DDP's reducer's own.
        if self.watch is not None:
            torch.autograd.Variable._execution_engine.queue_callback(self.watch.wait_handed)

    def attach(self, strategy, model: nn.Module):
        hook = model.register_forward_pre_hook(self._forward, prepend=True)
        before = {k: vars(strategy)[k] for k in ("backward", "step") if k in vars(strategy)}
        backward, step = strategy.backward, strategy.step

        def timed_backward(loss, *args, **kwargs):
            if loss.requires_grad:
                loss.register_hook(self._backward_started)
            try:
                return backward(loss, *args, **kwargs)
            finally:
                self._end_compute()

        def timed_step(*args, **kwargs):
            with _mark(OPTIMIZER, self.mark):
                t0 = time.perf_counter()
                try:
                    return step(*args, **kwargs)
                finally:
                    self.optimizer.append((t0, time.perf_counter()))

        strategy.backward, strategy.step = timed_backward, timed_step

        def undo() -> None:
            hook.remove()
            for k in ("backward", "step"):
                if k in before:
                    setattr(strategy, k, before[k])
                else:
                    delattr(strategy, k)
        return undo


class StepProfiler:
    """The trainer's one object for where the step goes: FLOPs per token and the device's peak
    (MFU on every logged step), and, for profile.steps, each profiled step's parts on this rank."""

    def __init__(self, cfg: Config, ctx, model: nn.Module, run_dir: str, dtype: torch.dtype):
        """`model`: the module about to be trained, before the strategy wraps or shards it.
        Collective when the peak is measured (every rank measures at once)."""
        self.ctx, self.steps = ctx, frozenset(profiled_steps(cfg.profile.steps, cfg.profile.every,
                                                              cfg.trainer.max_steps))
        self.flops = flops_per_token(model, cfg.model.block_size)
        self.peak = peak_flops(cfg.trainer.peak_flops, ctx, dtype)
        self.tokens_per_device = global_batch(cfg, ctx.world_size) * cfg.model.block_size / ctx.world_size
        self.cuda = ctx.device.type == "cuda"
        self.trace_dir = os.path.join(run_dir, "traces") if cfg.profile.trace else None
        self.watch: Optional[CommWatch] = None
        self.session, self.session_from = None, 0  # the torch profiler, and the step it started at
        self.parts: dict[int, dict] = {}  # 1-based step -> this rank's parts, until its record takes them
        self.history: dict[str, list[float]] = {}  # every profiled step's parts, for summary.json

    def profiles(self, step: int) -> bool:
        """Whether 0-based `step` is profiled (profile.steps counts from 1)."""
        return step + 1 in self.steps

    def step(self, step: int, strategy, model: nn.Module):
        """The context of 0-based `step`: NULL unless it is profiled or comes just before one."""
        if step + 1 in self.steps:
            return self._profiled(step + 1, strategy, model)
        if step + 2 in self.steps and not self.cuda:
            return self._armed()
        return NULL

    @contextmanager
    def _armed(self):
        """The step before a run of profiled steps: collectives it leaves in flight are known."""
        watch = self.watch = self.watch or CommWatch(self.trace_dir is not None)
        watch.install()
        try:
            yield
        finally:
            watch.uninstall()
            watch.keep_running(time.perf_counter(), carry=True)

    def _session(self, s: int):
        """The torch profiler running for step `s`: on CUDA one per step (its kernels give the
        parts), on CPU with profile.trace one per run of consecutive profiled steps (one trace
        file per rank and run), else none (the watch's own clock is all CPU needs)."""
        if self.session is None and (self.cuda or self.trace_dir is not None):
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.session, self.session_from = torch.profiler.profile(activities=acts), s
            self.session.start()
        return self.session

    def _end_session(self, s: int):
        """Stop the profiler after step `s` when its session ends and write its trace; returns it
        (stopped), or None while it runs on or when there is none."""
        prof = self.session
        if prof is None or not (self.cuda or s + 1 not in self.steps):
            return None
        if self.watch is not None:
            # gloo's threads run a collective inside a profiler range of their own; stopping the
            # profiler under one has crashed the process here (SIGSEGV): let those this step left
            # in flight (zero1/2's all-gathers) finish first, after the step's window.
            self.watch.finish_in_flight()
        prof.stop()
        self.session = None
        if self.trace_dir is not None:
            os.makedirs(self.trace_dir, exist_ok=True)
            name = f"steps{self.session_from}-{s}-rank{self.ctx.rank}.json.gz"
            prof.export_chrome_trace(os.path.join(self.trace_dir, name))
        return prof

    @contextmanager
    def _profiled(self, s: int, strategy, model: nn.Module):
        watch = None if self.cuda else (self.watch or CommWatch(self.trace_dir is not None))
        self.watch = watch
        phases = Phases(watch, mark=self.cuda or self.trace_dir is not None)
        prof = self._session(s)
        undo = phases.attach(strategy, model)
        if watch is not None:
            watch.install()
        try:
            with _mark(STEP, prof is not None):
                t0 = time.perf_counter()
                try:
                    yield
                finally:
                    t1 = time.perf_counter()
        except BaseException:
            if self.session is not None:  # the run is failing: no trace, no parts
                session, self.session = self.session, None
                session.stop()
            raise
        finally:
            if watch is not None:
                watch.uninstall()
            undo()
        if not self.cuda:
            exposed, flight = watch.intervals(t1)
            parts = step_parts((t0, t1), phases.compute, phases.optimizer, exposed, flight)
        stopped = self._end_session(s)
        if self.cuda:  # the step's device activity is all there once the profiler has stopped
            parts = device_parts(kineto_device_events(stopped))
        self.parts[s] = parts
        for k, v in parts.items():
            self.history.setdefault(k, []).append(v)
        if watch is not None:
            watch.keep_running(t1, carry=s + 1 in self.steps)
            if s + 1 not in self.steps:
                self.watch = None

    # ---- what the trainer logs -----------------------------------------------------------------
    def rank_figures(self, step: int) -> dict:
        """This rank's parts of 0-based `step` (gathered into rank{r}/time/...), {} when not profiled."""
        return self.parts.pop(step + 1, {})

    def rates(self, step_s: float) -> dict:
        """A logged step's throughput per device and MFU (model FLOPs ÷ the peak)."""
        per_device = self.tokens_per_device / step_s
        return {"flops_per_token": self.flops["flops_per_token"], "tokens_per_s_per_device": per_device,
                "mfu": per_device * self.flops["flops_per_token"] / self.peak["peak_flops"]}

    def summary(self, step_times: list[float]) -> dict:
        """summary.json's keys: FLOPs per token and its terms, the peak and where it came from, MFU at
        the median step time, and each rank's mean parts over the profiled steps (collective when
        profile.steps is set)."""
        out = {"flops_per_token": self.flops["flops_per_token"], "flops_terms": self.flops, **self.peak}
        if step_times:
            out.update({f"{k}_p50": v for k, v in self.rates(statistics.median(step_times)).items()
                        if k != "flops_per_token"})
        if self.steps:
            mine = {k: statistics.mean(v) for k, v in self.history.items()}
            out["profiled_steps"] = sorted(self.steps)
            out["time_per_rank"] = self.ctx.gather_objects(mine) if self.ctx.world_size > 1 else [mine]
        return out
