"""A run directory's job and its measured parts, for the prediction of the same run beside them.

`read_run(run_dir)` gives what the time model needs to predict a finished run (its validated
config from config.yaml, its world size) and what the run measured on its profiled steps (the
median over its profiled steps and ranks of each part, from metrics.jsonl; summary.json's means
where the run logged no per-step parts). zerolab.rehearsal.predict_run rehearses that config and
prices it; `comparison` lays the prediction beside the measurement, part by part, as `python -m
zerolab compare` shows a profiled step's parts (with the measurement's 95 % interval where the
caller has one: the report pools a job's rounds); `comparison_table` writes it as report.md's table
and `plot_comparison` draws it.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field

from zerolab.errors import ConfigError
from zerolab.predict.model import Prediction
from zerolab.predict.timeline import PARTS

MEASURED_KEYS = {p: f"time/{p}_s" for p in (*PARTS, "step")}


@dataclass
class RunJob:
    run_dir: str
    cfg: object  # zerolab.schema.Config, validated for the run's world size
    world: int
    strategy: str
    measured: dict = field(default_factory=dict)  # PARTS and "step" -> seconds (profiled steps, mean over ranks)


def read_run(run_dir: str) -> RunJob:
    """The job of a finished run directory; ConfigError when it cannot be predicted (and why)."""
    from omegaconf import OmegaConf

    from zerolab.config import validate
    from zerolab.run.metrics import read_jsonl
    from zerolab.schema import Config

    summary_path, config_path = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "config.yaml")
    for path in (summary_path, config_path):
        if not os.path.exists(path):
            raise ConfigError(f"{run_dir}: no {os.path.basename(path)}; a prediction needs a finished run's directory")
    with open(summary_path) as f:
        summary = json.load(f)
    world = int(summary["world_size"])
    cfg = validate(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_path)), world)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [{p: m[f"rank{r}/{key}"] for p, key in MEASURED_KEYS.items()}
            for m in (read_jsonl(metrics) if os.path.exists(metrics) else []) for r in range(world)
            if f"rank{r}/time/step_s" in m]
    ranks = summary.get("time_per_rank") or []
    if rows:  # the profiled steps of every rank: the median of each part
        measured = {p: statistics.median(row[p] for row in rows) for p in MEASURED_KEYS}
    elif ranks:  # a run whose profiled steps' parts are in its summary only (means per rank)
        measured = {p: statistics.mean(r[key] for r in ranks) for p, key in MEASURED_KEYS.items()}
    elif summary.get("step_time_p50_s"):
        measured = {"step": summary["step_time_p50_s"]}
    else:
        measured = {}
    return RunJob(run_dir, cfg, world, cfg.strategy.name, measured)


def comparison(p: Prediction, job: RunJob, measured: dict | None = None) -> dict:
    """Predicted beside measured, in seconds, per part and for the step; ratio = predicted / measured.
    `measured`: part or "step" -> {"median", "lo", "hi"} (a 95 % interval: the report's, pooled over
    a job's rounds), else the run's own medians (read_run) without an interval."""
    measured = measured or {k: {"median": v} for k, v in job.measured.items()}
    rows = {}
    for part, pred in ((part, p.parts[part]) for part in PARTS):
        rows[part] = _row(pred, measured.get(part, {}))
    rows["step"] = _row(p.step_s, measured.get("step", {}))
    return {"run_dir": job.run_dir, "strategy": job.strategy, "world": job.world, "hardware": p.hardware,
            "parts": rows, "assumptions": p.assumptions}


def _row(pred: float, m: dict) -> dict:
    """One cell: the prediction, the measured median and its interval, and their ratios (the ratio's
    interval is the prediction over the measurement's bounds)."""
    got, lo, hi = m.get("median"), m.get("lo"), m.get("hi")
    return {"predicted": pred, "measured": got, "lo": lo, "hi": hi,
            "ratio": pred / got if got else None,
            "ratio_lo": pred / hi if hi else None, "ratio_hi": pred / lo if lo else None}


def comparison_table(rows: list[dict]) -> str:
    """report.md's table: per run, each part and the step, predicted beside measured (ms, the
    measured median with its 95 % interval where known), and the ratio of the steps with its
    interval; then the model's assumptions (of the first row: one machine, one model)."""
    lines = ["The time model's prediction for each profiled run (its own config, rank 0 rehearsed, priced on "
             "the hardware named; a prediction is a model, not a measurement: docs/predict.md), predicted / "
             "measured in ms: the measured median of the profiled steps and ranks of every round, its 95 % "
             "interval in brackets. The ratio's interval is the measurement's, not the model's.", "",
             "| run | hardware | " + " | ".join(PARTS) + " | step | predicted ÷ measured [95 %] |",
             "|---|---|" + "---|" * (len(PARTS) + 2)]
    for row in rows:
        cells = [_pair(row["parts"][part]) for part in (*PARTS, "step")]
        step = row["parts"]["step"]
        ratio = "-" if step["ratio"] is None else f"{step['ratio']:.2f}" + (
            f" [{step['ratio_lo']:.2f}, {step['ratio_hi']:.2f}]" if step.get("ratio_lo") else "")
        lines.append(f"| {row.get('label', row['strategy'])} | {row['hardware']} | {' | '.join(cells)} | {ratio} |")
    if rows:
        lines += ["", "Assumptions:", *(f"- {a}" for a in rows[0]["assumptions"])]
    return "\n".join(lines)


def _pair(cell: dict) -> str:
    measured = "-" if cell["measured"] is None else f"{cell['measured'] * 1e3:.1f}"
    if cell.get("lo") is not None and cell.get("hi") is not None:
        measured += f" [{cell['lo'] * 1e3:.1f}, {cell['hi'] * 1e3:.1f}]"
    return f"{cell['predicted'] * 1e3:.1f} / {measured}"


def plot_comparison(rows: list[dict], path: str) -> str:
    """Per run, two stacked bars of the step's parts: predicted (hatched) and measured."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(rows) + 2), 4.5))
    for i, row in enumerate(rows):
        for j, (which, hatch) in enumerate((("predicted", "//"), ("measured", ""))):
            bottom = 0.0
            for k, part in enumerate(PARTS):
                value = (row["parts"][part][which] or 0.0) * 1e3
                ax.bar(i + (j - 0.5) * 0.38, value, 0.36, bottom=bottom, color=f"C{k}", hatch=hatch,
                       edgecolor="k", linewidth=0.4, label=part if i == 0 and j == 1 else None)
                bottom += value
    ax.set_xticks(range(len(rows)), [r.get("label", r["strategy"]) for r in rows])
    ax.set_ylabel("ms per step")
    ax.set_title("the time model (left, hatched) beside the profiled steps (right)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
