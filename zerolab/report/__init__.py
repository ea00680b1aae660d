"""`python -m zerolab compare RUNS_OR_SWEEPS... --out report/`: strategies side by side.

Reads zerolab run directories (config.yaml, metrics.jsonl, summary.json, model.safetensors) —
given directly or found inside sweep directories — and writes report.md plus PNGs:

  loss.png       train loss (each run its own line style and markers), Δ against the baseline, eval loss
                 as points (never joined: a run evaluates a few times)
  loss_diff.png  per-step train loss minus the baseline's (the reference strategy unless --baseline)
  memory.png     per-rank measured bytes by category, stacked; the predicted ledger below each
  step_time.png  step time p50 / p95 / p99, and p50 ÷ baseline with its bootstrap interval
  comm.png       measured bytes sent per rank per step beside 2Ψ(N−1)/N and, for stage 3, the ZeRO
                 paper's 3Ψ(N−1)/N, with notes on why a bar sits above 2Ψ (volumes.py)
  breakdown.png  where the profiled steps go (runs with profile.steps: zerolab.profile), stacked per run
a parity table (function space first: Δ of the fixed held-out losses and logits each run saved
with zerolab.digest; then the final weights, with elements whose gradient is at rounding-noise
level listed apart; a mismatch names what differs and a cause zerolab knows), and a step-time
table (ratio to the baseline with a bootstrap interval over steps and rounds: "within noise"
unless it excludes 1.0, and "not called" when the machine was busier than its cores during a
job compared: load.py). The console table is followed by its legend (tables.LEGEND).
report.json carries all of it. With wandb on, the same figures and tables are logged to one run
(job_type=report) in the sweep's group, whose files are the report directory's wandb/.
"""
from zerolab.report.build import build_report, cli_main
from zerolab.report.intervals import bootstrap_ratio, timing_verdict
from zerolab.report.parity import known_cause, parity
from zerolab.report.runs import Run, compute_stats, label_runs, merge_rounds
from zerolab.report.tables import peak_table


__all__ = ["Run", "bootstrap_ratio", "build_report", "cli_main", "compute_stats", "known_cause", "label_runs",
           "merge_rounds", "parity", "peak_table", "timing_verdict"]
