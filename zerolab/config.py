"""A run's configuration, checked: `validate` turns a composed config into a `Config` or raises
ConfigError naming the key, the bad value and what would be accepted; `compose` composes one
outside @hydra.main (tests, tools). The schema itself is zerolab/schema.py (its keys:
zerolab/schema_keys.py); what other modules import from here is listed in __all__.

Every value check is here, run before any process group exists (train.py turns a failure into
exit code 2, said once): the ranges and choices types cannot express, divisibility, and what the
chosen strategy cannot honour (its class's `check_config`, found through the registry). Then one
warning for each setting set away from its default that has no effect for the chosen strategy,
optimizer, precision or model, as its schema field declares (schema.setting's `applies`).
"""
from __future__ import annotations

import logging
import re
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from zerolab.errors import ConfigError, launch_rank
from zerolab.precision_modes import check_precision_modes
from zerolab.schema import (BY_STRATEGY, DATA_KINDS, DECAYS, FAULT_MODES, FAULT_PHASES, LR_SCALING, MODEL_KINDS,
                            OPTIMIZERS, PRECISIONS, RECORD_CUT, WANDB_MODES, Config, DataConfig, DistConfig,
                            FaultConfig, LoggingConfig, ModelConfig, OptimConfig, PrecisionConfig, _choice, _positive,
                            applies_rules, default_of, global_batch, value_of, world_size_from_env)
from zerolab.schema_keys import CONF_DIR, check_keys, check_overrides, config_groups, free_dicts_merge, suggest
from zerolab.strategies import REGISTRY, strategy_class
from zerolab.topology import Topology

log = logging.getLogger("zerolab")

def validate(cfg: DictConfig | Config, world_size: Optional[int] = None) -> Config:
    """Turn a composed config into a checked `Config` object, or raise ConfigError."""
    if isinstance(cfg, DictConfig):
        check_keys(cfg)
        cfg = OmegaConf.to_object(cfg)
    world = world_size if world_size is not None else world_size_from_env()
    _check_model(cfg.model)
    _check_data(cfg)
    _check_optim(cfg.optim)
    _check_trainer(cfg)
    _check_run(cfg, world)
    if cfg.dist.ranks_per_node:
        Topology(world, cfg.dist.ranks_per_node)  # ConfigError naming a divisor unless it divides the world
    _check_profile(cfg, world)
    _choice("strategy.name", cfg.strategy.name, sorted(REGISTRY))
    _positive("strategy.bucket_mb", cfg.strategy.bucket_mb)
    _choice("strategy.reduce_dtype", cfg.strategy.reduce_dtype, ("auto", "fp32"))
    strategy = strategy_class(cfg.strategy.name)
    strategy.check_config(cfg, world)  # what this strategy cannot honour
    _check_offload_is_read(cfg, strategy)
    if (cfg.model.activation_checkpointing == "selective" and cfg.strategy.name == "deepspeed"
            and getattr(cfg.strategy, "stage", 0) == 3):
        # DeepSpeed stage 3 replaces every Linear by its own (memory_efficient_linear), which adds the
        # bias in place into the matmul's output: the very tensor selective checkpointing keeps,
        # unseen by its mutation check (the add goes through a view with its own version counter),
        # so the recomputation would add the bias twice.
        raise ConfigError("model.activation_checkpointing=selective under strategy=deepspeed strategy.stage=3: "
                          "DeepSpeed's stage-3 Linear adds the bias in place into the matmul output that selective "
                          "checkpointing keeps, which would corrupt the recomputation; use "
                          "model.activation_checkpointing=blocks, or stage 2 or another parameter-sharding "
                          "strategy (zero3, fsdp)")
    check_precision_modes(cfg, strategy, {n: strategy_class(n) for n in REGISTRY})  # precision.master, ...
    warn_unused_settings(cfg, strategy)
    return cfg


def _check_offload_is_read(cfg: Config, strategy) -> None:
    """Offload set for a strategy that has none is refused, not warned about: the job was sized on
    the memory it would have moved to the host, so it would run out where the user expects room."""
    for key in ("offload_optimizer", "offload_params"):
        if getattr(cfg.strategy, key, False) and not strategy.reads(f"strategy.{key}", cfg):
            able = sorted(n for n in REGISTRY if strategy_class(n).reads(f"strategy.{key}", cfg))
            raise ConfigError(f"strategy.{key}=true under strategy={cfg.strategy.name}: it has no offload, so the "
                              "states would stay on the device the job was sized without. Use a strategy that "
                              f"offloads ({', '.join(able)}; docs/offload.md), or strategy.{key}=false")


