"""`python -m zerolab compare RUNS_OR_SWEEPS... --out report/`: strategies side by side.

Reads zerolab run directories (config.yaml, metrics.jsonl, summary.json, model.safetensors) —
given directly or found inside sweep directories — and writes report.md plus PNGs:

  loss.png       train loss per step overlaid, eval loss beside it
  loss_diff.png  per-step train loss minus the baseline's (ddp unless --baseline)
  memory.png     per-rank measured bytes by category, stacked; the predicted ledger beside it
  step_time.png  step time p50 / p95 / p99 (the first step, which warms up, is left out)
  comm.png       measured bytes sent per rank per step against 2Ψ(N−1)/N (zerolab.comm)
and a parity table: max |Δparam| of each run's final weights against the baseline's, flagged
when above the tolerance for its precision. With wandb on, the same figures and tables are logged
to one run (job_type=report) in the sweep's group.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from zerolab.comm import theory_bytes_per_step
from zerolab.memory import CATEGORIES

# Parity tolerance on max relative |Δparam| against a baseline of the same precision. fp32 runs
# of the same math agree to ~1e-7 (tests); 16-bit runs round differently on every path, so
# their figure is shown for information with a loose bound.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-2, "bf16_pure": 5e-2}
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16_pure": 2}
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "master": "#55a868", "optim_state": "#c44e52", "buffers": "#8172b3"}


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict]
    summary: dict
    label: str = ""
    stats: dict = field(default_factory=dict)

    @property
    def strategy(self) -> str:
        return self.config.get("strategy", {}).get("name") or self.summary.get("strategy", "?")

    @property
    def precision(self) -> str:
        return self.config.get("precision", {}).get("name") or self.summary.get("precision", "fp32")

    @property
    def world(self) -> int:
        return int(self.summary.get("world_size") or 1)


# ---- loading -------------------------------------------------------------------------------
def find_run_dirs(paths: list[str]) -> list[Path]:
    """Run directories given directly, or inside sweep directories (in sweep.json's job order)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").exists():
            found.append(p)
        elif p.is_dir():
            index = p / "sweep.json"
            if index.exists():
                jobs = sorted(json.loads(index.read_text())["jobs"], key=lambda j: j["num"])
                found += [Path(j["run_dir"]) for j in jobs if (Path(j["run_dir"]) / "metrics.jsonl").exists()]
            else:
                found += sorted(d.parent for d in p.glob("*/metrics.jsonl"))
        else:
            raise FileNotFoundError(f"{p}: not a run directory (no metrics.jsonl) nor a sweep directory")
    return found


def load_run(path: Path) -> Run:
    from omegaconf import OmegaConf

    from zerolab.metrics import read_jsonl

    cfg = OmegaConf.to_container(OmegaConf.load(path / "config.yaml")) if (path / "config.yaml").exists() else {}
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
    return Run(path, cfg, read_jsonl(str(path / "metrics.jsonl")), summary)


def label_runs(runs: list[Run]) -> None:
    for r in runs:
        s = r.config.get("strategy", {})
        r.label = r.strategy + (f"-s{s.get('stage')}" if r.strategy == "deepspeed" else "")
    if len({r.precision for r in runs}) > 1:
        for r in runs:
            r.label += f"-{r.precision}"
    seen: dict[str, int] = {}
    for r in runs:  # two runs with the same settings: tell them apart by directory
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label += f" ({r.path.name})"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _series(run: Run, key: str) -> list[tuple[int, float]]:
    out = []
    for m in run.metrics:
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((m["step"], float(v)))
    return out


def _rank_figures(run: Run, prefix: str) -> list[dict[str, float]]:
    """Per-rank bytes by category from the last record that has `rank{r}/<prefix>/...` keys."""
    for m in reversed(run.metrics):
        if f"rank0/{prefix}/total_bytes" in m or f"rank0/{prefix}/params_bytes" in m:
            return [{c: m.get(f"rank{r}/{prefix}/{c}_bytes", 0) for c in CATEGORIES} for r in range(run.world)]
    if prefix == "mem_pred":
        pred = run.summary.get("memory_ledger", {}).get("predicted_bytes_per_rank")
        if pred:
            return [{c: p.get(c, 0) for c in CATEGORIES} for p in pred]
    return []


def compute_stats(run: Run) -> None:
    times = [t for s, t in _series(run, "step_time_s") if s > 1] or [t for _, t in _series(run, "step_time_s")]
    tokens = [t for s, t in _series(run, "tokens_per_s") if s > 1]
    comm = [[v for s, v in _series(run, f"rank{r}/comm_bytes") if s > 1] for r in range(run.world)]
    n_params = run.summary.get("n_params") or 0
    st = run.stats
    st["p50"] = percentile(times, 50) if times else float("nan")
    st["p95"] = percentile(times, 95) if times else float("nan")
    st["p99"] = percentile(times, 99) if times else float("nan")
    st["tokens_per_s"] = statistics.median(tokens) if tokens else float("nan")
    st["comm_per_step"] = [statistics.mean(c) if c else float("nan") for c in comm]
    st["comm_theory"] = theory_bytes_per_step(n_params, GRAD_BYTES.get(run.precision, 4), run.world)
    st["mem"] = _rank_figures(run, "mem")
    st["mem_pred"] = _rank_figures(run, "mem_pred")
    train = _series(run, "loss")
    st["final_loss"] = train[-1][1] if train else float("nan")
    ev = _series(run, "eval_loss")
    st["eval_loss"] = ev[-1][1] if ev else float("nan")


# ---- parity --------------------------------------------------------------------------------
def parity(run: Run, base: Run) -> dict:
    """max |Δparam| and max relative difference (per tensor: max|Δ| / max|base|) of final weights."""
    from safetensors.torch import load_file

    a_path, b_path = run.path / "model.safetensors", base.path / "model.safetensors"
    if not a_path.exists() or not b_path.exists():
        return {"status": "no weights"}
    a, b = load_file(str(a_path)), load_file(str(b_path))
    if a.keys() != b.keys():
        return {"status": "MISMATCH", "detail": f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}",
                "max_abs": float("inf"), "max_rel": float("inf"), "worst": "", "tol": 0.0}
    worst, max_abs, max_rel = "", 0.0, 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            return {"status": "MISMATCH", "detail": f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}",
                    "max_abs": float("inf"), "max_rel": float("inf"), "worst": k, "tol": 0.0}
        d = (x - y).abs().max().item()
        rel = d / max(y.abs().max().item(), 1e-12)
        max_abs = max(max_abs, d)
        if rel > max_rel or not worst:
            worst, max_rel = k, rel
    tol = TOLERANCE.get(run.precision, 1e-5) if run.precision == base.precision else float("nan")
    same = [(run.summary.get(k), base.summary.get(k)) for k in ("steps", "global_batch", "model", "optimizer")]
    if run.precision != base.precision:
        status = "n/a (precision differs)"
    elif any(a != b for a, b in same):
        status = "n/a (steps/batch/model/optimizer differ)"
    else:
        status = "match" if max_rel <= tol else "MISMATCH"
    return {"status": status, "max_abs": max_abs, "max_rel": max_rel, "worst": worst, "tol": tol}


