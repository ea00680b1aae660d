"""zerolab's configuration schema: typed dataclasses registered in Hydra's ConfigStore, closed
(zerolab/schema_keys.py refuses any key they do not declare, with the nearest valid one).

A field that has an effect only for some setups says so where it is declared:
`setting(default, applies=...)`, with `applies` either BY_STRATEGY (the chosen strategy's class
decides: Strategy.reads) or (key, values) (only when config key `key` has one of
`values`). zerolab.config.validate warns, once, about a value set away from its default that
has no effect for the chosen setup. The value checks themselves are zerolab.config.validate's.

This module is at the bottom of zerolab's layers: everything reads it, it reads only
zerolab.errors. (A strategy that needs a setting of its own adds it to its settings dataclass in
the strategy section below; every strategy.* field is decided by the strategy, BY_STRATEGY.)
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from zerolab.errors import ConfigError

BY_STRATEGY = "by strategy"  # `applies=`: the chosen strategy's class says whether it reads the key


def setting(default: Any = MISSING, *, applies=None, factory=None):
    """A schema field, with when it has an effect (`applies`: BY_STRATEGY, or (key, values))."""
    metadata = {"applies": applies}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _only(key: str, *values: str) -> tuple[str, tuple[str, ...]]:
    return key, values


GPT = _only("model.kind", "gpt")
FP16 = _only("precision.name", "fp16")


HF = _only("model.kind", "hf")
USERS = _only("model.kind", "hf", "custom")  # models zerolab did not write (docs/models.md)


@dataclass
class ModelConfig:
    name: str = MISSING  # label used in logs, e.g. gpt_tiny
    # gpt | mlp (zerolab's own) | hf (a transformers causal LM) | custom (any nn.Module): docs/models.md
    kind: str = "gpt"
    # model=hf: taken from the config (model.vocab_size need not be set); model=custom: the V of
    # the [B, T, V] logits the module returns
    vocab_size: int = 256
    block_size: int = 64  # the training window; model=hf: at most the config's position limit
    # hf: a config.json, a directory holding one (a saved model), or a hub id found in the local
    # Hugging Face cache (zerolab never downloads)
    config: str = setting("", applies=HF)
    # hf, custom: start from these weights (a .safetensors file, or a saved-model directory,
    # sharded index included), keyed by the model's own parameter names; empty: initialised from
    # trainer.seed, the same under every strategy and world size
    weights: str = setting("", applies=USERS)
    # custom: pkg.module:Name, a class or factory on the Python path returning an nn.Module that
    # maps token ids [B, T] to logits [B, T, V] (or an object with .logits), built with `kwargs`
    target: str = setting("", applies=_only("model.kind", "custom"))
    kwargs: Dict[str, Any] = setting(applies=_only("model.kind", "custom"), factory=dict)
    # The repeated blocks (what zero3 gathers, fsdp wraps, activation checkpointing recomputes):
    # a dotted module path (e.g. model.layers); empty: found automatically (zerolab/models/units.py)
    blocks: str = ""
    # gpt
    n_layer: int = setting(2, applies=GPT)
    n_head: int = setting(2, applies=GPT)
    n_embd: int = setting(64, applies=GPT)
    bias: bool = setting(True, applies=GPT)
    dropout: float = setting(0.0, applies=GPT)
    # Activation checkpointing of the model's blocks (model.blocks; torch's non-reentrant
    # checkpoint, RNG preserved): none | blocks (every block) | every_k (blocks 0, k, 2k, ...: one
    # block in k recomputes) | selective (every block, op-level: torchtitan's policy keeps the
    # matmuls' outputs but every second one's, and attention's; the rest is recomputed). Any
    # model with blocks: gpt, hf, custom (mlp has none)
    activation_checkpointing: str = "none"
    checkpoint_every_k: int = setting(2, applies=_only("model.activation_checkpointing", "every_k"))
    # mlp: embedding -> `mlp_depth` hidden layers of width `mlp_hidden` -> logits
    mlp_hidden: int = setting(128, applies=_only("model.kind", "mlp"))
    mlp_depth: int = setting(2, applies=_only("model.kind", "mlp"))


@dataclass
class DataConfig:
    kind: str = "text"  # text | synthetic
    # A token file from `python -m zerolab data prepare` (its tail is the validation split), or a
    # directory holding train.bin and val.bin (nanoGPT's layout); uint16 unless the file's sidecar
    # `<file>.json` says uint32 (docs/data.md). Empty: the embedded corpus (the running
    # interpreter's standard-library sources, byte-level), prepared once into `cache_dir`.
    path: str = ""
    cache_dir: str = "${oc.env:ZEROLAB_CACHE,${oc.env:HOME}/.cache/zerolab}"
    val_fraction: float = 0.05  # a single token file's tail kept for validation (not used for a directory)
    micro_batch: int = 8  # sequences per rank per micro-batch
    # 0: derived as micro_batch * grad_accum_steps * world_size. Set it to fix the global batch
    # and let zerolab derive grad_accum_steps (must divide exactly).
    global_batch: int = 0


# ---- strategies: each one's settings, and the one section Hydra composes ----------------------------
# A strategy reads exactly the fields of its own settings dataclass (Strategy.traits.settings); the
# section `strategy` is their union, so one sweep can give every strategy the same overrides and a
# value that has no effect under the chosen strategy is warned about (zerolab.config), not refused.
# They live here, below every layer, so that a config is checked without importing a strategy.
@dataclass
class StrategySettings:
    name: str = MISSING  # a key of zerolab.strategies.REGISTRY


@dataclass
class BucketSettings(StrategySettings):
    # MB of gradient per bucket: DDP's all-reduce buckets, zerolab's reduce-scatter/all-gather
    # buckets, DeepSpeed's reduce/all-gather bucket sizes (converted to elements)
    bucket_mb: float = 25.0


@dataclass
class DDPSettings(BucketSettings):
    find_unused_parameters: bool = False  # parameters that may get no gradient


@dataclass
class OffloadSettings(BucketSettings):
    # ZeRO-Offload (Ren et al. 2021): the master, the optimizer state and the optimizer step live on
    # the host; gradient shards go down as they are reduced, updated 16-bit weights come back
    offload_optimizer: bool = False
    # ZeRO-Infinity's parameter offload (Rajbhandari et al., SC 2021): stage 3's parameter shards live on
    # the host between uses and are gathered to the device unit by unit
    offload_params: bool = False


@dataclass
class ZeroSettings(OffloadSettings):
    # the dtype gradients are reduce-scattered in: auto (= gradient dtype) | fp32; zero3 also keeps
    # its gradient shard in it (16-bit under bf16/fp16 with auto)
    reduce_dtype: str = "auto"
    # who shares a shard (docs/nodes.md): world (every rank: the ZeRO paper's 1/N) | node (the ranks
    # of one node, replicated on every node: FSDP2's HSDP for zero3, the same for zero1/2's optimizer
    # state; gradient shards are all-reduced across nodes once per step)
    shard_within: str = "world"


@dataclass
class Zero3Settings(ZeroSettings):
    # free a unit's all-gathered weights after its forward and gather them again for its backward
    # (3Ψ(N-1)/N sent per rank per micro-batch, one unit's weights alive at a time); false keeps
    # them from forward until the unit's backward is done (2Ψ(N-1)/N, more memory)
    reshard_after_forward: bool = True
    # ZeRO++ (Wang et al. 2023; docs/nodes.md). hpz: a secondary copy of the weights, sharded inside
    # each node, taken after the forward all-gather; the backward all-gathers it over the node
    hpz: bool = False
    # qwZ: all-gather weights as int8 blocks (one fp32 scale per strategy.quant_block elements)
    quantize_weights: bool = False
    # qgZ: reduce-scatter gradients as int4 blocks through an all-to-all inside the node, then across
    quantize_grads: bool = False
    quant_block: int = 256  # elements per quantization block (even: int4 packs two per byte)


@dataclass
class DeepSpeedSettings(OffloadSettings):
    stage: int = 0  # its ZeRO stage (0-3; conf/strategy/deepspeed.yaml sets 2)
    overlap_comm: bool = True  # overlap its reductions with backward
    client_optimizer: bool = False  # allow zerolab's LAMB/LARS as a client optimizer
    # stage 3, zero3's setting under the same name: true frees a module's gathered weights after its
    # forward (stage3_max_reuse_distance 0); false keeps those it uses again within 1e9 elements
    # (DeepSpeed's default), so a smaller model keeps every weight gathered from forward to backward
    reshard_after_forward: bool = True
    ds_config_overrides: Dict[str, Any] = field(default_factory=dict)  # merged into its JSON config last


@dataclass
class FSDPSettings(StrategySettings):
    # OffloadSettings' two settings without buckets (fully_shard has none); FSDP2's CPUOffloadPolicy
    # moves the sharded parameters, gradients and optimizer step to the host together, so the strategy
    # accepts them only together (zerolab/strategies/fsdp.py)
    offload_optimizer: bool = False
    offload_params: bool = False


@dataclass
class StrategyConfig(Zero3Settings, DDPSettings, DeepSpeedSettings, FSDPSettings):
    """The union of every strategy's settings: the `strategy` section of the config."""


