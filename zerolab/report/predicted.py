"""The time model beside the profiled steps: `python -m zerolab compare --predict` (docs/predict.md).

For every run whose steps were profiled (profile.steps), the run's own config is rehearsed on
rank 0, its step recorded and priced on this machine's calibrated figures
(zerolab.rehearsal.predict_run, hardware `cpu`), and laid beside the profiled parts: report.md's
table and predicted.png. A prediction is a model, not a measurement; its assumptions are printed
with it. `auto` (the default) predicts when this machine has been calibrated
(`python -m zerolab.predict calibrate`) and otherwise says how to get the column.
"""
from __future__ import annotations

import logging
from pathlib import Path

from zerolab.errors import ConfigError

log = logging.getLogger("zerolab")

CHOICES = ("auto", "cpu", "none")
NO_CALIBRATION = ("the time model's prediction is left out: this machine has no calibration yet "
                  "(`python -m zerolab.predict calibrate` measures it once, in about a minute; then "
                  "`python -m zerolab compare` lays the prediction beside every profiled run)")


def predictions(runs: list, out_dir: Path, mode: str) -> dict:
    """{"table": report.md's section (or ""), "figure": predicted.png (or None), "rows": [...],
    "note": why nothing was predicted (or "")}. ConfigError when `mode` is cpu and the machine has
    no calibration (auto then only says so)."""
    from zerolab.predict.hardware import cpu_device
    from zerolab.predict.runs import comparison_table, plot_comparison
    from zerolab.rehearsal import predict_run

    empty = {"table": "", "figure": None, "rows": [], "note": ""}
    profiled = [r for r in runs if r.stats.get("breakdown")]
    if mode == "none" or not profiled:
        return empty
    try:
        cpu_device(max(r.world for r in profiled))  # the calibration exists (the figures per rank count)
    except ConfigError:
        if mode == "cpu":
            raise
        return {**empty, "note": NO_CALIBRATION}
    rows, left_out = [], []
    for run in profiled:
        row = predict_run(str(run.path), "cpu")
        if row is None:  # a strategy the dry run cannot rehearse (DeepSpeed): no step to price
            left_out.append(run.label)
            continue
        rows.append({**row, "label": run.label})
    note = f"not predicted (the dry run does not rehearse them): {', '.join(left_out)}" if left_out else ""
    if not rows:
        return {**empty, "note": note}
    figure = Path(plot_comparison(rows, str(out_dir / "predicted.png")))
    return {"table": comparison_table(rows) + (f"\n\n{note}" if note else ""), "figure": figure, "rows": rows,
            "note": note}