# ---- figures -------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Every figure ends the same way: tight layout, a PNG at 110 dpi, the figure closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(runs: list[Run], out: Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        s = _series(r, "loss")
        ax1.plot([x for x, _ in s], [y for _, y in s], label=r.label, lw=1.2)
        e = _series(r, "eval_loss")
        ax2.plot([x for x, _ in e], [y for _, y in e], marker="o", label=r.label)
    ax1.set(title="train loss (mean over ranks)", xlabel="step", ylabel="loss")
    ax2.set(title="eval loss", xlabel="step", ylabel="loss")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    return _save(plt, fig, out / "loss.png")


def plot_loss_diff(runs: list[Run], base: Run, out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ref = dict(_series(base, "loss"))
    for r in runs:
        if r is base:
            continue
        s = [(x, y - ref[x]) for x, y in _series(r, "loss") if x in ref]
        ax.plot([x for x, _ in s], [y for _, y in s], label=r.label, lw=1.2)
    ax.axhline(0, color="k", lw=0.6)
    ax.set(title=f"train loss minus {base.label}'s, per step", xlabel="step", ylabel="Δ loss")
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "loss_diff.png")


def plot_memory(runs: list[Run], out: Path) -> Path:
    plt = _plt()
    bars = []  # (x label, categories dict, predicted?)
    for r in runs:
        for rank, mem in enumerate(r.stats["mem"]):
            bars.append((f"{r.label}\nrank{rank}", mem, False))
            pred = r.stats["mem_pred"]
            if rank < len(pred):
                bars.append((f"(predicted)\nrank{rank}", pred[rank], True))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(bars) + 2), 5))
    for i, (_, mem, predicted) in enumerate(bars):
        bottom = 0.0
        for c in CATEGORIES:
            v = mem.get(c, 0) / 2**20
            ax.bar(i, v, bottom=bottom, color=COLORS[c], alpha=0.45 if predicted else 1.0,
                   hatch="//" if predicted else None, edgecolor="white", label=c if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7, rotation=60, ha="right")
    ax.set(title="model states per rank by category (solid: measured, hatched: predicted ledger)", ylabel="MiB")
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "memory.png")


