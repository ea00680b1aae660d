"""`python -m zerolab compare`: report.md, report.json and the PNGs from run or sweep directories,
optionally mirrored to one wandb run."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from zerolab.report.figures import plot_breakdown, plot_comm, plot_loss, plot_loss_diff, plot_memory, plot_step_time
from zerolab.report.intervals import bootstrap_ratio
from zerolab.report.load import job_loads, judge
from zerolab.report.parity import parity
from zerolab.report.predicted import CHOICES, predictions
from zerolab.report.runs import (Run, compute_stats, find_run_dirs, label_runs, load_run, merge_rounds,
                                 strategy_class, sweep_info)
from zerolab.report.tables import (LEGEND, breakdown_table, machine_line, memory_table, parity_table, peak_table,
                                   summary_table, timing_table)


# What each section of report.md says before its table.
INTRO = ("Step times exclude the first step; p50 ÷ base is the median step time over the baseline's, with its 95 % "
         "bootstrap interval. Comm is counted in the ring-cost model (zerolab.comm). " + LEGEND + "\n")
PARITY = ("Function space first: every run evaluated the same fixed held-out batches at the end "
          "(zerolab.digest); Δeval-loss is the largest per-batch loss difference, max abs Δlogit the "
          "largest logit difference (in brackets: relative to the baseline's largest logit). Then the "
          "final weights: max rel Δparam = max over tensors of max|Δ| / max|baseline|, over elements whose "
          "gradient fp32 can resolve. Elements whose gradient is at rounding-noise level (found by each "
          "run's float64/fp32 gradient probe, e.g. the key third of attn.qkv.bias, whose true gradient is "
          "zero) drift apart under any change of summation order: they are listed apart, with their Δ, and "
          "do not decide the verdict. Tolerances: fp32 1e-4 (function) / 1e-5 (weights); 16-bit loosely. "
          "A run that rounds on purpose (ZeRO++'s quantized collectives; a bf16 master or optimizer state), or "
          "whose baseline does, is never a match: its training loss is held step by step within a band derived "
          "from the rounding's bound and the baseline's own per-step loss noise (\"quantized: within band\", "
          "\"lossy: within band\" or \"OUTSIDE BAND\"; docs/nodes.md, docs/below-the-floor.md).\n")
TIMING = ("Ratio of p50 step times with a 95 % bootstrap interval (resampling rounds, then steps within "
          "them; seeded, so the same data gives the same verdict); per round: the ratio within each round (the "
          "two runs of one round ran minutes apart). \"within noise\" unless the interval excludes 1.0. "
          "\"not called\" when the machine was busier than its cores during a job of either run "
          "(the mean of runnable processes over the job, read from the 1-minute load average before and after it "
          "in sweep.json, above max(cores, ranks) + 0.5): a load slows one job and not another, and no interval "
          "holds that. With one round the interval holds only the spread between steps of each run, "
          "not a change of the machine's load between runs: run the sweep with hydra.launcher.rounds=2 "
          "(or more) to pool rounds in alternating order.\n")
PEAK = ("Measured: the model states the strategy holds + the activations saved for backward (measured) + the "
        "transients of the same moment (the loss's logits buffers, a recomputed block with checkpointing, the "
        "buffers the strategy recorded); predicted: the planner's composition for the run (zerolab/memory/peak.py).\n")
BREAKDOWN = ("The profiled steps (profile.steps; zerolab/profile/, docs/profile.md) split on every rank into four "
             "disjoint parts that add up to the step: compute (forward and backward), optimizer (clip and step), "
             "exposed communication (the rank waited for a collective: on CPU/gloo the host inside a wait; on CUDA "
             "communication kernels not overlapped by compute) and other (data, host work). Comm in flight is all the "
             "time some collective was running; hidden is the share of it that overlapped other work. Medians over "
             "the profiled steps and ranks of every round, each with its 95 % interval in brackets (a bootstrap over "
             "the rounds, then their steps: what moves between runs of the job is in it); the parts' medians add up "
             "to the step's nearly, not exactly. The worst rank's exposed communication is its own median. MFU: "
             "model FLOPs (6N + 12·L·d·T per token) per second per device over the peak in summary.json (peak_flops, "
             "peak_flops_source), median over the logged steps after the first.\n")


def load_runs(paths: list[str], baseline: Optional[str] = None) -> tuple[list[Run], Run, dict]:
    """The runs under `paths` (rounds of one job merged), their statistics, the baseline they
    are measured against (--baseline, else the reference strategy's run) and the sweep's load."""
    dirs = find_run_dirs(paths)
    if not dirs:
        raise FileNotFoundError(f"no run directories (with metrics.jsonl) under {', '.join(paths)}")
    rounds, loads = sweep_info(paths)
    jobs = job_loads(paths)
    runs = [load_run(d) for d in dirs]
    for r in runs:
        r.round = rounds.get(r.path.resolve(), 0)
    label_runs(runs)
    runs = merge_rounds(runs)
    for r in runs:
        compute_stats(r)
    if baseline:
        matches = [r for r in runs if r.label == baseline or r.strategy == baseline]
        if not matches:
            raise ValueError(f"--baseline {baseline!r} matches no run; runs: {', '.join(r.label for r in runs)}")
        base = matches[0]
    else:
        base = next((r for r in runs if getattr(strategy_class(r.strategy), "reference", False)), runs[0])
    for r in runs:
        r.stats["timing"] = judge(bootstrap_ratio(r.stats["rounds"], base.stats["rounds"]), r, base, jobs)
    return runs, base, loads


def build_report(paths: list[str], out: str, baseline: Optional[str] = None, wandb_mode: str = "disabled",
                 predict: str = "none") -> dict:
    """report.md, report.json and the figures of `paths` in `out`; `predict` (auto | cpu | none):
    the time model beside the profiled steps (zerolab/report/predicted.py)."""
    runs, base, loads = load_runs(paths, baseline)
    par = {r.label: ({"status": "baseline"} if r is base else parity(r, base)) for r in runs}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {"loss": plot_loss(runs, base, out_dir), "loss_diff": plot_loss_diff(runs, base, out_dir),
               "memory": plot_memory(runs, out_dir), "step_time": plot_step_time(runs, base, out_dir),
               "comm": plot_comm(runs, out_dir)}
    profiled = any(r.stats.get("breakdown") for r in runs)
    if profiled:
        figures["breakdown"] = plot_breakdown(runs, out_dir)
    table, machine = summary_table(runs, base, par), machine_line(runs, loads)
    b = base.summary
    conditions = (f"{b.get('model', '?')} ({b.get('n_params', '?')} params), world {base.world}, "
                  f"global batch {b.get('global_batch', '?')}, {b.get('steps', '?')} steps, "
                  f"optimizer {b.get('optimizer', '?')}; baseline: {base.label}")
    md = [f"# Strategy comparison\n\n{conditions}\n\n{machine}\n", INTRO, table,
          "\n## Parity\n", PARITY, parity_table(runs, base, par),
          "\n## Step time against the baseline\n", TIMING, timing_table(runs, base),
          "\n## Memory per rank (MiB)\n", memory_table(runs),
          "\n## Peak memory of a step per rank (MiB)\n", PEAK, peak_table(runs)]
    breakdown = breakdown_table(runs) if profiled else ""
    if profiled:
        md += ["\n## Where the step goes\n", BREAKDOWN, breakdown]
    model = predictions(runs, out_dir, predict)
    if model["figure"]:
        figures["predicted"] = model["figure"]
    if model["table"] or model["note"]:
        md += ["\n## The time model beside the profiled steps\n", model["table"] or model["note"]]
    md += ["\n## Figures\n"]
    md += [f"![{k}]({p.name})" for k, p in figures.items()]
    md += ["\n## Runs\n"] + [f"- {r.label}: `{r.path}`" + "".join(f", `{x.path}`" for x in r.repeats) for r in runs]
    (out_dir / "report.md").write_text("\n".join(md) + "\n")
    result = {"report": str(out_dir / "report.md"), "figures": {k: str(v) for k, v in figures.items()},
              "table": table, "parity": par, "baseline": base.label, "runs": [r.label for r in runs],
              "timing": {r.label: r.stats["timing"] for r in runs}, "machine": machine, "loadavg": loads,
              "breakdown": {r.label: r.stats["breakdown"] for r in runs if r.stats.get("breakdown")},
              "breakdown_table": breakdown, "predicted": model["rows"], "predicted_table": model["table"],
              "predicted_note": model["note"]}
    (out_dir / "report.json").write_text(json.dumps({k: v for k, v in result.items() if not k.endswith("table")},
                                                    indent=2, default=str))
    if wandb_mode != "disabled":
        log_to_wandb(runs, result, wandb_mode, paths)
    return result


def log_to_wandb(runs: list[Run], result: dict, mode: str, paths: list[str]) -> None:
    """The report's figures and tables as one wandb run in the sweep's group (job_type=report)."""
    import wandb

    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    w = runs[0].config.get("logging", {}).get("wandb", {})
    sweep = Path(paths[0]).resolve().name
    group = f"{runs[0].config.get('experiment', 'default')}/{sweep}"
    run = wandb.init(project=w.get("project", "zerolab"), entity=w.get("entity") or None, group=group,
                     job_type="report", name=f"report-{sweep}", dir=str(Path(result["report"]).parent), mode=mode,
                     reinit="finish_previous")
    run.log({k: wandb.Image(v) for k, v in result["figures"].items()})
    cols = ["run", "strategy", "precision", "p50_s", "p95_s", "p99_s", "p50_ratio", "ratio_lo", "ratio_hi",
            "timing", "tokens_per_s", "d_eval_loss", "max_dlogit", "max_rel_dparam", "parity"]
    rows = []
    for r in runs:
        t, p = r.stats["timing"], result["parity"][r.label]
        rows.append([r.label, r.strategy, r.precision, r.stats["p50"], r.stats["p95"], r.stats["p99"], t["ratio"],
                     t["lo"], t["hi"], t["verdict"], r.stats["tokens_per_s"], p.get("d_eval_loss"),
                     p.get("max_dlogit"), p.get("max_rel"), p["status"]])
    run.log({"summary": wandb.Table(columns=cols, data=rows)})
    if result["breakdown"]:  # where the profiled steps went (seconds, medians over steps and ranks)
        parts = ["step_s", "compute_s", "optimizer_s", "comm_exposed_s", "other_s", "comm_s", "hidden"]
        run.log({"breakdown": wandb.Table(columns=["run", *parts],
                                          data=[[k, *(b[p] for p in parts)] for k, b in result["breakdown"].items()])})
    run.finish()


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab compare",
                                description="compare zerolab runs: report.md + PNGs (loss, memory, time, comm, parity)")
    p.add_argument("paths", nargs="+", help="run directories and/or sweep directories")
    p.add_argument("--out", default="report", help="output directory (default: report/)")
    p.add_argument("--baseline", default=None,
                   help="label or strategy of the baseline run (default: the reference strategy's run)")
    p.add_argument("--wandb", default="runs", choices=["runs", "auto", "online", "offline", "disabled"],
                   help="log figures to wandb; 'runs' (default): as the runs were configured")
    p.add_argument("--predict", default="auto", choices=CHOICES,
                   help="the time model's prediction beside each profiled run (docs/predict.md): auto (default: "
                        "on this machine's calibration, measured first, once, where there is none: python -m "
                        "zerolab.predict calibrate, about a minute and a half), calibrated (only where one "
                        "exists), cpu (refused without one), none")
    p.add_argument("--fail-on-mismatch", action="store_true", help="exit 1 when a parity check fails")
    args = p.parse_args(argv)
    try:
        mode = args.wandb
        if mode == "runs":
            first = find_run_dirs(args.paths)[:1]
            mode = load_run(first[0]).config.get("logging", {}).get("wandb", {}).get("mode", "disabled") \
                if first else "disabled"
            if os.environ.get("WANDB_MODE") == "disabled":
                mode = "disabled"
        result = build_report(args.paths, args.out, args.baseline, mode, args.predict)
    except (FileNotFoundError, ValueError) as err:  # ConfigError is a ValueError
        print(f"zerolab compare: {err}", file=sys.stderr)
        return 2
    print(result["table"])
    print(LEGEND)
    if result["breakdown_table"]:
        print("\nWhere the profiled steps go (medians over steps and ranks, [95 % interval]; report.md says how "
              "to read it):\n"
              + result["breakdown_table"])
    if result["predicted_table"] or result["predicted_note"]:
        print("\nThe time model beside the profiled steps:\n" + (result["predicted_table"] or result["predicted_note"]))
    print(f"\nreport: {result['report']}")
    print("figures: " + " ".join(result["figures"].values()))
    print(result["machine"])
    for k, t in result["timing"].items():
        if k != result["baseline"] and t["verdict"] != "no timings":
            print(f"step time {k}: {t['ratio']:.3f} x {result['baseline']} "
                  f"[{t['lo']:.3f}, {t['hi']:.3f}] {t['verdict']}" + (f": {t['why']}" if t.get("why") else ""))
    bad = [k for k, v in result["parity"].items() if v["status"] == "MISMATCH" or v["status"].endswith(" OUTSIDE BAND")]
    if bad:
        print(f"parity MISMATCH or outside a loss band against {result['baseline']}: {', '.join(bad)}", file=sys.stderr)
        for k in bad:
            v = result["parity"][k]
            print(f"  {k}: {v.get('detail', '')}" + (f"; cause: {v['cause']}" if v.get("cause") else ""),
                  file=sys.stderr)
    return 1 if bad and args.fail_on_mismatch else 0