STRATEGY_SETTINGS = (StrategySettings, BucketSettings, OffloadSettings, DDPSettings, ZeroSettings, Zero3Settings,
                     DeepSpeedSettings, FSDPSettings)


def settings_for(section: Any, settings: type) -> Any:
    """The fields of `settings` (a strategy's dataclass) taken from a config's strategy section."""
    if settings not in STRATEGY_SETTINGS:  # a strategy's settings are the schema's, so sweeps and checks see them
        raise TypeError(f"{settings.__name__} is not one of zerolab.schema's strategy settings: add its fields to "
                        "a dataclass there, in StrategyConfig's bases and in STRATEGY_SETTINGS")
    return settings(**{f.name: getattr(section, f.name) for f in dataclasses.fields(settings)})


@dataclass
class OptimConfig:
    name: str = MISSING  # adamw | adam | sgd | sgd_momentum | lamb | lars
    lr: float = 1e-3  # peak lr at base_batch (scaled by lr_scaling for the actual batch)
    betas: List[float] = setting(applies=_only("optim.name", "adamw", "adam", "lamb"), factory=lambda: [0.9, 0.95])
    eps: float = setting(1e-8, applies=_only("optim.name", "adamw", "adam", "lamb", "lars"))
    weight_decay: float = 0.1
    momentum: float = setting(0.9, applies=_only("optim.name", "sgd_momentum", "lars"))
    trust_coefficient: float = setting(0.001, applies=_only("optim.name", "lars"))
    max_trust_ratio: Optional[float] = setting(None, applies=_only("optim.name", "lamb", "lars"))
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    # zerolab optimizer kernel: auto (fused AdamW/Adam/SGD on CPU fp32, else foreach) | foreach | for_loop
    impl: str = setting("auto", applies=BY_STRATEGY)  # (DeepSpeed's own Adam/AdamW has its own kernel)
    lr_scaling: str = "none"  # none | linear | sqrt
    # batch at which `lr` was tuned (0: the run's own global batch)
    base_batch: int = setting(0, applies=_only("optim.lr_scaling", "linear", "sqrt"))
    warmup_steps: int = 10
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = setting(0.1, applies=_only("optim.decay", "cosine", "linear"))