def plot_step_time(runs: list[Run], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs) + 2), 4.5))
    width = 0.27
    for j, q in enumerate(("p50", "p95", "p99")):
        ax.bar([i + (j - 1) * width for i in range(len(runs))], [r.stats[q] * 1e3 for r in runs], width, label=q)
    ax.set_xticks(range(len(runs)), [r.label for r in runs], fontsize=8, rotation=20, ha="right")
    ax.set(title="step time (first step excluded)", ylabel="ms")
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "step_time.png")


def plot_comm(runs: list[Run], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs) + 2), 4.5))
    for i, r in enumerate(runs):
        ax.bar(i - 0.2, r.stats["comm_per_step"][0] / 2**20 if r.stats["comm_per_step"] else 0, 0.4,
               color="#4c72b0", label="measured (rank 0)" if i == 0 else None)
        ax.bar(i + 0.2, r.stats["comm_theory"] / 2**20, 0.4, color="#bbbbbb",
               label="theory 2Ψ(N−1)/N × grad bytes" if i == 0 else None)
    ax.set_xticks(range(len(runs)), [r.label for r in runs], fontsize=8, rotation=20, ha="right")
    ax.set(title="bytes sent per rank per step", ylabel="MiB")
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "comm.png")


# ---- tables --------------------------------------------------------------------------------
def _f(v: float, fmt: str = "{:.4f}") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _mib(b: float) -> str:
    return _f(b / 2**20, "{:.2f}")


