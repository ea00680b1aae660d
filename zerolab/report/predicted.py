"""The time model beside the profiled steps: `python -m zerolab compare --predict` (docs/predict.md).

For every run whose steps were profiled (profile.steps), the run's own config is rehearsed on
rank 0, its step recorded and priced on this machine's calibrated figures
(zerolab.rehearsal.predict_run, hardware `cpu`), and laid beside the profiled parts: report.md's
table and predicted.png. A prediction is a model, not a measurement; its assumptions are printed
with it. `auto` (the default) predicts on this machine's calibration, and where the machine has
none yet it calibrates it first, once (`python -m zerolab.predict calibrate`'s measurement with 1,
2 and 3 ranks, about a minute and a half on 2 cores; written where `--hardware cpu` and every later report
read it), and the report says so, with the time it took and the load around it: the default job's
report then shows the prediction on a fresh machine. `calibrated` predicts only where the
calibration exists (and otherwise says how to get it); `cpu` refuses without one; `none` skips.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from zerolab.errors import ConfigError

log = logging.getLogger("zerolab")

CHOICES = ("auto", "calibrated", "cpu", "none")
NO_CALIBRATION = ("the time model's prediction is left out: this machine has no calibration yet "
                  "(`python -m zerolab.predict calibrate` measures it once, in about a minute and a half; then "
                  "`python -m zerolab compare` lays the prediction beside every profiled run)")


def calibrate_once() -> str:
    """Measure this machine for the time model now (zerolab.predict.calibrate, as its command does)
    and write the figures where `--hardware cpu` reads them; returns the sentence the report says.
    A failed measurement is said, not raised: the report stands without the prediction."""
    import json

    from zerolab.predict.calibrate import calibrate
    from zerolab.predict.hardware import calibration_path

    path = calibration_path()
    log.warning("zerolab compare: this machine has no calibration for the time model yet: measuring it "
                "once now (python -m zerolab.predict calibrate, about a minute and a half)")
    t0 = time.perf_counter()
    threads = os.environ.get("OMP_NUM_THREADS")
    try:
        result = calibrate()
    except Exception as err:  # noqa: BLE001  (the report is worth more than the prediction)
        return f"the time model's prediction is left out: calibrating this machine failed ({err})"
    finally:  # calibrate() sets it for its workers; this process keeps its own
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    seconds = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return (f"This machine had no calibration for the time model: it was measured now, once "
            f"(`python -m zerolab.predict calibrate`, 1, 2 and 3 ranks; {seconds:.0f} s, load average "
            f"{result['load_average_before']:.1f} before and {result['load_average_after']:.1f} after on "
            f"{os.cpu_count()} cores), into {path}, which later reports and `--hardware cpu` reuse.")


def measured_parts(b: dict) -> dict:
    """The report's breakdown (medians with their 95 % intervals, pooled over a job's rounds) as the
    time model's comparison reads it: part or "step" -> {"median", "lo", "hi"}."""
    keys = {"compute": "compute_s", "optimizer": "optimizer_s", "comm_exposed": "comm_exposed_s",
            "other": "other_s", "step": "step_s"}
    return {part: {"median": b[k], "lo": b["spread"][k][0], "hi": b["spread"][k][1]} for part, k in keys.items()}


def predictions(runs: list, out_dir: Path, mode: str) -> dict:
    """{"table": report.md's section (or ""), "figure": predicted.png (or None), "rows": [...],
    "note": why nothing was predicted (or "")}. Under `auto` a machine without a calibration is
    calibrated first (calibrate_once); ConfigError when `mode` is cpu and the machine has none
    (`calibrated` then only says so)."""
    from zerolab.predict.hardware import cpu_device
    from zerolab.predict.runs import comparison_table, plot_comparison
    from zerolab.rehearsal import predict_run

    empty = {"table": "", "figure": None, "rows": [], "note": ""}
    profiled = [r for r in runs if r.stats.get("breakdown")]
    if mode == "none" or not profiled:
        return empty
    measured_now = ""
    try:
        cpu_device(max(r.world for r in profiled))  # the calibration exists (the figures per rank count)
    except ConfigError:
        if mode == "cpu":
            raise
        if mode == "calibrated":
            return {**empty, "note": NO_CALIBRATION}
        measured_now = calibrate_once()
        try:
            cpu_device(max(r.world for r in profiled))
        except ConfigError:
            return {**empty, "note": measured_now}
    rows, left_out = [], []
    for run in profiled:
        row = predict_run(str(run.path), "cpu", measured=measured_parts(run.stats["breakdown"]))
        if row is None:  # a strategy the dry run cannot rehearse (DeepSpeed): no step to price
            left_out.append(run.label)
            continue
        rows.append({**row, "label": run.label})
    left = f"not predicted (the dry run does not rehearse them): {', '.join(left_out)}" if left_out else ""
    note = "\n\n".join(n for n in (measured_now, left) if n)
    if not rows:
        return {**empty, "note": note}
    figure = Path(plot_comparison(rows, str(out_dir / "predicted.png")))
    table = "\n\n".join(t for t in (measured_now, comparison_table(rows), left) if t)
    return {"table": table, "figure": figure, "rows": rows, "note": note}
