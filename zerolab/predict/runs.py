"""A run directory's job and its measured parts, for the prediction of the same run beside them.

`read_run(run_dir)` gives what the time model needs to predict a finished run (its validated
config from config.yaml, its world size) and what the run measured on its profiled steps
(summary.json's time_per_rank, averaged over the ranks). zerolab.rehearsal.predict_run rehearses
that config and prices it; `comparison` lays the prediction beside the measurement, part by part,
as `python -m zerolab compare` shows a profiled step's parts; `comparison_table` writes it as
report.md's table and `plot_comparison` draws it.
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
    from zerolab.schema import Config

    summary_path, config_path = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "config.yaml")
    for path in (summary_path, config_path):
        if not os.path.exists(path):
            raise ConfigError(f"{run_dir}: no {os.path.basename(path)}; a prediction needs a finished run's directory")
    with open(summary_path) as f:
        summary = json.load(f)
    world = int(summary["world_size"])
    cfg = validate(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_path)), world)
    measured = {}
    ranks = summary.get("time_per_rank") or []
    if ranks:  # profile.steps was set: the profiled steps' parts on every rank
        measured = {p: statistics.mean(r[key] for r in ranks) for p, key in MEASURED_KEYS.items()}
    elif summary.get("step_time_p50_s"):
        measured = {"step": summary["step_time_p50_s"]}
    return RunJob(run_dir, cfg, world, cfg.strategy.name, measured)


def comparison(p: Prediction, job: RunJob) -> dict:
    """Predicted beside measured, in seconds, per part and for the step; ratio = predicted / measured."""
    rows = {part: {"predicted": p.parts[part], "measured": job.measured.get(part)} for part in PARTS}
    rows["step"] = {"predicted": p.step_s, "measured": job.measured.get("step")}
    for r in rows.values():
        r["ratio"] = r["predicted"] / r["measured"] if r["measured"] else None
    return {"run_dir": job.run_dir, "strategy": job.strategy, "world": job.world, "hardware": p.hardware,
            "parts": rows, "assumptions": p.assumptions}


def comparison_table(rows: list[dict]) -> str:
    """report.md's table: per run, each part and the step, predicted beside measured (ms), and the
    ratio of the steps; then the model's assumptions (of the first row: one machine, one model)."""
    lines = ["The time model's prediction for each profiled run (its own config, rank 0 rehearsed, priced on "
             "the hardware named; a prediction is a model, not a measurement: docs/predict.md), predicted / "
             "measured in ms.", "",
             "| run | hardware | " + " | ".join(PARTS) + " | step | predicted ÷ measured |",
             "|---|---|" + "---|" * (len(PARTS) + 2)]
    for row in rows:
        cells = [_pair(row["parts"][part]) for part in (*PARTS, "step")]
        ratio = row["parts"]["step"]["ratio"]
        lines.append(f"| {row.get('label', row['strategy'])} | {row['hardware']} | {' | '.join(cells)} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    if rows:
        lines += ["", "Assumptions:", *(f"- {a}" for a in rows[0]["assumptions"])]
    return "\n".join(lines)


def _pair(cell: dict) -> str:
    measured = "-" if cell["measured"] is None else f"{cell['measured'] * 1e3:.1f}"
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
