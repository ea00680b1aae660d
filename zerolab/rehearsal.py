"""`python -m zerolab dry-run`: rank r of an N-rank job, rehearsed in one process on fake tensors.

What runs is the job's own code. The Trainer builds the model, the strategy wraps and shards it,
and Trainer.train_step runs forward, backward, the strategy's gradient reduction and its
optimizer step, each step a logged one, until the step's peak repeats; the memory monitor
counts what exists exactly as on a logged step of a real run (zerolab.run.monitor), and the ledger's
prediction for the same run is printed beside it. What is not real, and why it cannot change
what is counted:

- Tensors are fake (torch._subclasses.FakeTensorMode): shapes, dtypes and storage sizes, no data,
  so a 7B model allocates nothing. Every storage is counted by size (accounting.storage_key).
- The process group is torch's fake one (FakeProcessGroup, registered here): each collective
  returns a correctly shaped output and moves nothing, so the strategies' own communication
  code runs unchanged at any rank of any world size.
- A value read back to the host (`.item()`) has no data behind it, except where it never
  depended on data: the loss scale, its counters and the optimizer's step counters are scalars
  that fake tensors keep as constants (they are made with torch.tensor for this), and read
  exactly. Everything else (a loss, a gradient norm, a trust ratio) is answered in one place
  (_RehearsalMode): 1.0 for a float, 1 for an integer, False for a flag (no step skipped, nobody
  asked to stop). Every rehearsed step is a logged one, so the steps are decided on the host from
  those answers (a finite norm: the update happens); none of them changes what is allocated.
- What ranks exchange as objects (the figures gathered for the record) is this rank's own, and
  the data is synthetic tokens of the configured shape (data.kind=synthetic).
- transformers asks one question of the data itself: whether a batch packs several sequences
  (then it builds a B x T x T mask). On fake tensors it cannot tell and builds the mask; zerolab's
  batches are whole windows and never pack, which is what a real run finds, so the rehearsal
  answers that (_whole_windows).

What it does not count: the allocator's rounding and fragmentation, NCCL's buffers, the CUDA
context and kernels' workspaces; the output says so on a line of its own.

DeepSpeed is not rehearsed: its engine moves the module with `.to()` (stages 1 and 2) and checks
parameters across ranks by their data at its first forward (stage 3); the output shows the
ledger's prediction and says why.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from zerolab import dist as zdist
from zerolab.accounting import CATEGORIES, human_bytes
from zerolab.config import ConfigError, check_overrides, compose, config_groups
from zerolab.errors import ZerolabError
from zerolab.models import build_model
from zerolab.models.blocks_report import blocks_line, describe_blocks
from zerolab.predict import cli as predict_cli
from zerolab.predict.record import StepRecord, record_steps
from zerolab.predict.report import format_prediction
from zerolab.predict.runs import comparison, read_run
from zerolab.schema import FaultConfig, ProfileConfig
from zerolab.strategies import strategy_class
from zerolab.topology import topology_for
from zerolab.trainer import Trainer


# rehearsed steps: at least 3 (the optimizer state exists from the first), until the peak repeats
MIN_STEPS, MAX_STEPS = 3, 8
NOT_COUNTED = ("not counted here (nor by the ledger): the allocator's rounding and fragmentation, NCCL's buffers, "
               "the CUDA context and kernels' workspaces: leave a margin for them (python -m zerolab plan keeps 10%)")
FIGURES = [  # (key of the run's per-rank figures, row label)
    *((f"mem/{c}_bytes", c) for c in CATEGORIES),
    ("mem/model_states_bytes", "model states"),
    ("mem/activations_bytes", "activations"),
    ("mem/peak_bytes", "peak"),
    ("mem/peak_model_states_bytes", "  model states"),
    ("mem/peak_activations_bytes", "  activations"),
    ("mem/peak_transient_bytes", "  transient"),
]


# ---- the fake world ------------------------------------------------------------------------------
def register_fake_backend() -> None:
    """torch's C++ FakeProcessGroup as the `fake` backend, unless something registered it already
    (importing torch.testing's fake_pg, as FSDP2's tests do, registers the same)."""
    if "FAKE" in dist.Backend._plugins:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common, options):
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])


class _RehearsalMode(FakeTensorMode):
    """Fake tensors whose host reads are answered (the module docstring says with what)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if getattr(t, "constant", None) is not None:  # a value fake tensors still know (a counter)
                return t.constant.item()
            return False if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _whole_windows():
    """transformers' packed-sequence check, answered "not packed" (module docstring)."""
    masking = None
    if "transformers" in sys.modules:  # (a model=hf job has imported it by now: its config was read)
        import importlib

        masking = importlib.import_module("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda _position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


@dataclass
class RehearsalContext(zdist.DistContext):
    """Rank `rank` of `world_size` on the fake group: object exchanges return this rank's own."""

    rehearsal: bool = True

    def broadcast_object(self, obj, src: int = 0):
        return obj  # (the fake group would hand back whatever bytes its buffer held)

    def gather_objects(self, obj) -> list:
        return [obj] * self.world_size

    def all_reduce_mean(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def device_mesh(self):
        # A DeviceMesh computes this rank's coordinates from a real tensor of ranks.
        with unset_fake_temporarily():
            return super().device_mesh()

    def node_mesh(self):
        with unset_fake_temporarily():  # (as device_mesh)
            return super().node_mesh()


def _join(world: int, rank: int, ranks_per_node: int = 0) -> RehearsalContext:
    """The fake process group; its nodes are dist.ranks_per_node's when set (else one node), so the
    comm counter and the predictor's record see which groups cross nodes."""
    if dist.is_initialized():
        raise ZerolabError("a dry run needs a process without a process group (it makes a fake one)")
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    host = dist.new_group(backend="fake") if world > 1 else None
    return RehearsalContext(rank=rank, local_rank=0, world_size=world, device=torch.device("cpu"), backend="fake",
                            store=None, host_group=host,
                            topology=topology_for(ranks_per_node, world) if ranks_per_node > 0 else None)


# ---- the rehearsal -------------------------------------------------------------------------------
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
    not_rehearsed: str = ""  # why not, for a strategy that cannot run on fake tensors (its traits.rehearsable)
    blocks: dict = field(default_factory=dict)  # the repeated blocks the run takes (models.blocks_report)
    comm: dict = field(default_factory=dict)  # the strategy's comm counter, last step: comm_bytes, by link
    # With record=True: the last rehearsed step as the time model reads it (zerolab.predict.record),
    # and what the step's shape is (tokens per rank, model FLOPs per token). Not in to_dict.
    record: Optional[StepRecord] = field(default=None, repr=False)
    previous: Optional[StepRecord] = field(default=None, repr=False)
    tokens_per_rank: int = 0
    flops_per_token: int = 0

    def to_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("record", "previous")}
        return {**out, "not_counted": NOT_COUNTED}


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
             cfg=None) -> Rehearsal:
    """Rank `rank` of a `world`-rank job configured by `overrides` (train.py's), rehearsed in this
    process. Rank 0 by default: where shards are uneven (FSDP2's), the first ranks hold the most.
    `record`: also record what each step does, for the time model (Rehearsal.record); `quick`:
    for the record only (one logged step before it, not until the memory's peak repeats). `cfg`:
    a job's validated config instead of overrides (a run directory's: zerolab.predict.runs)."""
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is not a rank of a {world}-rank job (0 to {world - 1})")
    cfg = rehearsal_config(overrides, world) if cfg is None else for_rehearsal(cfg)
    out = Rehearsal(world, rank, cfg.strategy.name, cfg.model.name, cfg.precision.name)
    why_not = strategy_class(cfg.strategy.name).traits.rehearsable
    if why_not:
        out.blocks = describe_blocks(build_model(cfg.model, device="meta"), cfg.model.blocks)
        out.not_rehearsed = why_not
        out.predicted = _ledger_only(cfg, world, rank)
        return out
    start = time.perf_counter()
    if record:
        out.flops_per_token = predict_cli.model_flops_per_token(cfg)
    ctx = _join(world, rank, cfg.dist.ranks_per_node)
    try:
        with tempfile.TemporaryDirectory(prefix="zerolab-dry-run-") as run_dir, _RehearsalMode(), \
                _this_rank_only(rank):
            trainer = Trainer(cfg, ctx, run_dir=run_dir)  # (imports transformers for model=hf)
            out.blocks = trainer.blocks
            try:
                with _whole_windows():
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
        out.update({f"mem/{k}_bytes": v for k, v in memory.predicted[rank].bytes().items()})
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
    return {f"mem/{k}_bytes": v for k, v in preds[rank].bytes().items()} if preds else {}


