"""The training loop: micro-batches, accumulation, step, eval, logging, final weights.

Read it top to bottom: `run` validates the config (before any process group exists), sets up
the process group, checks the data, claims the run directory (one job per directory, see
zerolab/runlock.py) and hands over to `Trainer.fit`. The trainer talks to the strategy only
through the protocol in zerolab/strategies/base.py.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from functools import partial
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from zerolab import dist as zdist
from zerolab import record as run_record
from zerolab import runlock
from zerolab.activations import ActivationMeter, predict_activations
from zerolab.config import Config, ConfigError, global_batch, to_dict, validate
from zerolab.atomic import atomic_write_json
from zerolab.checkpoint import Checkpointer, check_resume_path, checkpoint_dir, model_layout
from zerolab.data import WindowSampler, build_data, check_data
from zerolab.digest import write_digest
from zerolab.errors import ZerolabError, debug_enabled, report
from zerolab.fault import FaultInjector, ProgressBoard, RankStopped
from zerolab.memory import check_against, ledger_for_run, process_memory, process_summary
from zerolab.memory import check_peak, peak_for_run, peak_keys, peak_of, recompute_bytes
from zerolab.memory.peak import LOGIT_BUFFER_BYTES
from zerolab.metrics import MetricsSink, Progress
from zerolab.models import MODELS, build_model, count_params, lm_loss, param_groups
from zerolab.optim import build_optimizer
from zerolab.optim.schedule import LRSchedule
from zerolab.preempt import MARKER, Preempted, StopRequest
from zerolab.precision import Precision
from zerolab.results import FinalFiles
from zerolab.stats import percentile
from zerolab.strategies import strategy_class
from zerolab.timing import StepClock

log = logging.getLogger("zerolab")


def new_run_dir(cfg: Config) -> str:
    """A fresh <run.root>/<experiment>/<time>-<strategy>[-job<SLURM_JOB_ID>] path (not created)."""
    job = os.environ.get("SLURM_JOB_ID")
    name = time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.strategy.name}" + (f"-job{job}" if job else "")
    base = path = os.path.join(cfg.run.root, cfg.experiment, name)
    n = 1
    while os.path.exists(path):  # two runs started in the same second
        path, n = f"{base}-{n}", n + 1
    return path


def resolve_run_dir(cfg: Config, ctx: zdist.DistContext) -> tuple[str, Optional[runlock.RunLock]]:
    """One directory for all ranks, held by this job: given as run.dir, or chosen by rank 0 and
    broadcast. Rank 0 creates and locks it before anything in it is read or written, then writes
    config.yaml; if it cannot (another job holds the directory), every rank raises the same error.
    Returns the path and, on rank 0, the lock (None on the other ranks)."""
    path = cfg.run.dir
    if not path:
        path = ctx.broadcast_object(new_run_dir(cfg) if ctx.is_main else None)
    lock, problem = None, None
    if ctx.is_main:
        try:
            lock = runlock.acquire(path)
            # A fresh start over another run's record is refused before anything is written.
            run_record.prepare(cfg, os.path.abspath(path), checkpoint_dir(cfg, path))
            with open(os.path.join(path, "config.yaml"), "w") as fh:
                fh.write(OmegaConf.to_yaml(to_dict(cfg)))
        except runlock.RunDirLocked as err:
            problem = err
        except run_record.RecordExists as err:
            problem = err
            lock.release()
        except OSError as err:
            problem = ZerolabError(f"cannot set up run directory {os.path.abspath(path)}: {err}. Check that it "
                                   f"is writable and the disk has room, or pick another run.dir.")
            problem.same_on_every_rank = True
            if lock is not None:
                lock.remove_created()
    problem = ctx.broadcast_object(problem)  # also the barrier: config.yaml exists after it
    if problem is not None:
        raise problem
    return os.path.abspath(path), lock


def agree(ctx: zdist.DistContext, check) -> None:
    """Run `check` on every rank; if it raised on any, every rank raises the same error (a
    ConfigError as such, anything else as a ZerolabError naming it), so no rank goes on to wait
    in a collective for one that left."""
    mine, cause = None, None
    try:
        check()
    except ConfigError as err:
        mine, cause = ("config", str(err)), err
    except Exception as err:  # e.g. the embedded corpus could not be written: keep the ranks together
        mine, cause = ("error", f"{type(err).__name__}: {err}"), err
    found = [(r, m) for r, m in enumerate(ctx.gather_objects(mine)) if m]
    if found:
        rank, (kind, msg) = found[0]
        msg = msg if len(found) == ctx.world_size else f"on rank {rank}: {msg}"
        err = ConfigError(msg) if kind == "config" else ZerolabError(msg)
        err.same_on_every_rank = True
        raise err from cause




class Trainer:
    def __init__(self, cfg: Config, ctx: zdist.DistContext, model: Optional[torch.nn.Module] = None,
                 run_dir: Optional[str] = None):
        """`model`: train this module (it must map token ids to logits) instead of cfg.model.
        `run_dir`: a directory `run` already resolved and locked; without it the trainer claims
        one itself and holds its lock until the process exits."""
        self.cfg, self.ctx = cfg, ctx
        t = cfg.trainer
        StopRequest.install()  # SIGTERM/SIGUSR1 from here on: finish the step, save, exit (zerolab.preempt)
        self.run_lock = None
        if run_dir is None:
            run_dir, self.run_lock = resolve_run_dir(cfg, ctx)
        self.run_dir = run_dir
        self.precision = Precision.from_config(cfg.precision, ctx.device)

        torch.manual_seed(t.seed)  # same initial weights on every rank
        model = model.to(ctx.device) if model is not None else build_model(cfg.model, device=ctx.device)
        self.n_params = count_params(model)
        self.mem_pred, self.mem_check = ledger_for_run(cfg, ctx.world_size, model), {}  # predicted bytes per rank
        self.strategy = strategy_class(cfg.strategy.name)(cfg, ctx, self.precision)
        self.model = self.strategy.setup(model, param_groups(model, cfg.optim.weight_decay),
                                         partial(build_optimizer, cfg.optim))
        torch.manual_seed(t.seed + 1 + ctx.rank)  # dropout differs per rank, reproducibly

        self.data, n_windows = build_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size, t.seed)
        self.global_batch = global_batch(cfg, ctx.world_size)
        self.sampler = WindowSampler(n_windows, t.seed, cfg.data.micro_batch, t.grad_accum_steps, ctx.world_size)
        self.schedule = LRSchedule.from_config(cfg.optim, self.global_batch, t.max_steps)
        self.start_step = 0
        self.activations_bytes = 0  # saved for backward by the last measured forward (this rank)
        # ... and what zerolab.activations predicts for it (zerolab's own models only)
        act_prediction = predict_activations(
            cfg.model, cfg.data.micro_batch, precision=cfg.precision.name, device=ctx.device.type
        ) if isinstance(model, tuple(MODELS.values())) else None
        self.activations_pred = act_prediction.bytes if act_prediction else None
        # Peak accounting (zerolab.memory.peak): the predicted peak per rank, and the bytes of one
        # recomputed checkpointed block (a formula, not measured: the meter sees the forward only).
        self.peak_pred = peak_for_run(self.mem_pred, act_prediction, cfg.model, cfg.data.micro_batch,
                                      cfg.model.block_size, cfg.precision.name)
        self.recompute_bytes = recompute_bytes(act_prediction, cfg.data.micro_batch, cfg.model.block_size,
                                               getattr(cfg.model, "n_embd", 0), self.precision.compute_dtype.itemsize
                                               ) if act_prediction else 0
        self.logits_numel, self.peak_check = 0, {}
        self.fault = FaultInjector(cfg.fault, ctx.rank, ctx.world_size)
        self.progress = ProgressBoard(ctx.rank, ctx.world_size, ctx.store, cfg.dist.timeout_s)  # names a rank that stops
        self.checkpointer = Checkpointer(cfg, ctx, self.run_dir, model_layout(model), self.strategy)
        if cfg.checkpoint.resume:  # weights, optimizer state, RNG, loss scale; data and LR follow the step
            self.start_step = self.checkpointer.resume(self.strategy, self.schedule, self.sampler)
        if ctx.is_main:  # one history: the record is cut back to the step this run starts from
            run_record.cut_back(self.run_dir, self.start_step, before_replace=self.fault.in_record_cut)
        self.metrics = MetricsSink(self.run_dir, cfg.logging, ctx.is_main, cfg.experiment,
                                   cfg.strategy.name, to_dict(cfg))
        if ctx.is_main:
            log.info("run dir %s | %s | %d params | world %d | global batch %d (%d x %d x %d) | lr %.3g",
                     self.run_dir, cfg.strategy.name, self.n_params, ctx.world_size, self.global_batch,
                     cfg.data.micro_batch, t.grad_accum_steps, ctx.world_size, self.schedule.peak_lr)

    # ---- one optimizer step ----------------------------------------------------------------
    def evals_step(self, step: int) -> bool:
        t = self.cfg.trainer
        return bool(t.eval_every and (step + 1) % t.eval_every == 0) or step + 1 == t.max_steps

    def logs_step(self, step: int) -> bool:
        # An eval step is always a logged step: its eval_loss needs a record to land in, whatever
        # trainer.log_every says (eval_every need not be a multiple of log_every).
        t, every = self.cfg.trainer, self.cfg.logging.layer_stats_every
        return ((step + 1) % t.log_every == 0 or step == self.start_step or self.evals_step(step)
                or bool(every and (step + 1) % every == 0))

    def _inject_inf(self, step: int) -> bool:
        f = self.cfg.fault
        return step == f.inf_grad_step and self.ctx.rank == f.inf_grad_rank

    def train_step(self, step: int):
        accum = self.cfg.trainer.grad_accum_steps
        self.model.train()
        lr = self.schedule(step)
        losses = []
        board, fault = self.progress, self.fault  # where this rank is, for naming a rank that stops
        logged = self.logs_step(step)
        self.strategy.reset_transient_peak()  # peak accounting: a new step
        if logged and self.ctx.device.type == "cuda":  # CUDA: the allocator's peak of this step (untested here)
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        for micro in range(accum):
            batch = self.data.train_batch(self.sampler, step, self.ctx.rank, micro, self.ctx.device)
            # Only the last micro-batch communicates (DDP's no_sync; ZeRO-2 keeps reducing).
            with self.strategy.no_sync() if micro < accum - 1 else nullcontext():
                board.at(step, "forward")
                fault.in_phase(step, "forward")
                # Bytes saved for backward, measured on logged steps only (hooks cost nothing otherwise);
                # every micro-batch has the same shapes, so the first one stands for all.
                with ActivationMeter(self.model, enabled=logged and micro == 0) as meter:
                    logits = self.model(batch.x)
                    loss = lm_loss(logits, batch.y)
                if meter.enabled:
                    self.activations_bytes, self.logits_numel = meter.bytes, logits.numel()
                del logits
                scaled = loss / accum
                if micro == accum - 1 and self._inject_inf(step):
                    # fault.inf_grad_step: this rank's last backward carries inf, so its gradients
                    # are non-finite before the reduction and every rank sees the overflow.
                    scaled = scaled * float("inf")
                board.at(step, "backward")
                fault.in_phase(step, "backward", scaled)
                self.strategy.backward(scaled)
            losses.append(loss.detach())
        # Optimizer statistics cost norms and a device sync: only on steps that are logged.
        every = self.cfg.logging.layer_stats_every
        stats_level = 0 if not logged else 2 if every and (step + 1) % every == 0 else 1
        board.at(step, "optimizer")
        fault.in_phase(step, "optimizer")
        info = self.strategy.step(lr, stats_level)
        # The mean loss stays a tensor: reading it (a device sync on CUDA) only on logged steps.
        return torch.stack(losses).mean(), lr, info

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        for i in range(self.cfg.trainer.eval_batches):
            b = self.data.val_batch(i, self.ctx.rank, self.ctx.world_size, self.cfg.data.micro_batch, self.ctx.device)
            total += lm_loss(self.model(b.x), b.y).item()
        return self.ctx.all_reduce_mean(total / self.cfg.trainer.eval_batches)

    def rank_figures(self, comm: dict) -> dict:
        """This rank's memory and communication figures, to be gathered on rank 0."""
        out = {f"mem/{k}_bytes": v for k, v in self.strategy.memory().items()}
        out["mem/activations_bytes"] = self.activations_bytes  # zerolab.activations.ActivationMeter
        out.update(self.peak_figures(out))
        out.update(process_memory(self.ctx.device))
        out["comm_bytes"] = comm.get("total", 0.0)
        return out

    def peak_figures(self, figures: dict) -> dict:
        """This step's peak by zerolab's own accounting (zerolab.memory.peak): the model states
        strategy.memory() measured, the activations the meter measured, and the transients: the
        loss's logits buffers (8 bytes × the logits' measured numel), one recomputed block with
        checkpointing (formula) and what the strategy recorded (transient_peak_bytes)."""
        tp = self.strategy.transient_peak_bytes()
        states = {k[len("mem/"):-len("_bytes")]: v for k, v in figures.items() if k.startswith("mem/")}
        pk = peak_of(states, self.activations_bytes,
                     LOGIT_BUFFER_BYTES * self.logits_numel + self.recompute_bytes + tp.get("backward", 0), tp.get("step", 0))
        out = {"mem/peak_bytes": pk.bytes, "mem/peak_phase": pk.phase,
               **{f"mem/peak_{k}_bytes": v for k, v in pk.parts.items()}}
        if self.ctx.device.type == "cuda":  # CUDA: the allocator's own peak of this step (untested here)
            out["mem/peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return out

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.trainer
        tokens_per_step = self.global_batch * cfg.model.block_size
        clock, eval_loss, loss = StepClock(ctx.device), float("nan"), float("nan")
        bar = Progress(ctx.is_main, cfg.logging.progress, t.max_steps, self.start_step, cfg.strategy.name)
        per_rank: list[dict] = []
        skipped = 0  # steps whose update was skipped (every rank agrees on each); a device tensor once one was decided there
        last_record = None  # the final step's record: logged by finish, with the final eval
        if ctx.is_main and os.path.exists(os.path.join(self.run_dir, MARKER)):
            os.remove(os.path.join(self.run_dir, MARKER))  # a previous attempt's: this one is running now
        for step in range(self.start_step, t.max_steps):
            self.fault.before_step(step)
            clock.start()  # no device sync per step (zerolab.timing): the sharders' all-gathers stay in flight
            local_loss, lr, info = self.train_step(step)
            clock.stop()
            skipped += info.skipped
            comm = self.strategy.comm.pop_step()
            if self.logs_step(step):
                self.progress.at(step, "log")
                dt = clock.last()
                loss = ctx.all_reduce_mean(local_loss.item())
                per_rank = ctx.gather_objects(self.rank_figures(comm))
                record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": info.grad_norm,
                          "grad_norm_clipped": info.grad_norm_clipped, "skipped": info.skipped,
                          "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                          "global_batch": self.global_batch, **info.extra}
                if "optim_step_s" in record:
                    record["optim_step_share"] = record["optim_step_s"] / dt
                if self.precision.scaler.enabled:
                    record["loss_scale"] = self.precision.scaler.scale
                    record["skipped_steps"] = self.precision.scaler.skipped_steps
                for r, figures in enumerate(per_rank):
                    record.update({f"rank{r}/{k}": v for k, v in figures.items()})
                    if self.activations_pred is not None:
                        record[f"rank{r}/mem_pred/activations_bytes"] = self.activations_pred
                record.update(peak_keys(self.peak_pred))  # rank{r}/mem_pred/peak_*_bytes
                if not self.peak_check and not info.skipped:  # the first logged update: the activations and peak against prediction
                    self.peak_check = check_peak(self.peak_pred, [self.activations_pred] * ctx.world_size
                                                 if self.activations_pred else None, per_rank, warn=ctx.is_main)
                if not self.mem_check and not info.skipped:  # first real update: optimizer state exists
                    pred_keys, self.mem_check = check_against(self.mem_pred, per_rank, warn=ctx.is_main)
                    record.update(pred_keys)
                if step + 1 == t.max_steps:
                    last_record = record
                else:
                    if self.evals_step(step):
                        self.progress.at(step, "eval")
                        eval_loss = record["eval_loss"] = self.evaluate()
                    self.metrics.log(record)
                bar.logged(step + 1, loss, dt, lr, info.skipped)
            bar.advance()
            saved = None
            # Every `every` steps, and the last step too: a finished run can be continued from its end.
            if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == t.max_steps):
                self.progress.at(step, "checkpoint")
                saved = self.checkpointer.save(step + 1, self.strategy, self.schedule, self.sampler)
            # One tiny all-reduce per step: a stop signal seen by any rank stops all after this step.
            if step + 1 < t.max_steps and StopRequest.agreed(ctx.world_size, ctx.host_group):
                bar.close()
                self.preempt(step + 1, saved)
        bar.close()
        summary = self.finish(loss, eval_loss, clock.times(), per_rank, int(skipped), last_record)
        if summary.get("error"):  # after summary.json is written, so the record of the failure exists
            err = ZerolabError(summary["error"])
            err.same_on_every_rank = True  # every rank counted the same skipped steps: rank 0 says it
            raise err
        return summary

    def preempt(self, done: int, saved: Optional[str]) -> None:
        """Every rank agreed to stop after `done` steps: checkpoint (unless this step's periodic
        save already did), record why, and raise Preempted (exit code zerolab.preempt.EXIT_PREEMPTED)."""
        cfg, ctx = self.cfg, self.ctx
        why = StopRequest.signal_name or "a stop signal received by another rank"
        path = saved
        if path is None and self.strategy.checkpoint_format != "none":
            self.progress.at(done - 1, "checkpoint")
            path = self.checkpointer.save(done, self.strategy, self.schedule, self.sampler)
        elif path is None:
            log.warning("strategy=%s cannot write checkpoints: stopping after step %d without one",
                        cfg.strategy.name, done)
        record = {"step": done, "stopped": "preempted", "signal": why, "checkpoint": path}
        if ctx.is_main:
            self.metrics.log(record)
            write_json(os.path.join(self.run_dir, MARKER), {**record, "max_steps": cfg.trainer.max_steps})
        self.metrics.close({"stopped": "preempted", "stopped_at_step": done})
        self.progress.close()
        resume = (f"resume it with checkpoint.resume=auto run.dir={self.run_dir}" if path else
                  "no checkpoint was written (this strategy cannot write one)")
        raise Preempted(f"zerolab: stopped after step {done} of {cfg.trainer.max_steps} on {why}; "
                        f"checkpoint {path or '(none)'}; {resume}")


    def skipped_error(self, skipped: int, steps: int) -> Optional[str]:
        """Why this run must not count as a result: it applied no update at all, or skipped more
        than trainer.max_skipped_share of its steps. None when it is fine."""
        share = self.cfg.trainer.max_skipped_share
        if not steps or (skipped < steps and skipped <= share * steps):
            return None
        scaler = self.precision.scaler
        if scaler.enabled:
            why = (f"fp16 gradients overflowed at each of those steps, with the loss scale halving every time "
                   f"(now {scaler.scale:g}); lower precision.initial_scale (default 65536) or use precision=bf16")
        else:
            why = ("the gradients were not finite at those steps (trainer.nonfinite=skip); lower the lr or "
                   "enable clipping (optim.grad_clip)")
        where = f"{self.start_step}-{self.cfg.trainer.max_steps - 1}, 0-based"
        if skipped == steps:
            return (f"no update was applied: all {steps} steps of this run ({where}) were skipped, so the weights "
                    f"are the ones it started from; {why}. summary.json records skipped_steps.")
        return (f"{skipped} of {steps} steps ({100 * skipped / steps:.0f}%) skipped their update, more than "
                f"trainer.max_skipped_share={share:g}; {why}, or raise trainer.max_skipped_share if this is "
                "expected. summary.json records skipped_steps.")

    def finish(self, loss: float, eval_loss: float, step_times: list[float], per_rank: list[dict],
               skipped: int = 0, last_record: Optional[dict] = None) -> dict:
        """Final weights and summary.json first, then the final eval (when the last step ran),
        which completes the last metrics record and the summary: an eval that fails cannot cost
        the weights."""
        cfg, ctx = self.cfg, self.ctx
        steps_run = len(step_times)  # this process's steps (a resumed run counts from its resume step)
        weights = self.strategy.consolidated_state_dict()  # collective
        summary = {
            "final_loss": loss, "eval_loss": None if last_record else eval_loss, "steps": cfg.trainer.max_steps,
            "world_size": ctx.world_size, "strategy": cfg.strategy.name, "precision": cfg.precision.name,
            "optimizer": cfg.optim.name, "model": cfg.model.name, "n_params": self.n_params,
            "global_batch": self.global_batch,
            "steps_run": steps_run, "skipped_steps": skipped, "applied_steps": steps_run - skipped,
            "step_time_p50_s": statistics.median(step_times) if step_times else None,
            "step_time_p95_s": percentile(step_times, 95) if step_times else None,
            "peak_memory_per_rank": [{k: v for k, v in r.items() if "peak" in k or "max" in k} for r in per_rank],
            "memory_per_rank": [{k: v for k, v in r.items() if k.startswith("mem/")} for r in per_rank],
            "memory_ledger": {**self.mem_check, "process_per_rank": process_summary(per_rank),
                              "activations_predicted_bytes": self.activations_pred, "peak": self.peak_check},
            "run_dir": self.run_dir, "metrics": self.metrics.path, "eval_digest": None,
        }
        error = self.skipped_error(skipped, steps_run)
        if error:
            summary["error"] = error
        summary_path = os.path.join(self.run_dir, "summary.json")
        files = FinalFiles(self.run_dir)  # rank 0's writes: a full disk is said once, at the end
        if ctx.is_main:
            if cfg.run.save_model and weights is not None and files.save_tensors("model.safetensors", weights):
                summary["weights"] = os.path.join(self.run_dir, "model.safetensors")
            files.save_json("summary.json", summary)
        try:  # everything after this point evaluates the model: it may fail, the weights are safe
            # Fixed held-out logits and the noise-level gradient probe, for the parity report (collective).
            summary["eval_digest"] = write_digest(self.model, self.data, cfg.model, weights, self.run_dir,
                                                  ctx.is_main, ctx.device, save=files.save_tensors)
            del weights
            if last_record is not None:
                eval_loss = summary["eval_loss"] = last_record["eval_loss"] = self.evaluate()
        except BaseException as err:
            if ctx.is_main:  # the weights are saved; say in the summary why eval_loss is missing
                summary["final_eval_error"] = f"{type(err).__name__}: {err}"[:1000]
                files.save_json("summary.json", summary)
            raise
        finally:
            if last_record is not None:  # with eval_loss if the eval completed
                files.attempt("metrics.jsonl", lambda: self.metrics.log(last_record))
        problem = files.problem(cfg.trainer.max_steps, self.checkpointer.last_saved) if ctx.is_main else None
        if ctx.is_main:
            if problem is not None:
                summary["final_write_error"] = str(problem)
            files.save_json("summary.json", summary)
        self.progress.close()
        if ctx.is_main:
            vocab = cfg.model.vocab_size
            log.info("eval loss %.4f (uniform baseline ln %d = %.3f) | p50 step %.3fs", eval_loss, vocab,
                     math.log(vocab), summary["step_time_p50_s"] or 0)
            log.info("metrics: %s", self.metrics.path)
            if "weights" in summary:
                log.info("weights: %s", summary["weights"])
            log.info("summary: %s", summary_path)
        self.metrics.close(summary)
        ctx.barrier()
        if ctx.is_main and problem is not None:
            raise problem  # after the barrier: the other ranks have finished with rank 0
        return summary


