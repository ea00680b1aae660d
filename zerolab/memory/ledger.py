"""The ledger in every run: this run's prediction (one per rank), held against what each rank's
strategy measured (Strategy.memory()) at the first optimizer step; the step's predicted peak and
activations (peak_for_run) held against the trainer's accounting of them (check_peak); and each
rank's process-level figures."""
from __future__ import annotations

import dataclasses
import logging

from zerolab.memory.peak import PEAK_WARN_RATIO, Peak, predicted_peak
from zerolab.accounting import CATEGORIES, MODEL_STATES, Prediction
from zerolab.memory.prediction import predict, prediction_dict
from zerolab.precision_modes import Mode
from zerolab.memory.shapes import optimizer_state_elements, shape_from_model, shape_from_model_config
from zerolab.strategies import strategy_class

log = logging.getLogger("zerolab.memory")  # the name users filter the ledger's warnings by

WARN_RATIO = 1.10  # measured above predicted by more than 10% gets a warning


def ledger_for_run(cfg, world_size: int, model=None, ranks_per_node: int | None = None) -> list[Prediction] | None:
    """The prediction for this run's model (the module about to be trained, else cfg.model built on
    the meta device), strategy, precision and optimizer, one per rank; None (with the reason
    logged) where the ledger has no model of the strategy or optimizer."""
    s = cfg.strategy
    try:
        shape = shape_from_model(model, cfg.optim.weight_decay, cfg.model.name) if model is not None \
            else shape_from_model_config(cfg.model, cfg.optim.weight_decay)
        k = optimizer_state_elements(cfg.optim.name)
        settings = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        one = lambda r: predict(shape, s.name, world_size, cfg.precision.name, cfg.optim.name, stage=s.stage,
                                bucket_mb=s.bucket_mb, reduce_dtype=s.reduce_dtype, state_elements=k, rank=r,
                                ranks_per_node=ranks_per_node, settings=settings, mode=Mode.of(cfg.precision))
        first = one(0)  # an unknown strategy fails here, as a ValueError
        if strategy_class(s.name).traits.uneven_memory:  # ranks hold different amounts
            return [first] + [one(r) for r in range(1, world_size)]
        return [first] * world_size
    except (ValueError, NotImplementedError) as e:
        log.info("memory ledger: no prediction for this run (%s)", e)
        return None


def check_against(preds: list[Prediction] | None, per_rank: list[dict], warn: bool = True) -> tuple[dict, dict]:
    """Hold each rank's measured `mem/<cat>_bytes` (Strategy.memory()) against the prediction.
    Returns (metrics keys `rank{r}/mem_pred/<cat>_bytes`, summary section with measured/predicted
    per rank per category); logs a warning for every category measured >10% above prediction."""
    if not preds:
        return {}, {"predicted": None}
    keys, ratios, warnings = {}, [], []
    for r, figures in enumerate(per_rank):
        pred = preds[r]
        want = pred.placed()  # by category, and by place (device, host, host/<category>)
        rank_ratio = {}
        figures = dict(figures)
        if all(f"mem/{c}_bytes" in figures for c in CATEGORIES):  # derive the sums from the categories
            figures["mem/model_states_bytes"] = sum(figures[f"mem/{c}_bytes"] for c in MODEL_STATES)
            figures["mem/total_bytes"] = sum(figures[f"mem/{c}_bytes"] for c in CATEGORIES)
        for cat, predicted in want.items():
            keys[f"rank{r}/mem_pred/{cat}_bytes"] = predicted
            measured = figures.get(f"mem/{cat}_bytes")
            if measured is None:
                continue
            rank_ratio[cat] = measured / predicted if predicted else (1.0 if measured == 0 else None)
            if measured > predicted * WARN_RATIO:
                msg = (f"rank {r}: measured {cat} = {measured:,} bytes exceeds the prediction "
                       f"{predicted:,} by more than {100 * (WARN_RATIO - 1):.0f}%")
                warnings.append(msg)
                if warn:
                    log.warning("memory ledger: %s (%s)", msg, pred.strategy)
        ratios.append(rank_ratio)
    return keys, {"predicted": prediction_dict(preds[0]), "predicted_bytes_per_rank": [p.bytes() for p in preds],
                  "measured_over_predicted": ratios, "warnings": warnings}


PROCESS_KEYS = ("rss_bytes", "rss_peak_bytes", "cuda_allocated_bytes", "cuda_max_allocated_bytes",
                "cuda_max_reserved_bytes", "cuda_alloc_retries", "cuda_ooms")


def process_summary(per_rank: list[dict]) -> list[dict]:
    """The process-level figures of each rank (RSS on CPU; allocator peaks, retries, OOMs on CUDA)."""
    return [{k: r[k] for k in PROCESS_KEYS if k in r} for r in per_rank]


# ---- the step's peak (zerolab.memory.peak): activations and peak rows of this run's ledger -------
def peak_for_run(preds: list[Prediction] | None, act_pred, mcfg, micro_batch: int, seq: int) -> list[Peak] | None:
    """The predicted peak per rank for this run (the planner's composition, zerolab.memory.peak),
    from the ledger's model-state prediction and zerolab.activations' prediction; None where
    either is missing (a strategy the ledger does not model, a model that is not zerolab's)."""
    if not preds or act_pred is None:
        return None
    return [predicted_peak(p, act_pred, mcfg, micro_batch, seq) for p in preds]


def peak_keys(peaks: list[Peak] | None) -> dict:
    """Metrics keys `rank{r}/mem_pred/peak_bytes` and `rank{r}/mem_pred/peak_<part>_bytes` (PARTS)
    of the predicted peak (the predicted activations have their own key, mem_pred/activations_bytes)."""
    keys = {}
    for r, pk in enumerate(peaks or []):
        keys[f"rank{r}/mem_pred/peak_bytes"] = pk.bytes
        keys.update({f"rank{r}/mem_pred/peak_{k}_bytes": v for k, v in pk.parts.items()})
    return keys


def check_peak(peaks: list[Peak] | None, act_bytes: list[int] | None, per_rank: list[dict],
               warn: bool = True) -> dict:
    """Hold each rank's measured `mem/activations_bytes` and `mem/peak_bytes` (the trainer's
    accounting) against the predicted ones; a warning for each measured above predicted by
    more than PEAK_WARN_RATIO. Returns the summary section."""
    if not peaks:
        return {"predicted": None}
    rows, warnings = [], []
    for r, figures in enumerate(per_rank):
        row = {"predicted_peak_bytes": peaks[r].bytes, "predicted_phase": peaks[r].phase,
               "measured_peak_bytes": figures.get("mem/peak_bytes"), "measured_phase": figures.get("mem/peak_phase"),
               "predicted_activations_bytes": act_bytes[r] if act_bytes else None,
               "measured_activations_bytes": figures.get("mem/activations_bytes")}
        for what in ("peak", "activations"):
            measured, predicted = row[f"measured_{what}_bytes"], row[f"predicted_{what}_bytes"]
            if measured is None or not predicted:
                continue
            row[f"{what}_measured_over_predicted"] = measured / predicted
            if measured > predicted * PEAK_WARN_RATIO:
                msg = (f"rank {r}: measured {what} = {measured:,} bytes exceeds the prediction {predicted:,} by "
                       f"more than {100 * (PEAK_WARN_RATIO - 1):.0f}%")
                warnings.append(msg)
                if warn:
                    log.warning("memory ledger: %s", msg)
        rows.append(row)
    return {"per_rank": rows, "warnings": warnings, "warn_ratio": PEAK_WARN_RATIO}