# ---- activations of any model, measured on fake tensors (the planner's, for a user's model) --------
def activation_model(mcfg, seq: int, precision: str):
    """`predict(micro_batch, checkpointing)` -> an ActivationPrediction for model config `mcfg`
    (any source) at sequence `seq`: the bytes one forward and its loss save for backward, as the
    trainer's meter counts them, measured on fake tensors (CPU kernels) at micro-batches 1, 2 and
    3 for each checkpointing mode and extended linearly from 2 and 3 (every saved tensor is either
    per sequence or shared by the batch, so the bytes are affine in the micro-batch from 2 on; at
    1 some copies are views, e.g. the loss's flattened targets). With checkpointing, the
    recomputed block (the peak's transient) is the difference of the two modes per block."""
    from zerolab.accounting import ActivationMeter
    from zerolab.activations import ActivationPrediction
    from zerolab.models import build_model, find_blocks, lm_loss, place
    from zerolab.precision import Precision
    from zerolab.schema import PrecisionConfig

    dtype = Precision.from_config(PrecisionConfig(name=precision)).compute_dtype
    measured, n_blocks = {}, 0
    with _RehearsalMode(), _whole_windows():
        for mode in ("none", "blocks"):
            model = build_model(dataclasses.replace(mcfg, block_size=seq, activation_checkpointing=mode, weights=""),
                                device="cpu")
            place(model, torch.device("cpu"), dtype).train()
            found = find_blocks(model, mcfg.blocks)
            n_blocks = len(found.modules) if found is not None else 0
            if mode == "blocks" and not n_blocks:
                break
            for b in (1, 2, 3):
                ids = torch.zeros(b, seq + 1, dtype=torch.long)
                with ActivationMeter(model) as meter:
                    lm_loss(model(ids[:, :-1]), ids[:, 1:])
                measured[mode, b] = meter.bytes

    def predict(micro_batch: int, checkpointing: str) -> ActivationPrediction:
        mode = checkpointing if (checkpointing, 1) in measured else "none"
        at = {m: measured[m, 1] if micro_batch == 1
              else measured[m, 2] + (micro_batch - 2) * (measured[m, 3] - measured[m, 2])
              for m in ("none", "blocks") if (m, 1) in measured}
        pred = ActivationPrediction(mcfg.name, micro_batch, seq, precision, "cpu (rehearsed)", mode)
        pred.add(f"saved for backward, measured on fake tensors ({mode})", at[mode])
        if mode != "none":
            pred.layer_bytes = (at["none"] - at["blocks"]) // n_blocks  # one block recomputed, minus its input
        return pred

    return predict