@dataclass
class PrecisionConfig:
    name: str = MISSING  # fp32 | bf16 | fp16 | bf16_pure
    initial_scale: float = setting(65536.0, applies=FP16)  # fp16 dynamic loss scaling
    growth_interval: int = setting(1000, applies=FP16)
    min_scale: float = setting(1.0, applies=FP16)
    # Below the 16 bytes (docs/optim-precision.md; zerolab/master.py, zerolab/precision_modes.py). How the master
    # is held under bf16: fp32 (a copy, 4 bytes) | remainder (the bf16 weight plus the master's low 16 bits:
    # exact, 2 bytes) | bf16 (the bf16 weight is the master: lossy, 0 bytes); the update is computed in fp32
    master: str = setting("fp32", applies=BY_STRATEGY)
    # The optimizer's per-element state (Adam's moments, momentum): fp32 | bf16 (stored rounded: lossy)
    optim_states: str = setting("fp32", applies=BY_STRATEGY)
    # A ZeRO gradient shard between backward and the step, under bf16: fp32 | bf16 (16-bit sums under accumulation)
    grad_shard: str = setting("fp32", applies=BY_STRATEGY)
    # How bf16 weights are derived from an fp32 master: auto (nearest_away with master=remainder, else
    # nearest_even) | nearest_even (torch's cast) | nearest_away (ties away from zero, the remainder's rounding)
    weight_rounding: str = setting("auto", applies=BY_STRATEGY)


@dataclass
class TrainerConfig:
    max_steps: int = 100
    grad_accum_steps: int = 1
    seed: int = 1337
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 4
    log_every: int = 1
    nonfinite: str = setting("stop", applies=BY_STRATEGY)  # stop | skip (DeepSpeed decides non-finite steps itself)
    # A run that skipped more than this share of its steps (fp16 overflows, trainer.nonfinite=skip)
    # fails after writing summary.json; one that applied no update at all always fails. 1: only that.
    max_skipped_share: float = 0.5
    # The device's peak FLOP/s, for MFU (zerolab/profile/). 0: NVIDIA's data-sheet figure for a GPU
    # it knows, else one short matmul measured at start on every rank, in the run's compute dtype
    peak_flops: float = 0.0


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto (online with WANDB_API_KEY, else offline) | online | offline | disabled
    project: str = "zerolab"
    entity: str = ""


@dataclass
class LoggingConfig:
    progress: bool = True
    # per-layer update/weight ratios every N steps (0: never); zerolab's optimizers record them
    layer_stats_every: int = setting(0, applies=BY_STRATEGY)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0  # a collective waiting longer than this ends the job
    # Ranks per node (the node x local mesh, zerolab.dist.Topology). 0: the launcher's (torchrun's
    # LOCAL_WORLD_SIZE, Slurm's tasks per node), else every rank on one node. Set it to lay out
    # nodes on one machine: 4 ranks as 2 nodes x 2 (docs/launch.md); it must divide the world size.
    ranks_per_node: int = 0