def _check_model(m: ModelConfig) -> None:
    _choice("model.kind", m.kind, MODEL_KINDS)
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_hidden", "mlp_depth"):
        _positive(f"model.{key}", getattr(m, key))
    if m.kind == "gpt" and m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    _choice("model.activation_checkpointing", m.activation_checkpointing, ("none", "blocks", "every_k", "selective"))
    _positive("model.checkpoint_every_k", m.checkpoint_every_k)
    if m.kind == "mlp" and m.activation_checkpointing != "none":
        raise ConfigError(f"model.activation_checkpointing={m.activation_checkpointing} recomputes a model's repeated "
                          "blocks (among zerolab's own models: GPT blocks only); model.kind=mlp has none: use "
                          "model.activation_checkpointing=none")
    # The user's models (docs/models.md); what needs their files or code is checked before any rank
    # trains (zerolab.models.preflight, from zerolab/job.py and launch/run_dir.py).
    if m.kind == "hf" and not m.config:
        from zerolab.models.sources import shipped_shapes

        raise ConfigError("model=hf needs model.config=PATH: a config.json, a saved model's directory, a hub id "
                          "in the local Hugging Face cache, or the name of a shape zerolab ships: "
                          f"{', '.join(shipped_shapes())}")
    if m.kind == "custom" and not re.fullmatch(r"[\w.]+:[\w.]+", m.target):
        raise ConfigError(f"model=custom needs model.target=pkg.module:Name (a class or factory of an nn.Module on "
                          f"the Python path), got {m.target!r}")
    if m.blocks and not re.fullmatch(r"\w+(\.\w+)*", m.blocks):
        raise ConfigError(f"model.blocks={m.blocks!r} must be a dotted module path such as model.layers")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _choice("data.kind", d.kind, DATA_KINDS)
    _positive("data.micro_batch", d.micro_batch)
    if not 0.0 < d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")


def _check_optim(o: OptimConfig) -> None:
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("optim.lr_scaling", o.lr_scaling, LR_SCALING)
    _choice("optim.decay", o.decay, DECAYS)
    _choice("optim.impl", o.impl, ("auto", "foreach", "for_loop"))
    _positive("optim.lr", o.lr)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")


def _check_trainer(cfg: Config) -> None:
    t = cfg.trainer
    _choice("precision.name", cfg.precision.name, PRECISIONS)
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
    _positive("dist.ranks_per_node", cfg.dist.ranks_per_node, allow_zero=True)


def _check_run(cfg: Config, world: int) -> None:
    """The run directory, checkpoints, the global batch and deliberate faults, for `world` ranks."""
    d, t, f = cfg.data, cfg.trainer, cfg.fault
    if cfg.run.overwrite and cfg.checkpoint.resume:
        raise ConfigError(f"run.overwrite=true removes the run directory's record, checkpoints included, and "
                          f"checkpoint.resume={cfg.checkpoint.resume} asks to continue from it: choose one")
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    if d.global_batch:
        per_step = d.micro_batch * world
        if d.global_batch % per_step:
            raise ConfigError(
                f"data.global_batch={d.global_batch} is not divisible by data.micro_batch × world size "
                f"= {d.micro_batch} × {world} = {per_step}; pick a multiple of {per_step} "
                f"(e.g. {per_step * max(1, d.global_batch // per_step)}) or change data.micro_batch")
        t.grad_accum_steps = d.global_batch // per_step
    _choice("fault.mode", f.mode, FAULT_MODES)
    for key, step in (("fault.at_step", f.at_step), ("fault.inf_grad_step", f.inf_grad_step)):
        if step == 0 or step < -1:
            raise ConfigError(f"{key}={step}: steps count from 1, as in metrics.jsonl (step N is the N-th optimizer "
                              f"step, whose record says \"step\": N); give 1 or more, or -1 for none")
    if f.kill_rank >= world:
        raise ConfigError(f"fault.kill_rank={f.kill_rank} but the job has {world} ranks")
    if f.mode == "stop":
        _choice("fault.phase", f.phase, FAULT_PHASES)
    if f.phase == RECORD_CUT and f.mode != "exit":
        raise ConfigError(f"fault.phase={RECORD_CUT} goes with fault.mode=exit (got fault.mode={f.mode})")
    _positive("fault.slow_save_s", f.slow_save_s, allow_zero=True)


