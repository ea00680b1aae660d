"""Typed configuration: dataclasses registered in Hydra's ConfigStore, plus validation.

Hydra already rejects wrongly typed values, and unknown keys given without `+`, because every
group merges into one of these dataclasses. The schema is closed: `check_keys` refuses a key
that is not a field of these dataclasses however it got in (`+key=...` adds keys to a struct
config), and `check_overrides` refuses one on the command line before Hydra runs, so the
message can suggest the nearest valid key instead of Hydra's advice to append it with `+`.
`validate` adds the checks types cannot express (allowed names, ranges, divisibility) and raises
ConfigError with the key, the bad value and what would be accepted. train.py turns every such
failure into exit code 2, before any process group exists.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from zerolab.errors import ConfigError  # noqa: F401  (raised here, imported from here by many)
from zerolab.strategies.settings import StrategyConfig, check_strategy_settings  # strategy.*: the strategies' own schema


log = logging.getLogger("zerolab")


@dataclass
class ModelConfig:
    name: str = MISSING  # label used in logs, e.g. gpt_tiny
    kind: str = "gpt"  # gpt | mlp
    vocab_size: int = 256
    block_size: int = 64
    # gpt
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    bias: bool = True
    dropout: float = 0.0
    # Activation checkpointing of GPT blocks (torch's non-reentrant checkpoint, RNG preserved):
    # none | blocks (every block) | every_k (blocks 0, k, 2k, ...: one block in k recomputes)
    activation_checkpointing: str = "none"
    checkpoint_every_k: int = 2
    # mlp: embedding -> `mlp_depth` hidden layers of width `mlp_hidden` -> logits
    mlp_hidden: int = 128
    mlp_depth: int = 2


@dataclass
class DataConfig:
    kind: str = "text"  # text | synthetic
    # Token file from `python -m zerolab data prepare`. Empty: the embedded corpus (the running
    # interpreter's standard-library sources), prepared once into `cache_dir`.
    path: str = ""
    cache_dir: str = "${oc.env:ZEROLAB_CACHE,${oc.env:HOME}/.cache/zerolab}"
    val_fraction: float = 0.05
    micro_batch: int = 8  # sequences per rank per micro-batch
    # 0: derived as micro_batch * grad_accum_steps * world_size. Set it to fix the global batch
    # and let zerolab derive grad_accum_steps (must divide exactly).
    global_batch: int = 0


@dataclass
class OptimConfig:
    name: str = MISSING  # adamw | adam | sgd | sgd_momentum | lamb | lars
    lr: float = 1e-3  # peak lr at base_batch (scaled by lr_scaling for the actual batch)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9
    trust_coefficient: float = 0.001
    max_trust_ratio: Optional[float] = None
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    impl: str = "auto"  # zerolab optimizer kernel: auto (fused AdamW/Adam/SGD on CPU fp32, else foreach) | foreach | for_loop
    lr_scaling: str = "none"  # none | linear | sqrt
    base_batch: int = 0  # batch at which `lr` was tuned (0: the run's own global batch)
    warmup_steps: int = 10
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1


@dataclass
class PrecisionConfig:
    name: str = MISSING  # fp32 | bf16 | fp16 | bf16_pure
    initial_scale: float = 65536.0  # fp16 dynamic loss scaling
    growth_interval: int = 1000
    min_scale: float = 1.0


@dataclass
class TrainerConfig:
    max_steps: int = 100
    grad_accum_steps: int = 1
    seed: int = 1337
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 4
    log_every: int = 1
    nonfinite: str = "stop"  # stop | skip
    # A run that skipped more than this share of its steps (fp16 overflows, trainer.nonfinite=skip)
    # fails after writing summary.json; one that applied no update at all always fails. 1: only that.
    max_skipped_share: float = 0.5


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto (online with WANDB_API_KEY, else offline) | online | offline | disabled
    project: str = "zerolab"
    entity: str = ""


@dataclass
class LoggingConfig:
    progress: bool = True
    layer_stats_every: int = 0  # per-layer update/weight ratios every N steps (0: never)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0  # a collective waiting longer than this ends the job


@dataclass
class RunConfig:
    dir: str = ""  # empty: rank 0 creates <root>/<experiment>/<time>-<strategy> and shares it
    root: str = "runs"
    save_model: bool = True
    # A fresh start in a run.dir that holds a run's record (metrics, results, checkpoints) is
    # refused (zerolab/record.py); true removes that record first, naming what it removes.
    overwrite: bool = False


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N optimizer steps (0: never)
    keep_last: int = 2
    dir: str = ""  # empty: <run dir>/checkpoints
    resume: str = ""  # "" (fresh start) | auto (newest good checkpoint, if any) | PATH


@dataclass
class FaultConfig:
    """Deliberate failures, for testing recovery paths. All off by default."""
    kill_rank: int = -1  # rank that fails ...
    at_step: int = -1  # ... when it reaches this step
    mode: str = "exit"  # exit (os._exit) | raise | hang (before at_step) | stop (SIGSTOP inside at_step)
    # mode=stop: forward | backward | optimizer. mode=exit with phase=record_cut: rank 0 exits
    # while a resume cuts metrics.jsonl back (between writing the kept prefix and its rename)
    phase: str = "backward"
    inf_grad_step: int = -1  # put an inf into one gradient at this step (loss-scaling tests)
    inf_grad_rank: int = 0


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
    experiment: str = "default"


def register_configs() -> None:
    ConfigStore.instance().store(name="zerolab_schema", node=Config)


register_configs()

MODEL_KINDS = ("gpt", "mlp")
DATA_KINDS = ("text", "synthetic")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum", "lamb", "lars")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_pure")
LR_SCALING = ("none", "linear", "sqrt")
DECAYS = ("cosine", "linear", "constant")
WANDB_MODES = ("auto", "online", "offline", "disabled")


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


# ---- the closed schema -----------------------------------------------------------------------
def _schema(cls=Config, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema -> its dataclass (a section), FREE (a free-form dict such as
    strategy.ds_config_overrides, whose keys are DeepSpeed's) or None (a value)."""
    keys: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, kind = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys[key] = kind
            keys.update(_schema(kind, key + "."))
        else:
            keys[key] = FREE if typing.get_origin(kind) in (dict, Dict) else None
    return keys


