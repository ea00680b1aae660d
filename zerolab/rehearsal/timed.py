"""A finished run's step, rehearsed and priced by the time model: the report's prediction."""
from __future__ import annotations

from typing import Optional

from zerolab.predict import cli as predict_cli
from zerolab.predict.runs import comparison, read_run
from zerolab.rehearsal.run import rehearse


def predict_run(run_dir: str, hardware: str = "cpu", gpus_per_node: Optional[int] = None,
                measured: Optional[dict] = None) -> Optional[dict]:
    """The time model's prediction for a finished run (its own config, rank 0 rehearsed) beside what
    its profiled steps measured (zerolab.predict.runs.comparison: `measured`, with its interval, where
    the caller pooled the job's rounds, else the run's own medians); None for a strategy that is not
    rehearsed. `hardware` "cpu": this machine's calibration (where zerolab's CPU runs ran)."""
    job = read_run(run_dir)
    topo = predict_cli.topology(predict_cli.arguments(hardware, gpus_per_node), job.world, job.cfg.dist.ranks_per_node)
    r = rehearse([], job.world, record=True, quick=True, cfg=job.cfg)
    return comparison(predict_cli.priced(r, topo), job, measured) if r.record is not None else None
