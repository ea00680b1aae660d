"""The training loop: micro-batches, accumulation, step, eval, logging, final weights.

Read it top to bottom: `run` validates the config (before any process group exists), sets up
the process group, and hands over to `Trainer.fit`. The trainer talks to the strategy only
through the protocol in zerolab/strategies/base.py.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from contextlib import nullcontext
from functools import partial
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from zerolab import dist as zdist
from zerolab.config import Config, global_batch, to_dict, validate
from zerolab.checkpoint import Checkpointer, model_layout
from zerolab.data import WindowSampler, build_data
from zerolab.digest import write_digest
from zerolab.fault import FaultInjector, ProgressBoard
from zerolab.memory import check_against, ledger_for_run, process_memory, process_summary
from zerolab.metrics import MetricsSink
from zerolab.models import build_model, count_params, lm_loss, param_groups
from zerolab.optim import build_optimizer
from zerolab.optim.schedule import LRSchedule
from zerolab.precision import Precision
from zerolab.strategies import strategy_class

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


def resolve_run_dir(cfg: Config, ctx: zdist.DistContext) -> str:
    """One directory for all ranks: given as run.dir, or chosen by rank 0 and broadcast."""
    path = cfg.run.dir
    if not path:
        path = ctx.broadcast_object(new_run_dir(cfg) if ctx.is_main else None)
    if ctx.is_main:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.yaml"), "w") as fh:
            fh.write(OmegaConf.to_yaml(to_dict(cfg)))
    ctx.barrier()
    return os.path.abspath(path)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Trainer:
    def __init__(self, cfg: Config, ctx: zdist.DistContext, model: Optional[torch.nn.Module] = None):
        """`model`: train this module (it must map token ids to logits) instead of cfg.model."""
        self.cfg, self.ctx = cfg, ctx
        t = cfg.trainer
        self.run_dir = resolve_run_dir(cfg, ctx)
        self.precision = Precision.from_config(cfg.precision)

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
        self.fault = FaultInjector(cfg.fault, ctx.rank, ctx.world_size)
        self.progress = ProgressBoard(ctx.rank, ctx.world_size, ctx.store)  # names a rank that stops
        self.checkpointer = Checkpointer(cfg, ctx, self.run_dir, model_layout(model), self.strategy)
        if cfg.checkpoint.resume:  # weights, optimizer state, RNG, loss scale; data and LR follow the step
            self.start_step = self.checkpointer.resume(self.strategy, self.schedule, self.sampler)
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
        for micro in range(accum):
            batch = self.data.train_batch(self.sampler, step, self.ctx.rank, micro, self.ctx.device)
            # Only the last micro-batch communicates (DDP's no_sync; ZeRO-2 keeps reducing).
            with self.strategy.no_sync() if micro < accum - 1 else nullcontext():
                loss = lm_loss(self.model(batch.x), batch.y)
                scaled = loss / accum
                if micro == accum - 1 and self._inject_inf(step):
                    # fault.inf_grad_step: this rank's last backward carries inf, so its gradients
                    # are non-finite before the reduction and every rank sees the overflow.
                    scaled = scaled * float("inf")
                self.strategy.backward(scaled)
            losses.append(loss.detach())
        # Optimizer statistics cost norms and a device sync: only on steps that are logged.
        logged = self.logs_step(step)
        every = self.cfg.logging.layer_stats_every
        self.strategy.stats_level = 0 if not logged else 2 if every and (step + 1) % every == 0 else 1
        info = self.strategy.step(lr)
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
        out.update(process_memory(self.ctx.device))
        out["comm_bytes"] = comm.get("total", 0.0)
        return out

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.trainer
        tokens_per_step = self.global_batch * cfg.model.block_size
        step_times, eval_loss, loss = [], float("nan"), float("nan")
        bar = tqdm(total=t.max_steps, initial=self.start_step, disable=not (ctx.is_main and cfg.logging.progress),
                   dynamic_ncols=True, desc=cfg.strategy.name)
        per_rank: list[dict] = []
        for step in range(self.start_step, t.max_steps):
            self.fault.before_step(step)
            self.progress.starting(step)
            ctx.synchronize()
            t0 = time.perf_counter()
            local_loss, lr, info = self.train_step(step)
            ctx.synchronize()
            dt = time.perf_counter() - t0
            step_times.append(dt)
            comm = self.strategy.comm.pop_step()
            if self.logs_step(step):
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
                if not self.mem_check and not info.skipped:  # first real update: optimizer state exists
                    pred_keys, self.mem_check = check_against(self.mem_pred, per_rank, warn=ctx.is_main)
                    record.update(pred_keys)
                if self.evals_step(step):
                    eval_loss = record["eval_loss"] = self.evaluate()
                self.metrics.log(record)
                bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{dt:.3f}")
            bar.update(1)
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                self.checkpointer.save(step + 1, self.strategy, self.schedule, self.sampler)
        bar.close()
        summary = self.finish(loss, eval_loss, step_times, per_rank)
        return summary

    def finish(self, loss: float, eval_loss: float, step_times: list[float], per_rank: list[dict]) -> dict:
        cfg, ctx = self.cfg, self.ctx
        weights = self.strategy.consolidated_state_dict()  # collective
        # Fixed held-out logits and the noise-level gradient probe, for the parity report (collective).
        digest = write_digest(self.model, self.data, cfg.model, weights, self.run_dir, ctx.is_main, ctx.device)
        self.progress.close()
        summary = {
            "final_loss": loss, "eval_loss": eval_loss, "steps": cfg.trainer.max_steps,
            "world_size": ctx.world_size, "strategy": cfg.strategy.name, "precision": cfg.precision.name,
            "optimizer": cfg.optim.name, "model": cfg.model.name, "n_params": self.n_params,
            "global_batch": self.global_batch,
            "step_time_p50_s": statistics.median(step_times) if step_times else None,
            "step_time_p95_s": percentile(step_times, 95) if step_times else None,
            "peak_memory_per_rank": [{k: v for k, v in r.items() if "peak" in k or "max" in k} for r in per_rank],
            "memory_per_rank": [{k: v for k, v in r.items() if k.startswith("mem/")} for r in per_rank],
            "memory_ledger": {**self.mem_check, "process_per_rank": process_summary(per_rank)},
            "run_dir": self.run_dir, "metrics": self.metrics.path, "eval_digest": digest,
        }
        if ctx.is_main:
            if cfg.run.save_model and weights is not None:
                from safetensors.torch import save_file

                path = os.path.join(self.run_dir, "model.safetensors")
                save_file(weights, path + ".tmp")
                os.replace(path + ".tmp", path)
                summary["weights"] = path
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
            log.info("eval loss %.4f (uniform baseline ln 256 = 5.545) | p50 step %.3fs", eval_loss,
                     summary["step_time_p50_s"] or 0)
            log.info("metrics: %s", self.metrics.path)
            if "weights" in summary:
                log.info("weights: %s", summary["weights"])
            log.info("summary: %s", os.path.join(self.run_dir, "summary.json"))
        self.metrics.close(summary)
        ctx.barrier()
        return summary


def write_json(path: str, obj) -> None:
    """Atomic JSON write: readers see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def run(dcfg: DictConfig | Config) -> Optional[dict]:
    cfg = validate(dcfg)  # raises ConfigError before any process group exists
    ctx = zdist.init(cfg.dist)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    trainer = None
    try:
        trainer = Trainer(cfg, ctx)
        return trainer.fit()
    except RuntimeError as err:
        if trainer is not None:
            trainer.progress.blame(err)  # raises naming the rank that stopped, if one did
        raise
    finally:
        zdist.shutdown(ctx)