def _check_profile(cfg: Config, world: int) -> None:
    """profile.steps, the peak for MFU and the straggler fault (zerolab/profile/)."""
    p, t, f = cfg.profile, cfg.trainer, cfg.fault
    _positive("profile.every", p.every, allow_zero=True)
    if p.every and not p.steps:
        raise ConfigError(f"profile.every={p.every} repeats after the last of profile.steps, and profile.steps is "
                          "empty: name the first, e.g. profile.steps=[4] profile.every=2")
    outside = [s for s in p.steps if not 1 <= s <= t.max_steps]
    if outside:
        raise ConfigError(f"profile.steps={list(p.steps)}: {outside} not in 1..trainer.max_steps={t.max_steps} "
                          "(optimizer steps, counted from 1 as in metrics.jsonl)")
    if len(set(p.steps)) != len(p.steps):
        raise ConfigError(f"profile.steps={list(p.steps)} names a step twice")
    if p.trace and not p.steps:
        raise ConfigError("profile.trace=true traces the profiled steps, and profile.steps is empty: "
                          "name them too, e.g. profile.steps=[5,6]")
    _positive("trainer.peak_flops", t.peak_flops, allow_zero=True)
    _positive("fault.slow_ms", f.slow_ms, allow_zero=True)
    if f.slow_rank >= world:
        raise ConfigError(f"fault.slow_rank={f.slow_rank} but the job has {world} ranks")
    if (f.slow_rank >= 0) != (f.slow_ms > 0) or (f.slow_rank >= 0 and f.at_step < 0):
        raise ConfigError(f"a slow rank needs all of fault.slow_rank=R, fault.slow_ms=M > 0 and fault.at_step=N "
                          f"(counted from 1, as profile.steps; got slow_rank={f.slow_rank}, slow_ms={f.slow_ms:g}, "
                          f"at_step={f.at_step})")


# ---- settings that have no effect -------------------------------------------------------------
_warned: set = set()  # (key, value, what decided) already warned about in this process


def unused_settings(cfg: Config, strategy) -> list[tuple[str, object, str]]:
    """(key, value, why it has no effect) of every setting whose value differs from its schema
    default (so someone set it: the command line, a config group or an experiment) while its
    field's `applies` rule says it has no effect for this config: torchtitan's rule, a set value
    that has no effect is worth a warning. A value equal to the default is no sign that anyone set
    it, and changes nothing either way."""
    found = []
    for key, rule in applies_rules().items():
        value = value_of(cfg, key)
        if value == default_of(key):
            continue
        if rule == BY_STRATEGY:
            if not strategy.reads(key, cfg):
                found.append((key, value, f"under strategy={cfg.strategy.name} (it does not read this setting)"))
        else:
            on, values = rule
            if value_of(cfg, on) not in values:
                found.append((key, value, f"with {on}={value_of(cfg, on)} (it applies with {on} in "
                                          f"{', '.join(values)})"))
    return found


def warn_unused_settings(cfg: Config, strategy) -> list[str]:
    """One warning per setting that has no effect (unused_settings), from the first process of a
    job only (RANK 0 or unset), and once per process however often the config is validated.
    Returns the messages logged."""
    if launch_rank() != 0:
        return []
    said = []
    for key, value, why in unused_settings(cfg, strategy):
        seen = (key, repr(value), why)
        if seen in _warned:
            continue
        _warned.add(seen)
        msg = (f"{key}={value!r} has no effect {why}; default {default_of(key)!r}: remove it, or change what it "
               "depends on")
        log.warning(msg)
        said.append(msg)
    return said


def compose(overrides: List[str] = (), config_dir: Optional[str] = None, world_size: Optional[int] = None) -> Config:
    """Compose and validate a config outside @hydra.main (tests, benchmarks, CLI tools), for
    `world_size` ranks (default: the launcher's WORLD_SIZE, else 1)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = config_dir or CONF_DIR
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        dcfg = hydra_compose(config_name="config", overrides=free_dicts_merge(overrides))
    return validate(dcfg, world_size)


# What the rest of zerolab and the tests import from here (the schema's names, checked).
__all__ = ["Config", "ConfigError", "DataConfig", "DistConfig", "FaultConfig", "LoggingConfig", "ModelConfig",
           "OPTIMIZERS", "OptimConfig", "PrecisionConfig", "check_overrides", "compose", "config_groups",
           "free_dicts_merge", "global_batch", "suggest", "validate"]
