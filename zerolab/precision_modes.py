"""Below the ZeRO paper's 16 bytes: which master and state modes apply where, what each holds per
parameter, and how a run in a lossy mode is held against an fp32-master run.

The settings (zerolab/schema.py's PrecisionConfig; docs/optim-precision.md):
  precision.master        fp32 (a copy: 4 bytes) | remainder (the bf16 weight plus the master's low
                          16 bits: exact, 2 bytes; zerolab/master.py) | bf16 (the weight is the
                          master: 0 bytes, lossy: every update is rounded to bf16)
  precision.optim_states  fp32 | bf16 (Adam's moments, a momentum buffer stored rounded: lossy)
  precision.grad_shard    fp32 | bf16 (zero1/zero2's gradient shard; lossless without accumulation
                          when the reduction is bf16 already, 16-bit sums with it)
  precision.weight_rounding  auto | nearest_even | nearest_away (how the bf16 weights follow an
                          fp32 master; remainders need nearest_away, auto picks it)
The optimizer computes in fp32 in every mode (zerolab/optim/stored.py).

Bytes per parameter (bf16 weights and gradients, Adam's 2 states, N ranks; zerolab's sharder keeps
an fp32 gradient shard unless precision.grad_shard=bf16, zero3 keeps it in the reduce dtype):
  stage  today (fp32 master)   remainder            remainder + bf16 grad shard
  ddp    16                    14                   -
  zero1  4 + 16/N              4 + 14/N             4 + 10/N
  zero2  2 + 16/N              2 + 14/N             2 + 12/N
  zero3  16/N                  14/N                 -
(model_state_bytes below, for every combination; the paper's own figure is 4 + 12/N, 2 + 14/N and
16/N: zerolab's zero1/zero2 add their fp32 gradient shard.)
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.errors import ConfigError

MASTERS = ("fp32", "remainder", "bf16")
OPTIM_STATES = ("fp32", "bf16")
GRAD_SHARDS = ("fp32", "bf16")
WEIGHT_ROUNDINGS = ("auto", "nearest_even", "nearest_away")
MODE_KEYS = ("precision.master", "precision.optim_states", "precision.grad_shard", "precision.weight_rounding")
MASTER_BYTES = {"fp32": 4, "remainder": 2, "bf16": 0}  # per element of what the optimizer updates


@dataclass(frozen=True)
class Mode:
    """One combination of the settings above (the defaults: today's fp32 master and state)."""
    master: str = "fp32"
    optim_states: str = "fp32"
    grad_shard: str = "fp32"

    @classmethod
    def of(cls, precision) -> "Mode":
        """From a PrecisionConfig, or a run's config section as a dict."""
        get = precision.get if isinstance(precision, dict) else lambda k, d: getattr(precision, k, d)
        return cls(get("master", "fp32"), get("optim_states", "fp32"), get("grad_shard", "fp32"))

    @property
    def lossy(self) -> list[str]:
        """The settings of this mode that change the training whatever the job (the remainder does
        not; a bf16 gradient shard changes it only where micro-batches are summed in it: lossy_settings)."""
        return [f"precision.{k}=bf16" for k in ("master", "optim_states") if getattr(self, k) == "bf16"]

    @property
    def keys(self) -> list[str]:
        """The settings this mode sets away from their defaults."""
        return [f"precision.{k}" for k in ("master", "optim_states", "grad_shard") if getattr(self, k) != "fp32"]

    @property
    def label(self) -> str:
        parts = [f"master {self.master}"] if self.master != "fp32" else []
        parts += ["bf16 states"] if self.optim_states == "bf16" else []
        parts += ["bf16 grad shard"] if self.grad_shard == "bf16" else []
        return ", ".join(parts) or "fp32 master"


# ---- what applies where: refused before training, with the fix -------------------------------------
def _set(cfg) -> dict[str, str]:
    p = cfg.precision
    out = {"precision.master": p.master, "precision.optim_states": p.optim_states,
           "precision.grad_shard": p.grad_shard, "precision.weight_rounding": p.weight_rounding}
    return {k: v for k, v in out.items() if v != ("auto" if k.endswith("rounding") else "fp32")}


def _check_values(p) -> None:
    for key, value, allowed in (("master", p.master, MASTERS), ("optim_states", p.optim_states, OPTIM_STATES),
                                ("grad_shard", p.grad_shard, GRAD_SHARDS),
                                ("weight_rounding", p.weight_rounding, WEIGHT_ROUNDINGS)):
        if value not in allowed:
            raise ConfigError(f"precision.{key}={value!r} is not valid; allowed values: {', '.join(allowed)}")


def _check_precision(p) -> None:
    """The modes that need a particular precision.name."""
    if p.master == "remainder" and p.name != "bf16":
        why = {"fp32": "the fp32 weights are the master already (nothing to split)",
               "fp16": "an fp16 weight is not the top half of an fp32 master (its exponent has 5 bits, not 8)",
               "bf16_pure": "bf16_pure keeps no master at all"}[p.name]
        raise ConfigError(f"precision.master=remainder keeps an fp32 master as its bf16 weight plus 16 bits, so it "
                          f"needs precision=bf16: under precision={p.name} {why}. Use precision=bf16, or "
                          "precision.master=fp32")
    if p.master == "bf16" and p.name != "bf16":
        why = {"fp32": "the master is the fp32 weights themselves; a bf16 master would round every update of a "
                       "run that computes in fp32",
               "fp16": "a bf16 master has 8 mantissa bits, fewer than the fp16 weights it would feed (11)",
               "bf16_pure": "bf16_pure already keeps no master (and computes its update in bf16)"}[p.name]
        raise ConfigError(f"precision.master=bf16 holds the master as the bf16 weight, so it needs precision=bf16: "
                          f"under precision={p.name} {why}. Use precision=bf16, or precision.master=fp32")
    if p.grad_shard == "bf16" and p.name != "bf16":
        raise ConfigError(f"precision.grad_shard=bf16 keeps a bf16 run's 16-bit gradient shard in bf16; under "
                          f"precision={p.name} the gradients are "
                          + ("fp16 and must be unscaled in fp32 (a 16-bit unscale underflows small gradients)"
                             if p.name == "fp16" else f"{'fp32' if p.name == 'fp32' else 'bf16 with no master'}")
                          + ". Use precision=bf16, or precision.grad_shard=fp32")
    if p.weight_rounding == "nearest_even" and p.master == "remainder":
        raise ConfigError("precision.weight_rounding=nearest_even cannot go with precision.master=remainder: a "
                          "16-bit remainder is exact only beside a weight rounded with ties away from zero "
                          "(zerolab/master.py counts why). Use precision.weight_rounding=auto or nearest_away")
    if p.weight_rounding != "auto" and p.name != "bf16":
        raise ConfigError(f"precision.weight_rounding={p.weight_rounding} chooses how bf16 weights follow an fp32 "
                          f"master; precision={p.name} has none. Use precision=bf16, or leave it auto")
    if p.optim_states == "bf16" and p.name == "bf16_pure":
        raise ConfigError("precision.optim_states=bf16 under precision=bf16_pure: bf16_pure keeps its state in bf16 "
                          "already. Leave precision.optim_states=fp32")


def check_precision_modes(cfg, strategy, registry: dict) -> None:
    """Raise ConfigError for a mode that does not apply: a value outside its list, a precision it
    does not go with, or a strategy that does not keep its master or state that way (`strategy`:
    the chosen strategy's class; a class that honours a mode lists the key in traits.also_reads).
    `registry`: name -> class of every strategy, to name those that do."""
    p = cfg.precision
    _check_values(p)
    _check_precision(p)
    for key, value in _set(cfg).items():
        if strategy.reads(key, cfg):
            continue
        able = [n for n, cls in registry.items() if cls.reads(key, cfg)]
        hint = ("; under strategy=deepspeed DeepSpeed's own settings do it: strategy.ds_config_overrides="
                "{bf16: {bf16_master_weights_and_grads: true, bf16_optimizer_states: true}}"
                if key in ("precision.master", "precision.optim_states") else "")
        raise ConfigError(f"{key}={value}: strategy={cfg.strategy.name} does not keep "
                          f"{'its master' if 'master' in key or 'rounding' in key else 'that state'} that way; "
                          f"{', '.join(able) if able else 'no strategy'} {'does' if len(able) == 1 else 'do'}"
                          f"{hint}. Use another strategy, or {key}={'auto' if 'rounding' in key else 'fp32'}")


# ---- bytes per parameter -------------------------------------------------------------------------------
def model_state_bytes(stage: int, world: int, mode: Mode = Mode(), k: float = 2, zerolab: bool = True,
                      reduce_fp32: bool = False) -> dict[str, float]:
    """Bytes per parameter on one rank by category (params, grads, master, optim_state) under bf16
    mixed precision, without padding: stage 0 is ddp. `zerolab`: zerolab's sharder (zero1/zero2
    keep their gradient shard in fp32 unless mode.grad_shard is bf16; zero3 keeps it in the
    reduce dtype, bf16 unless `reduce_fp32`); False: the paper's accounting (no gradient shard
    beyond its 16-bit share) with the mode's master and states."""
    N = world
    master, state = MASTER_BYTES[mode.master], k * (2 if mode.optim_states == "bf16" else 4)
    div = lambda at: N if stage >= at else 1  # from which stage a term is divided by N
    out = {"params": 2 / div(3), "grads": 2 / div(2), "master": master / div(1), "optim_state": state / div(1)}
    if zerolab and stage in (1, 2):
        shard = 2 if mode.grad_shard == "bf16" else 4
        # zero1's bf16 shard is its chunk of the whole bf16 gradients: no bytes of its own
        out["grads"] += (0 if stage == 1 and shard == 2 else shard / N) - (2 / N if stage == 2 else 0)
    if zerolab and stage == 3 and reduce_fp32:
        out["grads"] = 4 / N
    return out


def working_bytes_per_element(mode: Mode, k: float) -> float:
    """An upper bound, per element of the piece being updated, on the fp32 working copies the
    optimizer step over a stored master or state holds at once (zerolab/optim/stored.py's
    _working_bytes): the rebuilt master (4), upcast states (4 per state element), the remainder
    split's int16 and flag temporaries (3), and the snapshot a logged step compares against (4).
    0 where nothing is stored otherwise than in fp32."""
    if mode.master == "fp32" and mode.optim_states == "fp32":
        return 0
    return (4 if mode.master != "fp32" else 0) + (4 * k if mode.optim_states == "bf16" else 0) \
        + (3 if mode.master == "remainder" else 0) + 4


def master_term(p, n: int, mode: Mode, what: str, place: str = "device") -> None:
    """The ledger's `master` term of `n` elements under bf16 mixed precision, as `mode` holds it
    (`place`: where an fp32 master lives; offload keeps it on the host)."""
    if mode.master == "fp32":
        p.add("master", n * 4, f"fp32 master {what}: {n:,} × 4", place=place)
    elif mode.master == "remainder":
        p.add("master", n * 2, f"int16 remainders of the fp32 master {what} (precision.master=remainder: its high "
                               f"halves are the bf16 weights, zerolab/master.py): {n:,} × 2")
    else:
        p.notes.append(f"precision.master=bf16: the bf16 weights are the master {what} (no bytes of its own; lossy)")


def total(bytes_by_category: dict[str, float]) -> float:
    return sum(bytes_by_category.values())


# The columns of the modes table: today's, the exact remainder, and the lossy modes (DeepSpeed's
# bf16_master_weights_and_grads with and without bf16_optimizer_states among them).
TABLE_MODES = (Mode(), Mode("remainder"), Mode("remainder", grad_shard="bf16"), Mode(optim_states="bf16"),
               Mode("remainder", "bf16"), Mode("bf16"), Mode("bf16", "bf16"), Mode("bf16", "bf16", "bf16"))


# ---- what the report holds within a loss band (zerolab/report/band.py) ------------------------------
def lossy_settings(config: dict) -> list[str]:
    """The lossy settings of a run's whole config (as a dict: summary.json's, the report's): its
    mode's, and a bf16 gradient shard under accumulation (micro-batches summed in bf16; zero1
    sums in the model's bf16 gradients anyway, so this names it there too, conservatively)."""
    out = Mode.of(config.get("precision", {})).lossy
    accum = config.get("trainer", {}).get("grad_accum_steps", 1)
    if config.get("precision", {}).get("grad_shard", "fp32") == "bf16" and accum > 1:
        out.append(f"precision.grad_shard=bf16 (summing {accum} micro-batches in bf16)")
    return out
