"""A dry run: rank r of an N-rank job, its own Trainer stepped in the fake world (fake.py).

What runs is the job's own code. The Trainer builds the model, the strategy wraps and shards it,
and Trainer.train_step runs forward, backward, the strategy's gradient reduction and its
optimizer step, each step a logged one, until the step's peak repeats; the memory monitor
counts what exists exactly as on a logged step of a real run (zerolab.run.monitor), and the
ledger's prediction for the same run is kept beside it. Every rehearsed step is a logged one, so
the steps are decided on the host from the fake world's answers (a finite norm: the update
happens); none of them changes what is allocated. The data is synthetic tokens of the configured
shape (data.kind=synthetic).

What it does not count: the allocator's rounding and fragmentation, NCCL's buffers, the CUDA
context and kernels' workspaces (NOT_COUNTED says so beside every figure).

DeepSpeed is not rehearsed: its engine moves the module with `.to()` (stages 1 and 2) and checks
parameters across ranks by their data at its first forward (stage 3); a dry run of it gives the
ledger's prediction and says why.
"""
from __future__ import annotations

import contextlib
import logging
import re
import resource
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from zerolab import dist as zdist
from zerolab.config import ConfigError, check_overrides, compose, config_groups
from zerolab.models import build_model
from zerolab.models.blocks_report import describe_blocks
from zerolab.predict import cli as predict_cli
from zerolab.predict.record import StepRecord, record_steps
from zerolab.rehearsal.fake import RehearsalMode, join_fake_world, target_kernels, whole_windows
from zerolab.schema import FaultConfig, ProfileConfig
from zerolab.strategies import strategy_class
from zerolab.topology import topology_for
from zerolab.trainer import Trainer

# rehearsed steps: at least 3 (the optimizer state exists from the first), until the peak repeats
MIN_STEPS, MAX_STEPS = 3, 8
NOT_COUNTED = ("not counted here (nor by the ledger): the allocator's rounding and fragmentation, NCCL's buffers, "
               "the CUDA context and kernels' workspaces: leave a margin for them (python -m zerolab plan keeps 10%)")


@dataclass
class Rehearsal:
    world: int
    rank: int
    strategy: str
    model: str
    precision: str
    n_params: int = 0
    steps: int = 0
    seconds: float = 0.0
    rss_peak_bytes: int = 0  # this process's, for the record of what a rehearsal costs
    measured: dict = field(default_factory=dict)  # the run's figure keys (mem/...), as a real run logs them
    predicted: dict = field(default_factory=dict)  # the ledger's, under the same keys (None where it has no model)
    peaks: list = field(default_factory=list)  # mem/peak_bytes of every rehearsed step
    not_rehearsed: str = ""  # why not, for a strategy that cannot run on fake tensors (its traits.not_rehearsable)
    kernels: str = "cpu"  # the device type whose kernels ran the step (fake.target_kernels)
    blocks: dict = field(default_factory=dict)  # the repeated blocks the run takes (models.blocks_report)
    comm: dict = field(default_factory=dict)  # the strategy's comm counter, last step: comm_bytes, by link
    ranks_per_node: int = 1  # the job's ranks on one node, which share its host memory (offload)
    # With record=True: the last rehearsed step as the time model reads it (zerolab.predict.record),
    # and what the step's shape is (tokens per rank, model FLOPs per token). Not in to_dict.
    record: Optional[StepRecord] = field(default=None, repr=False)
    previous: Optional[StepRecord] = field(default=None, repr=False)
    tokens_per_rank: int = 0
    flops_per_token: int = 0

    def to_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("record", "previous")}
        # a node's ranks share its host memory (offload): this rank's host bytes times the ranks of a node
        host = self.measured.get("mem/host_bytes", self.predicted.get("mem/host_bytes", 0))
        return {**out, "host_per_node_bytes": host * self.ranks_per_node, "not_counted": NOT_COUNTED}


def rehearsal_config(overrides: list[str], world: int):
    """The job's config for `world` ranks, validated as the job's would be, with what a rehearsal
    must not do switched off: no data read (synthetic tokens of the same shape), no weights read,
    no wandb, no checkpoint written or resumed, no eval, no faults or profiles; every step logged."""
    check_overrides(overrides, config_groups())  # an unknown key or group option, in zerolab's words
    return for_rehearsal(compose(overrides, world_size=world))


def for_rehearsal(cfg):
    """A job's validated config with what a rehearsal must not do switched off (rehearsal_config)."""
    cfg.data.kind = "synthetic"
    cfg.model.weights = ""
    cfg.logging.wandb.mode, cfg.logging.progress = "disabled", False
    cfg.checkpoint.every, cfg.checkpoint.resume = 0, ""
    cfg.trainer.eval_every, cfg.trainer.log_every = 0, 1
    cfg.trainer.max_steps = MAX_STEPS
    cfg.run.save_model = False
    cfg.fault, cfg.profile = FaultConfig(), ProfileConfig()
    return cfg


