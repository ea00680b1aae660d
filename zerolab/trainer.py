"""The training loop: micro-batches, accumulation, step, eval, logging, checkpoints, final weights.

Read it top to bottom: `Trainer.__init__` builds what a run needs (zerolab/run/cadence.py says
which steps log, evaluate and save), `train_step` is one optimizer step, `fit` the loop. What the
step calls lives, in reading order, in: the strategy (zerolab/strategies/base.py: backward, reduce, step),
the step's arithmetic (zerolab/numerics.py: the global norm, unscale, clip, skip), what watches
the loop (zerolab/run/instruments.py: the progress board, faults, the memory meter, the
profiler), checkpoints (zerolab/checkpoint/), and what a run leaves behind
(zerolab/run/results.py). docs/architecture.md traces one step through them.
Steps are counted from 0 here; records and settings name step s as s + 1 (metrics.jsonl's "step").
"""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from functools import partial
from typing import Optional

import torch

from zerolab import dist as zdist
from zerolab.checkpoint import Checkpointer, model_layout
from zerolab.data import WindowSampler, build_data
from zerolab.digest import write_digest
from zerolab.errors import ZerolabError
from zerolab.models import build_model, count_params, lm_loss, param_groups
from zerolab.models.blocks_report import say_blocks
from zerolab.numerics import Measure
from zerolab.optim import build_optimizer
from zerolab.optim.schedule import LRSchedule
from zerolab.precision import Precision
from zerolab.run import directory as rundir, record as run_record
from zerolab.run.cadence import StepCadence
from zerolab.run.fault import SAVING
from zerolab.run.instruments import Instruments
from zerolab.run.metrics import MetricsSink
from zerolab.run.preempt import MARKER, StopRequest, stop_run
from zerolab.run.results import FinalFiles, RunSoFar, run_summary, say_where, skipped_error
from zerolab.schema import Config, global_batch, to_dict
from zerolab.strategies import strategy_class
from zerolab.timing import StepClock

log = logging.getLogger("zerolab")