def summary_table(runs: list[Run], base: Run, par: dict[str, dict]) -> str:
    head = ("| run | final loss | eval loss | p50 ms | p95 ms | p99 ms | p50 ÷ base | tokens/s | "
            "model states MiB r0 (pred) | comm MiB/step r0 (theory) | max rel Δparam | parity |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in runs:
        st, p = r.stats, par[r.label]
        mem = st["mem"][0].get("params", 0) + st["mem"][0].get("grads", 0) + st["mem"][0].get("master", 0) + \
            st["mem"][0].get("optim_state", 0) if st["mem"] else float("nan")
        pred = sum(st["mem_pred"][0].get(c, 0) for c in ("params", "grads", "master", "optim_state")) \
            if st["mem_pred"] else float("nan")
        comm = st["comm_per_step"][0] if st["comm_per_step"] else float("nan")
        lines.append("| " + " | ".join([
            r.label, _f(st["final_loss"]), _f(st["eval_loss"]), _f(st["p50"] * 1e3, "{:.1f}"),
            _f(st["p95"] * 1e3, "{:.1f}"), _f(st["p99"] * 1e3, "{:.1f}"),
            _f(st["p50"] / base.stats["p50"], "{:.2f}"), _f(st["tokens_per_s"], "{:.0f}"),
            f"{_mib(mem)} ({_mib(pred)})", f"{_mib(comm)} ({_mib(st['comm_theory'])})",
            "baseline" if r is base else _f(p.get("max_rel", float("nan")), "{:.2e}"),
            "baseline" if r is base else p["status"]]) + " |")
    return "\n".join(lines)


def parity_table(runs: list[Run], base: Run, par: dict[str, dict]) -> str:
    lines = [f"| run (vs {base.label}) | max abs Δparam | max rel Δparam | worst tensor | tolerance | verdict |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        if r is base:
            continue
        p = par[r.label]
        lines.append(f"| {r.label} | {_f(p.get('max_abs', float('nan')), '{:.3e}')} | "
                     f"{_f(p.get('max_rel', float('nan')), '{:.3e}')} | {p.get('worst', '')} | "
                     f"{_f(p.get('tol', float('nan')), '{:.0e}')} | **{p['status']}** |")
    return "\n".join(lines)


def memory_table(runs: list[Run]) -> str:
    lines = ["| run | rank | " + " | ".join(CATEGORIES) + " | predicted model states |",
             "|" + "---|" * (len(CATEGORIES) + 3)]
    for r in runs:
        for rank, mem in enumerate(r.stats["mem"]):
            pred = r.stats["mem_pred"][rank] if rank < len(r.stats["mem_pred"]) else None
            pred_s = _mib(sum(pred.get(c, 0) for c in ("params", "grads", "master", "optim_state"))) if pred else "—"
            lines.append(f"| {r.label} | {rank} | " + " | ".join(_mib(mem.get(c, 0)) for c in CATEGORIES) +
                         f" | {pred_s} |")
    return "\n".join(lines)


# ---- the report ----------------------------------------------------------------------------
def build_report(paths: list[str], out: str, baseline: Optional[str] = None, wandb_mode: str = "disabled") -> dict:
    dirs = find_run_dirs(paths)
    if not dirs:
        raise FileNotFoundError(f"no run directories (with metrics.jsonl) under {', '.join(paths)}")
    runs = [load_run(d) for d in dirs]
    label_runs(runs)
    for r in runs:
        compute_stats(r)
    if baseline:
        matches = [r for r in runs if r.label == baseline or r.strategy == baseline]
        if not matches:
            raise ValueError(f"--baseline {baseline!r} matches no run; runs: {', '.join(r.label for r in runs)}")
        base = matches[0]
    else:
        base = next((r for r in runs if r.strategy == "ddp"), runs[0])
    par = {r.label: ({"status": "baseline"} if r is base else parity(r, base)) for r in runs}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {"loss": plot_loss(runs, out_dir), "loss_diff": plot_loss_diff(runs, base, out_dir),
               "memory": plot_memory(runs, out_dir), "step_time": plot_step_time(runs, out_dir),
               "comm": plot_comm(runs, out_dir)}
    table, ptable, mtable = summary_table(runs, base, par), parity_table(runs, base, par), memory_table(runs)
    b = base.summary
    conditions = (f"{b.get('model', '?')} ({b.get('n_params', '?')} params), world {base.world}, "
                  f"global batch {b.get('global_batch', '?')}, {b.get('steps', '?')} steps, "
                  f"optimizer {b.get('optimizer', '?')}; baseline: {base.label}")
    md = [f"# Strategy comparison\n\n{conditions}\n",
          "Step times exclude the first step; p50 ÷ base is the median step time over the baseline's. "
          "Memory is the measured model states on rank 0 (the predicted ledger in brackets, when the run "
          "logged one). Comm is bytes sent by rank 0 per step, ring-cost model, against 2Ψ(N−1)/N × "
          "gradient bytes.\n", table, "\n## Parity of final weights\n",
          "max rel Δparam = max over tensors of max|Δ| / max|baseline|. Tolerance: 1e-5 for fp32 "
          "(same math, different summation order); 16-bit runs are compared loosely.\n", ptable,
          "\n## Memory per rank (MiB)\n", mtable, "\n## Figures\n"]
    md += [f"![{k}]({p.name})" for k, p in figures.items()]
    md += ["\n## Runs\n"] + [f"- {r.label}: `{r.path}`" for r in runs]
    (out_dir / "report.md").write_text("\n".join(md) + "\n")
    result = {"report": str(out_dir / "report.md"), "figures": {k: str(v) for k, v in figures.items()},
              "table": table, "parity": par, "baseline": base.label, "runs": [r.label for r in runs]}
    (out_dir / "report.json").write_text(json.dumps({k: v for k, v in result.items() if k != "table"},
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
    cols = ["run", "strategy", "precision", "p50_s", "p95_s", "p99_s", "tokens_per_s", "max_rel_dparam", "parity"]
    rows = [[r.label, r.strategy, r.precision, r.stats["p50"], r.stats["p95"], r.stats["p99"],
             r.stats["tokens_per_s"], result["parity"][r.label].get("max_rel"), result["parity"][r.label]["status"]]
            for r in runs]
    run.log({"summary": wandb.Table(columns=cols, data=rows)})
    run.finish()


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab compare",
                                description="compare zerolab runs: report.md + PNGs (loss, memory, time, comm, parity)")
    p.add_argument("paths", nargs="+", help="run directories and/or sweep directories")
    p.add_argument("--out", default="report", help="output directory (default: report/)")
    p.add_argument("--baseline", default=None, help="label or strategy of the baseline run (default: ddp)")
    p.add_argument("--wandb", default="runs", choices=["runs", "auto", "online", "offline", "disabled"],
                   help="log figures to wandb; 'runs' (default): as the runs were configured")
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
        result = build_report(args.paths, args.out, args.baseline, mode)
    except (FileNotFoundError, ValueError) as err:
        print(f"zerolab compare: {err}", file=sys.stderr)
        return 2
    print(result["table"])
    print(f"\nreport: {result['report']}")
    print("figures: " + " ".join(result["figures"].values()))
    bad = [k for k, v in result["parity"].items() if v["status"] == "MISMATCH"]
    if bad:
        print(f"parity MISMATCH against {result['baseline']}: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad and args.fail_on_mismatch else 0