def rehearse(overrides: list[str], world: int, rank: int = 0, record: bool = False, quick: bool = False,
             cfg=None, target: str = "") -> Rehearsal:
    """Rank `rank` of a `world`-rank job configured by `overrides` (train.py's), rehearsed in this
    process. Rank 0 by default: where shards are uneven (FSDP2's), the first ranks hold the most.
    `record`: also record what each step does, for the time model (Rehearsal.record); `quick`:
    for the record only (one logged step before it, not until the memory's peak repeats). `cfg`:
    a job's validated config instead of overrides (a run directory's: zerolab.predict.runs).
    `target`: the device type whose kernels run the step ("cpu" or "cuda": fake.target_kernels);
    default the job's (dist.device=cuda: cuda, else cpu)."""
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is not a rank of a {world}-rank job (0 to {world - 1})")
    cfg = rehearsal_config(overrides, world) if cfg is None else for_rehearsal(cfg)
    out = Rehearsal(world, rank, cfg.strategy.name, cfg.model.name, cfg.precision.name,
                    ranks_per_node=topology_for(cfg.dist.ranks_per_node, world).per_node)
    why_not = strategy_class(cfg.strategy.name).traits.not_rehearsable
    if why_not:
        out.blocks = describe_blocks(build_model(cfg.model, device="meta"), cfg.model.blocks)
        out.not_rehearsed = why_not
        out.predicted = _ledger_only(cfg, world, rank)
        return out
    start = time.perf_counter()
    if record:
        out.flops_per_token = predict_cli.model_flops_per_token(cfg)
    target = out.kernels = target or ("cuda" if cfg.dist.device == "cuda" else "cpu")
    ctx = join_fake_world(world, rank, cfg.dist.ranks_per_node, target)
    try:
        with tempfile.TemporaryDirectory(prefix="zerolab-dry-run-") as run_dir, RehearsalMode(), \
                target_kernels(target), _this_rank_only(rank):
            trainer = Trainer(cfg, ctx, run_dir=run_dir)  # (imports transformers for model=hf)
            out.blocks = trainer.blocks
            try:
                with whole_windows():
                    _steps(trainer, out, record, 1 if quick else MIN_STEPS)
            finally:
                trainer.close()
    finally:
        zdist.shutdown(ctx)
    out.seconds = time.perf_counter() - start
    out.rss_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _steps(trainer, out: Rehearsal, record: bool, min_steps: int) -> None:
    """Logged steps, as a real run's, until the peak repeats (at least `min_steps`); with `record`,
    then two steps that are not logged, recorded (zerolab.predict.record.record_steps)."""
    out.n_params = trainer.n_params
    for step in range(MAX_STEPS):
        loss, lr, info = trainer.train_step(step)
        if _logged_step(trainer, out, step, loss, lr, info, min_steps):
            break
    out.predicted = _predicted(trainer.memory, out.rank)
    if record:
        cfg = trainer.cfg
        out.tokens_per_rank = cfg.data.micro_batch * cfg.trainer.grad_accum_steps * cfg.model.block_size
        out.record, out.previous = record_steps(trainer, out.steps)


def _logged_step(trainer, out: Rehearsal, step: int, loss, lr, info, min_steps: int) -> bool:
    """The step's record (a real run's logged step); whether the rehearsal is done (the peak repeats)."""
    _, per_rank = trainer.log_step(step, 1.0, loss, lr, info)
    out.measured = {k: v for k, v in per_rank[out.rank].items() if k.startswith("mem/")}
    out.comm = {k: v for k, v in per_rank[out.rank].items() if k.startswith("comm_")}
    out.peaks.append(out.measured["mem/peak_bytes"])
    out.steps = step + 1
    return out.steps >= min_steps and (min_steps == 1 or out.peaks[-1] == out.peaks[-2])


@contextlib.contextmanager
def _this_rank_only(rank: int):
    """Silence the memory ledger's warnings about ranks other than the rehearsed one: their figures
    are copies of this rank's (what ranks exchange as objects is this rank's own), so a warning
    about them says nothing about them."""
    def only(record: logging.LogRecord) -> bool:
        named = re.search(r"\brank (\d+):", record.getMessage())
        return named is None or int(named.group(1)) == rank

    logger = logging.getLogger("zerolab.memory")
    logger.addFilter(only)
    try:
        yield
    finally:
        logger.removeFilter(only)


def _predicted(memory, rank: int) -> dict:
    """The ledger's prediction for this rank under the figures' keys (zerolab.run.monitor's)."""
    out = {}
    if memory.predicted:
        out.update({f"mem/{k}_bytes": v for k, v in memory.predicted[rank].placed().items()})
    if memory.activations_predicted is not None:
        out["mem/activations_bytes"] = memory.activations_predicted
    if memory.peak_predicted:
        pk = memory.peak_predicted[rank]
        out.update({"mem/peak_bytes": pk.bytes, "mem/peak_phase": pk.phase,
                    **{f"mem/peak_{k}_bytes": v for k, v in pk.parts.items()}})
    return out


def _ledger_only(cfg, world: int, rank: int) -> dict:
    from zerolab.memory import ledger_for_run

    preds = ledger_for_run(cfg, world)
    return {f"mem/{k}_bytes": v for k, v in preds[rank].placed().items()} if preds else {}