@dataclass
class RunConfig:
    dir: str = ""  # empty: rank 0 creates <root>/<experiment>/<time>-<strategy> and shares it
    root: str = "runs"
    save_model: bool = True
    # A fresh start in a run.dir that holds a run's record (metrics, results, checkpoints) is
    # refused (zerolab/run/record.py); true removes that record first, naming what it removes.
    overwrite: bool = False


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N optimizer steps (0: never)
    keep_last: int = 2
    dir: str = ""  # empty: <run dir>/checkpoints
    resume: str = ""  # "" (fresh start) | auto (newest good checkpoint, if any) | PATH


@dataclass
class FaultConfig:
    """Deliberate failures, for testing recovery paths. All off by default. Steps count from 1,
    as metrics.jsonl and profile.steps do: step N is the one whose record says "step": N."""
    kill_rank: int = -1  # rank that fails ...
    at_step: int = -1  # ... when it reaches this step (1-based; -1: never)
    mode: str = "exit"  # exit (os._exit) | raise | hang (before at_step) | stop (SIGSTOP inside at_step)
    # mode=stop: forward | backward | optimizer. mode=exit with phase=record_cut: rank 0 exits
    # while a resume cuts metrics.jsonl back (between writing the kept prefix and its rename)
    phase: str = "backward"
    inf_grad_step: int = -1  # put an inf into one gradient in this step (1-based; loss-scaling tests)
    inf_grad_rank: int = 0
    # A straggler: rank slow_rank spends slow_ms ms of host time inside step at_step (1-based),
    # before its first forward; counted in that step's time (profile.steps shows where it lands)
    slow_rank: int = -1
    slow_ms: float = 0.0
    # A slow checkpoint directory: every rank spends this many seconds more in each checkpoint save,
    # before it writes (a test and rehearsal hook for the stop's time budget; every attempt)
    slow_save_s: float = 0.0


@dataclass
class ProfileConfig:
    """Where the step goes (zerolab/profile/, docs/profile.md). Off by default, and off costs nothing."""
    # 1-based optimizer steps (as in metrics.jsonl) to split into compute, optimizer, exposed
    # communication and other on every rank; each is logged. Empty: no profiling
    steps: List[int] = field(default_factory=list)
    # also every `every` steps after the last of `steps`, to the end of the run (0: only `steps`):
    # steps=[4] every=2 profiles 4, 6, 8, ...; each follows a step that is neither logged nor
    # profiled, as most steps of a long run do (docs/profile.md)
    every: int = 0
    # also a Chrome trace per rank of each run of consecutive profiled steps:
    # <run dir>/traces/steps<first>-<last>-rank<r>.json.gz (gzip JSON, opens in Perfetto)
    trace: bool = False


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: StrategyConfig = MISSING
    optim: OptimConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    experiment: str = "default"


def register_configs() -> None:
    ConfigStore.instance().store(name="zerolab_schema", node=Config)


register_configs()

MODEL_KINDS = ("gpt", "mlp", "hf", "custom")
DATA_KINDS = ("text", "synthetic")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum", "lamb", "lars")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_pure")
LR_SCALING = ("none", "linear", "sqrt")
DECAYS = ("cosine", "linear", "constant")
WANDB_MODES = ("auto", "online", "offline", "disabled")
FAULT_MODES = ("exit", "raise", "hang", "stop")
FAULT_PHASES = ("forward", "backward", "optimizer")  # fault.mode=stop
RECORD_CUT = "record_cut"  # fault.mode=exit: inside the resume's cut of metrics.jsonl (zerolab.run.record)


def _choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; allowed values: {', '.join(map(str, allowed))}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")



def world_size_from_env() -> int:
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def applies_rules(cls=Config, prefix: str = "") -> dict[str, Any]:
    """Every dotted key declared with `setting(..., applies=...)` -> its rule; every key of the
    strategy section but its name is the chosen strategy's to read (BY_STRATEGY)."""
    rules, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rules.update(applies_rules(hints[f.name], prefix + f.name + "."))
        elif cls is StrategyConfig and f.name != "name":
            rules[prefix + f.name] = BY_STRATEGY
        elif f.metadata.get("applies") is not None:
            rules[prefix + f.name] = f.metadata["applies"]
    return rules


def default_of(key: str) -> Any:
    """The schema's default of a dotted key."""
    cls, parts = Config, key.split(".")
    for part in parts[:-1]:
        cls = typing.get_type_hints(cls)[part]
    f = next(f for f in dataclasses.fields(cls) if f.name == parts[-1])
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def value_of(cfg, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def global_batch(cfg: Config, world_size: int) -> int:
    return cfg.data.micro_batch * cfg.trainer.grad_accum_steps * world_size


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