# ---- output --------------------------------------------------------------------------------------
def format_rehearsal(r: Rehearsal) -> str:
    head = (f"dry run of rank {r.rank} of {r.world}: model {r.model}"
            + (f" ({r.n_params:,} parameters)" if r.n_params else "")
            + f" | strategy {r.strategy} | precision {r.precision}")
    blocks = [blocks_line(r.blocks)] if r.blocks else []  # last: which modules the job takes as its blocks
    if r.not_rehearsed:
        lines = [head, f"not rehearsed: {r.not_rehearsed}.", "the ledger's prediction for this rank:"]
        lines += [f"  {label:<15} {human_bytes(r.predicted[key]):>12}" for key, label in FIGURES if key in r.predicted]
        return "\n".join(lines + blocks)
    lines = [head, f"{'':<17}{'rehearsed':>12} {'ledger':>12} {'difference':>12}"]
    for key, label in FIGURES:
        m, p = r.measured.get(key), r.predicted.get(key)
        if m is None:
            continue
        diff = "" if p is None else f"{m - p:+,}" if abs(m - p) < 10_000 else f"{100 * (m - p) / p:+.2f}%" if p else ""
        lines.append(f"{label:<17}{human_bytes(m):>12} {human_bytes(p) if p is not None else '-':>12} {diff:>12}")
    phase = r.measured.get("mem/peak_phase")
    lines.append(f"the peak is in the {phase}" + (f" (the ledger's: in the {r.predicted['mem/peak_phase']})"
                                                  if "mem/peak_phase" in r.predicted else ""))
    lines.append(f"{r.steps} steps rehearsed in {r.seconds:.1f} s (this process's peak RSS "
                 f"{human_bytes(r.rss_peak_bytes)}); peaks per step: {', '.join(human_bytes(p) for p in r.peaks)}")
    lines.append(NOT_COUNTED)
    return "\n".join(lines + blocks)


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerolab dry-run",
        description="Rehearse rank R of an N-rank job in this process, on fake tensors and a fake process group: "
                    "the job's own model, strategy, forward, backward, reduction and optimizer step, and the "
                    "memory a real run would count, beside the ledger's prediction.")
    parser.add_argument("--world", type=int, required=True, help="ranks of the job rehearsed")
    parser.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON (the run's mem/... keys) instead of a table")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for train.py (strategy=zero3 model=hf ...)")
    predict_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error("--world must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        cfg, topo = rehearsal_config(args.overrides, args.world), None
        if args.hardware:  # refused before anything is rehearsed; the dry run's nodes are the prediction's
            topo = predict_cli.topology(args, args.world, cfg.dist.ranks_per_node)
            cfg.dist.ranks_per_node = predict_cli.ranks_per_node(topo) or cfg.dist.ranks_per_node
        result = rehearse([], args.world, args.rank, record=topo is not None, cfg=cfg)
        prediction = predict_cli.priced(result, topo) if topo is not None and result.record is not None else None
    except ConfigError as err:
        print(f"zerolab dry-run: {err}", file=sys.stderr)
        return 2
    if args.json:
        extra = {"prediction": prediction.to_dict()} if prediction else {}
        print(json.dumps({**result.to_dict(), **extra}, indent=2))
        return 0
    print(format_rehearsal(result))
    if prediction is not None:
        print("\n" + format_prediction(prediction))
    elif topo is not None:
        print(f"\nno time predicted: {result.strategy} is not rehearsed, so there is no step to price")
    return 0


def predict_run(run_dir: str, hardware: str = "cpu", gpus_per_node: Optional[int] = None) -> Optional[dict]:
    """The time model's prediction for a finished run (its own config, rank 0 rehearsed) beside what
    its profiled steps measured (zerolab.predict.runs.comparison); None for a strategy that is not
    rehearsed. `hardware` "cpu": this machine's calibration (where zerolab's CPU runs ran)."""
    job = read_run(run_dir)
    topo = predict_cli.topology(predict_cli.arguments(hardware, gpus_per_node), job.world, job.cfg.dist.ranks_per_node)
    r = rehearse([], job.world, record=True, quick=True, cfg=job.cfg)
    return comparison(predict_cli.priced(r, topo), job) if r.record is not None else None