FREE = "free-form"
SCHEMA_KEYS = _schema()
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def suggest(key: str) -> str:
    """'did you mean X?' for the valid key nearest to `key`, else what its section holds."""
    values = [k for k, kind in SCHEMA_KEYS.items() if not isinstance(kind, type)]
    name = key.rsplit(".", 1)[-1]
    same_name = [k for k in values if k.rsplit(".", 1)[-1] == name]  # right key, wrong section
    close = same_name or difflib.get_close_matches(key, values if "." in key else list(SCHEMA_KEYS), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    section = key.rsplit(".", 1)[0] if "." in key else ""
    if section in SCHEMA_KEYS and not isinstance(SCHEMA_KEYS[section], type):
        return f"{section} is a value, with no keys below it."
    if section in SCHEMA_KEYS:
        names = [k[len(section) + 1:] for k in SCHEMA_KEYS if k.startswith(section + ".") and k.count(".") == key.count(".")]
        return f"{section} has: {', '.join(names)}."
    return f"the top-level keys are: {', '.join(k for k in SCHEMA_KEYS if '.' not in k)}."


def _unknown(key: str, given: str = "") -> ConfigError:
    how = f" (given as {given})" if given else ""
    return ConfigError(f"Could not override '{key}'{how}: no such key; {suggest(key)} zerolab's schema is "
                       f"closed (zerolab/config.py): `+` cannot add keys either (only below "
                       f"strategy.ds_config_overrides, which takes DeepSpeed's keys).")


def _known(key: str) -> bool:
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        kind = SCHEMA_KEYS.get(".".join(parts[:i]), "unknown")
        if kind == FREE:
            return True  # anything below a free-form dict
        if kind == "unknown" or (kind is None and i < len(parts)):
            return False
    return True


def config_groups(config_dir: str = CONF_DIR) -> dict[str, list[str]]:
    """The config groups of conf/ (model, strategy, ...) and their options (the yaml files)."""
    return {d: sorted(f[:-5] for f in os.listdir(os.path.join(config_dir, d)) if f.endswith(".yaml"))
            for d in sorted(os.listdir(config_dir)) if os.path.isdir(os.path.join(config_dir, d))}


def check_overrides(overrides: Iterable[str], groups: "dict[str, list[str]] | Iterable[str]" = ()) -> None:
    """Refuse command-line overrides of keys the schema lacks, with or without `+`/`++`/`~`, and
    options a config group does not have (`strategy=nonexistent`), each in one line, before Hydra
    composes anything. `groups`: top-level config group names that are not keys (e.g. `launcher`),
    or {group: options} to check the options too (config_groups()); `hydra.*` and `group/option`
    overrides are Hydra's business and pass through."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    options = groups if isinstance(groups, dict) else {}
    parser = OverridesParser.create()
    for arg in overrides:
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # not an override Hydra can parse: Hydra reports it
            continue
        key = override.key_or_group
        if override.package is not None or "/" in key or key.split(".")[0] == "hydra":
            continue
        if "." not in key and key in groups:
            if key in options and not override.is_delete() and not isinstance(override.value(), Glob):
                given = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                         else [override.get_value_element_as_str()])
                for value in given:
                    if value not in options[key] and value != "null":
                        raise ConfigError(f"{key}={value}: no such option of config group {key}; choose one of "
                                          f"{', '.join(options[key])} (conf/{key}/*.yaml)")
            continue
        if not _known(key):
            raise _unknown(key, arg)


def check_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse keys of a composed config that its schema lacks (added with `+key=...`)."""
    for name in cfg.keys():
        key = prefix + str(name)
        if key not in SCHEMA_KEYS:
            raise _unknown(key)
        node = cfg._get_node(name)
        if isinstance(SCHEMA_KEYS[key], type) and isinstance(node, DictConfig) and not node._is_missing() \
                and not node._is_none():
            check_keys(node, key + ".")


def validate(cfg: DictConfig | Config, world_size: Optional[int] = None) -> Config:
    """Turn a composed config into a checked `Config` object, or raise ConfigError."""
    from zerolab.strategies import REGISTRY  # lazy: keeps import of config cheap

    if isinstance(cfg, DictConfig):
        check_keys(cfg)
        cfg = OmegaConf.to_object(cfg)
    world = world_size if world_size is not None else world_size_from_env()
    m, d, s, o, p, t = cfg.model, cfg.data, cfg.strategy, cfg.optim, cfg.precision, cfg.trainer
    _choice("model.kind", m.kind, MODEL_KINDS)
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_hidden", "mlp_depth"):
        _positive(f"model.{key}", getattr(m, key))
    if m.kind == "gpt" and m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    _choice("model.activation_checkpointing", m.activation_checkpointing, ("none", "blocks", "every_k"))
    _positive("model.checkpoint_every_k", m.checkpoint_every_k)
    if m.kind != "gpt" and m.activation_checkpointing != "none":
        raise ConfigError(f"model.activation_checkpointing={m.activation_checkpointing} applies to GPT blocks only; "
                          f"model.kind={m.kind} has none: use model.activation_checkpointing=none")
    _choice("data.kind", d.kind, DATA_KINDS)
    if d.kind == "text" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for byte-level text data; use >= 256")
    _positive("data.micro_batch", d.micro_batch)
    if not 0.0 < d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")
    _choice("strategy.name", s.name, sorted(REGISTRY))
    check_strategy_settings(s)
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("optim.lr_scaling", o.lr_scaling, LR_SCALING)
    _choice("optim.decay", o.decay, DECAYS)
    _choice("optim.impl", o.impl, ("auto", "foreach", "for_loop"))
    _positive("optim.lr", o.lr)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    _choice("precision.name", p.name, PRECISIONS)
    _positive("trainer.max_steps", t.max_steps)
    _positive("trainer.grad_accum_steps", t.grad_accum_steps)
    _positive("trainer.log_every", t.log_every)
    _positive("trainer.eval_every", t.eval_every, allow_zero=True)
    _positive("trainer.eval_batches", t.eval_batches)
    _choice("trainer.nonfinite", t.nonfinite, ("stop", "skip"))
    if not 0.0 <= t.max_skipped_share <= 1.0:
        raise ConfigError(f"trainer.max_skipped_share={t.max_skipped_share} must be in [0, 1] (a share of the "
                          "run's steps; 1 fails only a run that applied no update at all)")
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    _choice("dist.backend", cfg.dist.backend, ("auto", "nccl", "gloo"))
    _choice("dist.device", cfg.dist.device, ("auto", "cpu", "cuda"))
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    if cfg.run.overwrite and cfg.checkpoint.resume:
        raise ConfigError(f"run.overwrite=true removes the run directory's record, checkpoints included, and "
                          f"checkpoint.resume={cfg.checkpoint.resume} asks to continue from it: choose one")
    if d.global_batch:
        per_step = d.micro_batch * world
        if d.global_batch % per_step:
            raise ConfigError(
                f"data.global_batch={d.global_batch} is not divisible by data.micro_batch × world size "
                f"= {d.micro_batch} × {world} = {per_step}; pick a multiple of {per_step} "
                f"(e.g. {per_step * max(1, d.global_batch // per_step)}) or change data.micro_batch")
        t.grad_accum_steps = d.global_batch // per_step
    warn_unused_settings(cfg)
    return cfg


_warned: set = set()  # (strategy, key, value) already warned about in this process


def warn_unused_settings(cfg: Config) -> list[str]:
    """One warning per setting that has no effect under the chosen strategy (see
    zerolab.strategies.unused_settings), from the first process of a job only (RANK 0 or unset),
    and once per process however often the config is validated. Returns the messages logged."""
    from zerolab.strategies import unused_settings

    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return []
    said = []
    for key, value, default in unused_settings(cfg):
        seen = (cfg.strategy.name, key, repr(value))
        if seen in _warned:
            continue
        _warned.add(seen)
        msg = (f"{key}={value!r} has no effect under strategy={cfg.strategy.name} (it does not read this "
               f"setting; default {default!r}); remove it, or pick a strategy that uses it")
        log.warning(msg)
        said.append(msg)
    return said


def global_batch(cfg: Config, world_size: int) -> int:
    return cfg.data.micro_batch * cfg.trainer.grad_accum_steps * world_size


def compose(overrides: List[str] = (), config_dir: Optional[str] = None) -> Config:
    """Compose and validate a config outside @hydra.main (tests, benchmarks, CLI tools)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = config_dir or CONF_DIR
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        dcfg = hydra_compose(config_name="config", overrides=list(overrides))
    return validate(dcfg)


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