write_json = atomic_write_json  # readers see the old file or the new one, never half of one


def stop_now(err: BaseException) -> None:
    """A peer stopped mid-collective: print the verdict and exit at once. Tearing down a process
    group whose peer is gone (destroy_process_group, the store client, interpreter exit) can take
    seconds or wait for another timeout, and nothing is left to save: the job ends now."""
    if debug_enabled():
        traceback.print_exception(err)
    print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def run(dcfg: DictConfig | Config) -> Optional[dict]:
    try:  # before any process group exists: every rank finds the same, and rank 0 alone says it
        cfg = validate(dcfg)
        check_resume_path(cfg.checkpoint.resume)
    except ConfigError as err:
        err.before_ranks_meet = True  # zerolab.errors.exit_for
        raise
    ctx = zdist.init(cfg.dist)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    trainer, lock = None, None
    try:
        # User input that would only fail later (in the first batch or the final eval) fails now,
        # on every rank alike, before the run directory is touched.
        agree(ctx, lambda: check_data(cfg.data, cfg.model.block_size))
        run_dir, lock = resolve_run_dir(cfg, ctx)
        try:
            trainer = Trainer(cfg, ctx, run_dir=run_dir)
        except BaseException:
            # A start that fails leaves nothing behind: the directory goes if this job created it
            # (a run.dir that existed before, with its checkpoints, is kept).
            if lock is not None and lock.remove_created():
                log.info("setup failed: removed %s, which this job had created", run_dir)
            raise
        return trainer.fit()
    except (ConfigError, ZerolabError) as err:
        if err.same_on_every_rank:
            # One message, from rank 0. The other ranks leave only after it is printed: torchrun
            # stops the whole job as soon as one rank exits, and rank 0 could lose its message.
            report(err, quiet=not ctx.is_main)
            ctx.barrier()
        raise
    except RuntimeError as err:
        if trainer is not None:
            try:
                trainer.progress.blame(err)  # raises naming the rank that stopped, if one did
            except RankStopped as named:
                stop_now(named)
        raise
    finally:
        if trainer is not None:
            trainer.strategy.close()
        if lock is not None:
            lock.release()  # after the last write into the directory
        zdist.shutdown(ctx)