class Trainer:
    def __init__(self, cfg: Config, ctx: zdist.DistContext, model: Optional[torch.nn.Module] = None,
                 run_dir: Optional[str] = None):
        """`model`: train this module (it must map token ids to logits) instead of cfg.model.
        `run_dir`: a directory `run` already claimed; without it the trainer claims one itself and
        holds its lock until close()."""
        self.cfg, self.ctx = cfg, ctx
        t = cfg.trainer
        StopRequest.install()  # SIGTERM/SIGUSR1 from here on: finish the step, save, exit (zerolab.run.preempt)
        self.run_lock = None
        if run_dir is None:
            run_dir, self.run_lock = rundir.claim(cfg, ctx)
        self.run_dir, self.closed = run_dir, False
        self.precision = Precision.from_config(cfg.precision, ctx.device)

        torch.manual_seed(t.seed)  # same initial weights on every rank
        model = model.to(ctx.device) if model is not None else build_model(cfg.model, device=ctx.device)
        self.n_params, layout = count_params(model), model_layout(model)  # before a strategy partitions parameters
        self.blocks = say_blocks(model, cfg.model.blocks, ctx.is_main)  # before a strategy wraps them
        self.watch = Instruments(cfg, ctx, model, run_dir, self.precision.compute_dtype)  # before sharding
        self.memory = self.watch.memory
        self.strategy = strategy_class(cfg.strategy.name)(cfg, ctx, self.precision)
        self.model = self.strategy.setup(model, param_groups(model, cfg.optim.weight_decay),
                                         partial(build_optimizer, cfg.optim))
        self.watch.attach(self.strategy)
        torch.manual_seed(t.seed + 1 + ctx.rank)  # dropout differs per rank, reproducibly

        self.data, n_windows = build_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size, t.seed)
        self.global_batch = global_batch(cfg, ctx.world_size)
        self.sampler = WindowSampler(n_windows, t.seed, cfg.data.micro_batch, t.grad_accum_steps, ctx.world_size)
        self.schedule = LRSchedule.from_config(cfg.optim, self.global_batch, t.max_steps)
        self.checkpointer = Checkpointer(cfg, ctx, self.run_dir, layout, model)  # model: each rank's buffers
        self.start_step = 0
        if cfg.checkpoint.resume:  # weights, optimizer state, RNG, loss scale; data and LR follow the step
            self.start_step = self.checkpointer.resume(self.strategy, self.schedule, self.sampler)
        self.cadence = StepCadence(cfg, self.start_step, self.watch.profiles)
        # one history: the record is cut back to the step this run starts from (rank 0 cuts, all agree)
        run_record.cut_back_agreed(ctx, self.checkpointer, self.start_step, self.watch.fault.in_record_cut)
        self.metrics = MetricsSink(self.run_dir, cfg.logging, ctx.is_main, cfg.experiment,
                                   cfg.strategy.name, to_dict(cfg))
        if ctx.is_main:
            log.info("run dir %s | %s | %d params | world %d | global batch %d (%d x %d x %d) | lr %.3g",
                     self.run_dir, cfg.strategy.name, self.n_params, ctx.world_size, self.global_batch,
                     cfg.data.micro_batch, t.grad_accum_steps, ctx.world_size, self.schedule.peak_lr)

    def close(self) -> None:
        """Let go of what the trainer holds: its metrics file and wandb run, the heartbeat, whatever
        the strategy patched, and the run directory's lock if it claimed it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.metrics.close()
        self.watch.close()
        self.strategy.close()
        if self.run_lock is not None:
            self.run_lock.release()

    # ---- which steps do what (StepCadence) -------------------------------------------------------
    def logs_step(self, step: int) -> bool:
        return self.cadence.logs_step(step)

    def saves_step(self, step: int) -> bool:
        return self.cadence.saves_step(step)

    def measure(self, step: int, logged: bool) -> Measure:
        return self.cadence.measure(step, logged)

    # ---- one optimizer step --------------------------------------------------------------------
    def train_step(self, step: int):
        accum, watch = self.cfg.trainer.grad_accum_steps, self.watch
        self.model.train()
        lr, logged = self.schedule(step), self.logs_step(step)
        watch.begin(step, logged)
        losses = []
        for micro in range(accum):
            last = micro == accum - 1
            batch = self.data.train_batch(self.sampler, step, self.ctx.rank, micro, self.ctx.device)
            # Only the last micro-batch communicates (DDP's no_sync; ZeRO-2 keeps reducing).
            with self.strategy.no_sync() if not last else nullcontext():
                with watch.forward(self.model, metered=logged and micro == 0) as seen:
                    logits = self.model(batch.x)
                    seen(logits)
                    loss = lm_loss(logits, batch.y)
                del logits
                self.strategy.backward(watch.backward(loss / accum, last))
            losses.append(loss.detach())
        watch.at("optimizer")
        info = self.strategy.step(lr, self.measure(step, logged))
        # The mean loss stays a tensor: reading it (a device sync on CUDA) only on logged steps.
        return torch.stack(losses).mean(), lr, info

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        ctx, t, run = self.ctx, self.cfg.trainer, RunSoFar()
        clock = StepClock(ctx.device)  # no device sync per step: the sharders' all-gathers stay in flight
        self.watch.show(ctx.is_main, t.max_steps, self.start_step, self.cfg.strategy.name)
        if ctx.is_main and os.path.exists(os.path.join(self.run_dir, MARKER)):
            os.remove(os.path.join(self.run_dir, MARKER))  # a previous attempt's: this one is running now
        for step in range(self.start_step, t.max_steps):
            with self.watch.step(step, self.strategy, self.model):  # profile.steps only; else nothing
                clock.start()
                local_loss, lr, info = self.train_step(step)
                clock.stop()
            run.skipped += info.skipped
            if self.logs_step(step):
                self.log_and_eval(step, clock.last(), local_loss, lr, info, run)
            else:
                self.strategy.comm.pop_step()
            self.watch.advance()
            saved = self.save(step + 1) if self.saves_step(step) else None
            # One tiny all-reduce per step: a stop signal, or a write that did not fit, on any rank stops
            # all after this step.
            stop = StopRequest.agreed(ctx.world_size, ctx.host_group)
            if stop and (step + 1 < t.max_steps or stop.write_failed):
                self.watch.end_progress()
                self.stop(step + 1, saved, stop)
        self.watch.end_progress()
        summary = self.finish(run, clock.times())
        if summary.get("error"):  # after summary.json is written, so the record of the failure exists
            err = ZerolabError(summary["error"])
            err.same_on_every_rank = True  # every rank counted the same skipped steps: rank 0 says it
            raise err
        return summary

    def log_and_eval(self, step: int, step_s: float, local_loss, lr: float, info, run: RunSoFar) -> None:
        """A logged step: its record (the final step's waits for the final eval, in finish), the
        eval when one is due, and the progress line."""
        info = info.read()
        record, run.per_rank = self.log_step(step, step_s, local_loss, lr, info)
        run.loss = record["loss"]
        if step + 1 == self.cfg.trainer.max_steps:
            run.last_record = record
        else:
            if self.cadence.evals_step(step):
                self.watch.at("eval")
                run.eval_loss = record["eval_loss"] = self.evaluate()
            self.metrics.log(record)
        self.watch.logged(record, info.skipped)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        for i in range(self.cfg.trainer.eval_batches):
            b = self.data.val_batch(i, self.ctx.rank, self.ctx.world_size, self.cfg.data.micro_batch, self.ctx.device)
            total += lm_loss(self.model(b.x), b.y).item()
        return self.ctx.all_reduce_mean(total / self.cfg.trainer.eval_batches)

    def log_step(self, step: int, step_s: float, local_loss: torch.Tensor, lr: float, info) -> tuple[dict, list]:
        """A logged step's record (metrics.jsonl, wandb) and every rank's figures (collective)."""
        self.watch.at("log")
        loss = self.ctx.all_reduce_mean(local_loss.item())
        per_rank = self.ctx.gather_objects(self.watch.rank_figures(step, self.strategy.comm.pop_step()))
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": info.grad_norm,
                  "grad_norm_clipped": info.grad_norm_clipped, "skipped": info.skipped, "step_time_s": step_s,
                  "tokens_per_s": self.global_batch * self.cfg.model.block_size / step_s,
                  "global_batch": self.global_batch, **self.watch.profiler.rates(step_s), **info.extra}
        if "optim_step_s" in record:
            record["optim_step_share"] = record["optim_step_s"] / step_s
        if self.precision.scaler.enabled:
            record["loss_scale"] = self.precision.scaler.scale
            record["skipped_steps"] = self.precision.scaler.skipped_steps
        for r, figures in enumerate(per_rank):
            record.update({f"rank{r}/{k}": v for k, v in figures.items()})
        record.update(self.memory.record_keys(per_rank, bool(info.skipped)))
        return record, per_rank

    def save(self, done: int) -> str:
        """Checkpoint after `done` steps (collective); returns its path."""
        self.watch.at(SAVING)
        self.watch.fault.in_save()  # fault.slow_save_s: a slow checkpoint directory (rehearsing a stop)
        return self.checkpointer.save(done, self.strategy, self.schedule, self.sampler)

    def stop(self, done: int, saved: Optional[str], stop) -> None:
        """Every rank agreed to stop after `done` steps (zerolab.run.preempt.stop_run): on a signal,
        checkpoint (unless this step's save did), record why and raise Preempted (exit code 75); on a
        write that did not fit, raise DiskFull, saying what was written (exit code 1)."""
        save = partial(self.save, done) if self.strategy.checkpoint_format != "none" else None
        try:
            stop_run(stop, cfg=self.cfg, ctx=self.ctx, run_dir=self.run_dir, done=done, saved=saved, save=save,
                     metrics=self.metrics, checkpointer=self.checkpointer)
        finally:
            self.watch.close()

    def finish(self, run: RunSoFar, step_times: list[float]) -> dict:
        """Final weights and summary.json first, then the final eval (when the last step ran),
        which completes the last metrics record and the summary: an eval that fails cannot cost
        the weights. A full disk is said once, after the ranks are done (zerolab.run.results)."""
        cfg, ctx = self.cfg, self.ctx
        weights = self.strategy.consolidated_state_dict()  # collective
        summary = run_summary(cfg, ctx, n_params=self.n_params, global_batch=self.global_batch, loss=run.loss,
                              eval_loss=None if run.last_record else run.eval_loss, step_times=step_times,
                              skipped=int(run.skipped), run_dir=self.run_dir, metrics_path=self.metrics.path,
                              memory=self.watch.summary(run.per_rank, step_times))
        summary["blocks"] = self.blocks  # which modules were the repeated blocks, and how they were found
        error = skipped_error(cfg, self.precision.scaler, self.start_step, int(run.skipped), len(step_times))
        if error:
            summary["error"] = error
        files = FinalFiles(self.run_dir)  # rank 0's writes
        if ctx.is_main:
            if cfg.run.save_model and weights is not None and files.save_tensors("model.safetensors", weights):
                summary["weights"] = os.path.join(self.run_dir, "model.safetensors")
            files.save_json("summary.json", summary)
        eval_loss = self._final_eval(summary, weights, run, files)
        problem = files.problem(cfg.trainer.max_steps, self.checkpointer.last_saved) if ctx.is_main else None
        if ctx.is_main:
            if problem is not None:
                summary["final_write_error"] = str(problem)
            files.save_json("summary.json", summary)
            say_where(summary, cfg.model.vocab_size, eval_loss)
        self.watch.close()
        self.metrics.close(summary)
        ctx.barrier()
        if problem is not None:
            raise problem  # after the barrier: the other ranks have finished with rank 0
        return summary

    def _final_eval(self, summary: dict, weights, run: RunSoFar, files: FinalFiles) -> float:
        """The digest (fixed held-out logits and the gradient-noise probe, for the parity report)
        and the final eval, both collective; then the last step's record, with its eval_loss if the
        eval completed (FinalFiles.final_eval). Returns the eval loss."""
        eval_loss, last = run.eval_loss, run.last_record
        # everything here evaluates the model: it may fail, the weights are safe
        with files.final_eval(summary, last, self.metrics.log, self.ctx.is_main):
            summary["eval_digest"] = write_digest(self.model, self.data, self.cfg.model, weights, self.run_dir,
                                                  self.ctx.is_main, self.ctx.device, save=files.save_tensors)
            if last is not None:
                eval_loss = summary["eval_loss"] = last["eval_loss"] = self.evaluate()
        return eval_loss
