"""`python -m zerolab compare RUNS_OR_SWEEPS... --out report/`: strategies side by side.

Reads zerolab run directories (config.yaml, metrics.jsonl, summary.json, model.safetensors) —
given directly or found inside sweep directories — and writes report.md plus PNGs:

  loss.png       train loss (each run its own line style and markers), Δ against the baseline, eval loss
  loss_diff.png  per-step train loss minus the baseline's (the reference strategy unless --baseline)
  memory.png     per-rank measured bytes by category, stacked; the predicted ledger below each
  step_time.png  step time p50 / p95 / p99, and p50 ÷ baseline with its bootstrap interval
  comm.png       measured bytes sent per rank per step against 2Ψ(N−1)/N (zerolab.comm)
a parity table (function space first: Δ of the fixed held-out losses and logits each run saved
with zerolab.digest; then the final weights, with elements whose gradient is at rounding-noise
level listed apart; a mismatch names what differs and a cause zerolab knows), and a step-time
table (ratio to the baseline with a bootstrap interval over steps and rounds: "within noise"
unless it excludes 1.0). report.json carries all of it. With wandb on, the same figures and
tables are logged to one run (job_type=report) in the sweep's group.
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
from zerolab.precision import COMPUTE_BYTES as GRAD_BYTES  # gradients travel in the compute dtype
from zerolab.stats import percentile

# Parity tolerance on max relative |Δparam| against a baseline of the same precision. fp32 runs
# of the same math agree to ~1e-7 (tests); 16-bit runs round differently on every path, so
# their figure is shown for information with a loose bound.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-2, "bf16_pure": 5e-2}
# Function-space tolerance on max |Δlogit| of the fixed held-out batches, relative to the
# baseline's max |logit|. fp32 weights that agree to ~1e-7 (above) move logits by about as much
# after a few layers; 1e-4 leaves three orders of magnitude for that while a real difference
# (DeepSpeed + a client LAMB: weights 4e-2 apart) is far above it.
FUNCTION_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2, "bf16_pure": 5e-2}
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "master": "#55a868", "optim_state": "#c44e52", "buffers": "#8172b3"}


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict]
    summary: dict
    label: str = ""
    stats: dict = field(default_factory=dict)
    round: int = 0  # the sweep round (hydra.launcher.rounds) this run belongs to
    repeats: list["Run"] = field(default_factory=list)  # the same job in later rounds: timings pooled

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
                jobs = sorted(json.loads(index.read_text())["jobs"], key=lambda j: (j.get("round", 0), j["num"]))
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


def _strategy_class(name: str):
    """The run's strategy class (its label, known causes, whether it is the reference), or None
    for a strategy this zerolab does not know (a run from another version)."""
    from zerolab.strategies import REGISTRY, strategy_class

    return strategy_class(name) if name in REGISTRY else None


def label_runs(runs: list[Run]) -> None:
    for r in runs:
        cls = _strategy_class(r.strategy)
        r.label = cls.label(r.config.get("strategy", {})) if cls else r.strategy
    if len({r.precision for r in runs}) > 1:
        for r in runs:
            r.label += f"-{r.precision}"
    seen: dict[tuple, int] = {}
    for r in runs:  # two runs with the same settings in one round: tell them apart by directory
        seen[r.label, r.round] = seen.get((r.label, r.round), 0) + 1
    for r in runs:
        if seen[r.label, r.round] > 1:
            r.label += f" ({r.path.name})"


def merge_rounds(runs: list[Run]) -> list[Run]:
    """One entry per job: a later round's run of the same label joins the first as a repeat."""
    first: dict[str, Run] = {}
    for r in sorted(runs, key=lambda r: r.round):  # stable: round 0's order is kept
        if r.label in first:
            first[r.label].repeats.append(r)
        else:
            first[r.label] = r
    return [r for r in runs if r.label in first and first[r.label] is r]


def sweep_info(paths: list[str]) -> tuple[dict[Path, int], list[dict]]:
    """Round of each run directory, and each sweep's machine-load record (from sweep.json)."""
    rounds, loads = {}, []
    for p in map(Path, paths):
        index = p / "sweep.json"
        if index.exists():
            sweep = json.loads(index.read_text())
            for j in sweep["jobs"]:
                rounds[Path(j["run_dir"]).resolve()] = int(j.get("round", 0))
            if "loadavg" in sweep:
                loads.append({"sweep": p.name, **sweep["loadavg"]})
    return rounds, loads


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


PEAK_PARTS = ("model_states", "activations", "transient")


def _rank_peaks(run: Run, prefix: str) -> list[dict[str, float]]:
    """Per-rank step peak and its split (`rank{r}/<prefix>/peak_<part>_bytes`, zerolab.memory.peak)
    from the last record that has them; prefix mem (measured) or mem_pred (predicted)."""
    for m in reversed(run.metrics):
        if f"rank0/{prefix}/peak_bytes" in m:
            return [{"peak": m.get(f"rank{r}/{prefix}/peak_bytes"),
                     **{p: m.get(f"rank{r}/{prefix}/peak_{p}_bytes") for p in PEAK_PARTS}} for r in range(run.world)]
    return []


def step_times(run: Run) -> list[float]:
    """Logged step times, the first step (warm-up) left out."""
    return [t for s, t in _series(run, "step_time_s") if s > 1] or [t for _, t in _series(run, "step_time_s")]


def compute_stats(run: Run) -> None:
    rounds = [step_times(x) for x in [run, *run.repeats]]
    times = [t for r in rounds for t in r]  # pooled over rounds
    tokens = [t for x in [run, *run.repeats] for s, t in _series(x, "tokens_per_s") if s > 1]
    comm = [[v for s, v in _series(run, f"rank{r}/comm_bytes") if s > 1] for r in range(run.world)]
    n_params = run.summary.get("n_params") or 0
    st = run.stats
    st["rounds"] = rounds
    st["p50"] = percentile(times, 50) if times else float("nan")
    st["p95"] = percentile(times, 95) if times else float("nan")
    st["p99"] = percentile(times, 99) if times else float("nan")
    st["tokens_per_s"] = statistics.median(tokens) if tokens else float("nan")
    st["comm_per_step"] = [statistics.mean(c) if c else float("nan") for c in comm]
    st["comm_theory"] = theory_bytes_per_step(n_params, GRAD_BYTES.get(run.precision, 4), run.world)
    st["mem"] = _rank_figures(run, "mem")
    st["mem_pred"] = _rank_figures(run, "mem_pred")
    st["peak"], st["peak_pred"] = _rank_peaks(run, "mem"), _rank_peaks(run, "mem_pred")
    train = _series(run, "loss")
    st["final_loss"] = train[-1][1] if train else float("nan")
    ev = _series(run, "eval_loss")
    st["eval_loss"] = ev[-1][1] if ev else float("nan")


# ---- parity --------------------------------------------------------------------------------
def _load(path: Path) -> Optional[dict]:
    from safetensors.torch import load_file

    return load_file(str(path)) if path.exists() else None


def function_parity(run: Run, base: Run) -> Optional[dict]:
    """Δ of the end-of-run digest (zerolab.digest): the same fixed held-out batches through both
    final models. None when either run has no digest (runs from before it existed)."""
    a, b = _load(run.path / "eval_logits.safetensors"), _load(base.path / "eval_logits.safetensors")
    if a is None or b is None or a.keys() != b.keys():
        return None
    keys = [k for k in a if k.startswith("logits/")]
    if any(a[k].shape != b[k].shape for k in keys):
        return None
    d_logit = max((a[k].double() - b[k].double()).abs().max().item() for k in keys)
    scale = max(b[k].double().abs().max().item() for k in keys)
    d_loss = (a["loss"].double() - b["loss"].double()).abs().max().item()
    return {"max_dlogit": d_logit, "rel_dlogit": d_logit / max(scale, 1e-12), "d_eval_loss": d_loss}


def noise_elements(run: Run) -> Optional[dict]:
    """{tensor: flat indices} of elements whose gradient is at fp32 rounding level (the run's
    grad_noise.safetensors), or None when the run did not probe."""
    found = _load(run.path / "grad_noise.safetensors")
    return None if found is None else {k: v for k, v in found.items() if k != "_none"}


def known_cause(run: Run, base: Run) -> str:
    """A cause zerolab knows for a real difference, or ''."""
    for r in (run, base):
        cls = _strategy_class(r.strategy)
        cause = cls.known_cause(r.config) if cls else ""
        if cause:
            return f"{r.label}: {cause}"
    return ""


def parity(run: Run, base: Run) -> dict:
    """Function space first (Δ of the fixed held-out logits and losses), then the final weights:
    max |Δ| and max relative |Δ| (per tensor: max|Δ| / max|base|) over elements whose gradient is
    not at rounding-noise level; those are shown apart (see zerolab.digest)."""
    import torch

    a, b = _load(run.path / "model.safetensors"), _load(base.path / "model.safetensors")
    if a is None or b is None:
        return {"status": "no weights"}
    if a.keys() != b.keys():
        return {"status": "MISMATCH", "detail": f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}",
                "max_abs": float("inf"), "max_rel": float("inf"), "worst": "", "tol": 0.0}
    na, nb = noise_elements(run), noise_elements(base)
    noise = {k: torch.unique(torch.cat([x[k] for x in (na, nb) if x and k in x])) for k in {*(na or {}), *(nb or {})}}
    worst, max_abs, max_rel, rel_by, noise_rows = "", 0.0, 0.0, {}, []
    for k in a:
        x, y = a[k].double().flatten(), b[k].double().flatten()
        if a[k].shape != b[k].shape:
            return {"status": "MISMATCH", "detail": f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}",
                    "max_abs": float("inf"), "max_rel": float("inf"), "worst": k, "tol": 0.0}
        diff = (x - y).abs()
        scale = max(y.abs().max().item(), 1e-12)
        if k in noise:
            idx = noise[k]
            noise_rows.append({"tensor": k, "elements": int(idx.numel()), "of": int(diff.numel()),
                               "max_abs": diff[idx].max().item(), "max_rel": diff[idx].max().item() / scale})
            keep = torch.ones_like(diff, dtype=torch.bool)
            keep[idx] = False
            diff = diff[keep]
        d = diff.max().item() if diff.numel() else 0.0
        rel_by[k] = d / scale
        max_abs = max(max_abs, d)
        if rel_by[k] > max_rel or not worst:
            worst, max_rel = k, rel_by[k]
    same_prec = run.precision == base.precision
    tol = TOLERANCE.get(run.precision, 1e-5) if same_prec else float("nan")
    ftol = FUNCTION_TOLERANCE.get(run.precision, 1e-4) if same_prec else float("nan")
    fn = function_parity(run, base)
    out = {"max_abs": max_abs, "max_rel": max_rel, "worst": worst, "tol": tol, "function_tol": ftol,
           "noise_level": noise_rows, "noise_probe": na is not None or nb is not None, **(fn or {})}
    same = [(run.summary.get(k), base.summary.get(k)) for k in ("steps", "global_batch", "model", "optimizer")]
    if not same_prec:
        out["status"] = "n/a (precision differs)"
        return out
    if any(x != y for x, y in same):
        out["status"] = "n/a (steps/batch/model/optimizer differ)"
        return out
    off = sorted((k for k, r in rel_by.items() if r > tol), key=lambda k: -rel_by[k])
    fn_off = fn is not None and fn["rel_dlogit"] > ftol
    out["status"] = "MISMATCH" if off or fn_off else "match"
    if out["status"] == "MISMATCH":
        what = []
        if fn is not None:
            what.append(f"function: max |Δlogit| {fn['max_dlogit']:.2e} ({fn['rel_dlogit']:.1e} of the logit "
                        f"scale), Δeval-loss {fn['d_eval_loss']:.2e}" + ("" if fn_off else " (within tolerance)"))
        if off:
            what.append(f"{len(off)} tensor(s) above {tol:.0e}: " +
                        ", ".join(f"{k} {rel_by[k]:.1e}" for k in off[:3]) + (" ..." if len(off) > 3 else ""))
        cause = known_cause(run, base)
        out["detail"] = "; ".join(what)
        if cause:
            out["cause"] = cause
    return out


# ---- timing with its noise ----------------------------------------------------------------
BOOTSTRAP_REPS = 2000
INTERVAL = 0.95


def bootstrap_ratio(rounds: list[list[float]], base_rounds: list[list[float]], reps: int = BOOTSTRAP_REPS,
                    seed: int = 0) -> dict:
    """p50 step time over the baseline's, with a 95 % percentile-bootstrap interval. Each replicate
    resamples rounds (with replacement), then steps within each drawn round, for both runs; so
    the interval holds the spread between steps and, when the sweep ran several rounds, between
    rounds. A fixed seed: the same data always gives the same interval and verdict."""
    import numpy as np

    rounds, base_rounds = [r for r in rounds if r], [r for r in base_rounds if r]
    if not rounds or not base_rounds:
        return {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"), "verdict": "no timings"}
    rng = np.random.default_rng(seed)

    def resample(rs: list[list[float]]):
        """`reps` bootstrap medians: draw rounds, then steps within each drawn round."""
        table = np.full((len(rs), max(map(len, rs))), np.nan)
        for i, r in enumerate(rs):
            table[i, :len(r)] = r
        lens = np.array([len(r) for r in rs])
        drawn = rng.integers(0, len(rs), (reps, len(rs)))  # rounds, with replacement
        n = lens[drawn][..., None]  # the drawn round's step count
        steps = (rng.random((reps, len(rs), table.shape[1])) * n).astype(int)
        values = table[drawn[..., None], steps]
        values[np.arange(table.shape[1]) >= n] = np.nan  # a short round contributes only its own count
        return np.nanmedian(values.reshape(reps, -1), axis=1)

    ratios = np.sort(resample(rounds) / resample(base_rounds))
    lo, hi = float(ratios[int((1 - INTERVAL) / 2 * reps)]), float(ratios[int((1 + INTERVAL) / 2 * reps) - 1])
    ratio = statistics.median([t for r in rounds for t in r]) / statistics.median([t for r in base_rounds for t in r])
    return {"ratio": ratio, "lo": lo, "hi": hi, "verdict": timing_verdict(lo, hi),
            "rounds": len(rounds), "steps": sum(map(len, rounds))}


def timing_verdict(lo: float, hi: float) -> str:
    """'within noise' unless the interval excludes 1.0."""
    return "slower" if lo > 1.0 else "faster" if hi < 1.0 else "within noise"


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


STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*"]


def plot_loss(runs: list[Run], base: Run, out: Path) -> Path:
    """Train loss, its difference from the baseline, and eval loss. Runs that agree draw the same
    curve: each run gets its own line style, marker and width (earlier runs wider, markers at
    staggered steps) so every one stays visible, and the middle panel (Δ against the baseline)
    shows how far apart they are."""
    plt = _plt()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    ref = dict(_series(base, "loss"))
    for i, r in enumerate(runs):
        # drawn first = drawn widest: a later run on the same curve leaves a rim of every earlier one
        wider = len(runs) - 1 - i
        style = dict(ls=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], label=r.label)
        wide = dict(ms=4 + 1.5 * wider, lw=1.2 + 0.8 * wider, alpha=0.9)
        s = _series(r, "loss")
        every = max(1, len(s) // 8)
        stagger = (i * every // max(1, len(runs)), every)
        ax1.plot([x for x, _ in s], [y for _, y in s], markevery=stagger, **style, **wide)
        d = [(x, y - ref[x]) for x, y in s if x in ref]  # apart already: plain lines
        ax2.plot([x for x, _ in d], [y for _, y in d], markevery=stagger, ms=4, lw=1.2, **style)
        e = _series(r, "eval_loss")
        ax3.plot([x for x, _ in e], [y for _, y in e], **style, **wide)
    ax1.set(title="train loss (mean over ranks)", xlabel="step", ylabel="loss")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set(title=f"train loss minus {base.label}'s", xlabel="step", ylabel="Δ loss")
    ax3.set(title="eval loss", xlabel="step", ylabel="loss")
    lo, hi = ax3.get_ylim()
    if hi - lo < 0.02:  # runs that agree to 1e-7 would fill the panel with their rounding: widen
        mid = (lo + hi) / 2
        ax3.set_ylim(mid - 0.01, mid + 0.01)
    ax3.ticklabel_format(axis="y", useOffset=False)
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
    return _save(plt, fig, out / "loss.png")


def plot_loss_diff(runs: list[Run], base: Run, out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ref = dict(_series(base, "loss"))
    for i, r in enumerate(runs):
        if r is base:
            continue
        s = [(x, y - ref[x]) for x, y in _series(r, "loss") if x in ref]
        ax.plot([x for x, _ in s], [y for _, y in s], label=r.label, lw=1.2, ls=STYLES[i % len(STYLES)],
                marker=MARKERS[i % len(MARKERS)], ms=4, markevery=max(1, len(s) // 8))
    ax.axhline(0, color="k", lw=0.6)
    ax.set(title=f"train loss minus {base.label}'s, per step", xlabel="step", ylabel="Δ loss")
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "loss_diff.png")


def plot_memory(runs: list[Run], out: Path) -> Path:
    """Horizontal stacked bars, grouped per run: for each rank the measured bytes and, right
    below, the predicted ledger, each bar labelled with its run, rank and kind."""
    plt = _plt()
    rows = []  # (label, categories, predicted?), top to bottom; None: a gap between runs
    for r in runs:
        for rank, mem in enumerate(r.stats["mem"]):
            rows.append((f"{r.label} · rank {rank} · measured", mem, False))
            if rank < len(r.stats["mem_pred"]):
                rows.append((f"{r.label} · rank {rank} · predicted", r.stats["mem_pred"][rank], True))
        rows.append(None)
    rows = rows[:-1]
    fig, ax = plt.subplots(figsize=(11, max(3.5, 0.32 * len(rows) + 1.5)))
    ys = list(range(len(rows)))[::-1]
    seen = set()
    for y, row in zip(ys, rows):
        if row is None:
            continue
        _, mem, predicted = row
        left = 0.0
        for c in CATEGORIES:
            v = mem.get(c, 0) / 2**20
            ax.barh(y, v, left=left, color=COLORS[c], alpha=0.5 if predicted else 1.0, height=0.8,
                    hatch="//" if predicted else None, edgecolor="white", label=None if c in seen else c)
            seen.add(c)
            left += v
        ax.text(left, y, f" {left:.2f}", va="center", fontsize=8)
    ax.set_yticks([y for y, row in zip(ys, rows) if row], [row[0] for row in rows if row], fontsize=9)
    ax.set(title="model states per rank by category (solid: measured; hatched, faded: predicted ledger)",
           xlabel="MiB")
    ax.margins(x=0.12)
    ax.legend(fontsize=8, loc="lower right")
    return _save(plt, fig, out / "memory.png")


def plot_step_time(runs: list[Run], base: Run, out: Path) -> Path:
    """Left: p50 step time per run (p95, p99 as markers). Right: p50 over the baseline's with its
    95 % bootstrap interval; a caveat in the title when every interval holds 1.0."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(11, 1.6 * len(runs) + 4), 4.8))
    xs = list(range(len(runs)))
    ax1.bar(xs, [r.stats["p50"] * 1e3 for r in runs], 0.6, color="#4c72b0", label="p50")
    ax1.scatter(xs, [r.stats["p95"] * 1e3 for r in runs], marker="_", s=300, color="#dd8452", label="p95", zorder=3)
    ax1.scatter(xs, [r.stats["p99"] * 1e3 for r in runs], marker="_", s=300, color="#c44e52", label="p99", zorder=3)
    ax1.set_xticks(xs, [r.label for r in runs], fontsize=9, rotation=20, ha="right")
    ax1.set(title="step time (first step excluded)", ylabel="ms")
    ax1.legend(fontsize=8)
    others = [r for r in runs if r is not base]
    t = [r.stats["timing"] for r in others]
    ox = list(range(len(others)))
    ratios = [x["ratio"] for x in t]
    err = [[max(0.0, x["ratio"] - x["lo"]) for x in t], [max(0.0, x["hi"] - x["ratio"]) for x in t]]
    colors = ["#999999" if x["verdict"] == "within noise" else "#4c72b0" for x in t]
    ax2.bar(ox, ratios, 0.6, color=colors, yerr=err, capsize=6, ecolor="k")
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    for x, v in zip(ox, t):
        ax2.annotate(v["verdict"], (x, v["hi"]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax2.set_xticks(ox, [r.label for r in others], fontsize=9, rotation=20, ha="right")
    caveat = "all within noise: no run measurably differs" if all(x["verdict"] == "within noise" for x in t) \
        else "grey: within noise (interval holds 1.0)"
    ax2.set(title=f"p50 ÷ {base.label}'s, 95 % bootstrap interval\n{caveat}", ylabel="ratio")
    ax2.margins(y=0.15)
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
            _ratio_cell(r, base), _f(st["tokens_per_s"], "{:.0f}"),
            f"{_mib(mem)} ({_mib(pred)})", f"{_mib(comm)} ({_mib(st['comm_theory'])})",
            "baseline" if r is base else _f(p.get("max_rel", float("nan")), "{:.2e}"),
            "baseline" if r is base else p["status"]]) + " |")
    return "\n".join(lines)


def _ratio_cell(r: Run, base: Run) -> str:
    t = r.stats.get("timing", {})
    if r is base or not t or math.isnan(t.get("ratio", float("nan"))):
        return "1" if r is base else "—"
    return f"{t['ratio']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}]" + (" ~" if t["verdict"] == "within noise" else "")


def parity_table(runs: list[Run], base: Run, par: dict[str, dict]) -> str:
    lines = [f"| run (vs {base.label}) | Δeval-loss | max abs Δlogit (rel) | max rel Δparam | worst tensor | "
             "noise-level elements (max rel Δ) | tolerance fn / weights | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in runs:
        if r is base:
            continue
        p = par[r.label]
        nl = p.get("noise_level", [])
        noise = ", ".join(f"{n['tensor']} {n['elements']}/{n['of']} ({n['max_rel']:.1e})" for n in nl) or \
            ("none" if p.get("noise_probe") else "not probed")
        lines.append(f"| {r.label} | {_f(p.get('d_eval_loss', float('nan')), '{:.2e}')} | "
                     f"{_f(p.get('max_dlogit', float('nan')), '{:.2e}')} ({_f(p.get('rel_dlogit', float('nan')), '{:.1e}')}) | "
                     f"{_f(p.get('max_rel', float('nan')), '{:.3e}')} | {p.get('worst', '')} | {noise} | "
                     f"{_f(p.get('function_tol', float('nan')), '{:.0e}')} / {_f(p.get('tol', float('nan')), '{:.0e}')} | "
                     f"**{p['status']}** |")
        if p.get("detail"):
            notes.append(f"- **{r.label}**: {p['detail'].rstrip('.')}." + (f" Cause: {p['cause']}." if p.get("cause") else ""))
    return "\n".join(lines + ([""] + notes if notes else []))


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


def peak_table(runs: list[Run]) -> str:
    """The step's peak per rank, split into model states, activations and transient: measured
    (zerolab's accounting; CPU) against predicted (the planner's composition), MiB."""
    cell = lambda v: _mib(v) if isinstance(v, (int, float)) else "—"
    lines = ["| run | rank | peak | model states | activations | transient | predicted peak (states / acts / "
             "transient) | measured ÷ predicted |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for rank, got in enumerate(r.stats.get("peak", [])):
            want = r.stats["peak_pred"][rank] if rank < len(r.stats.get("peak_pred", [])) else {}
            ratio = f"{got['peak'] / want['peak']:.3f}" if want.get("peak") and got.get("peak") is not None else "—"
            lines.append(f"| {r.label} | {rank} | {cell(got['peak'])} | " + " | ".join(cell(got[p]) for p in PEAK_PARTS)
                         + f" | {cell(want.get('peak'))} (" + " / ".join(cell(want.get(p)) for p in PEAK_PARTS)
                         + f") | {ratio} |")
    return "\n".join(lines)


# ---- the report ----------------------------------------------------------------------------
def build_report(paths: list[str], out: str, baseline: Optional[str] = None, wandb_mode: str = "disabled") -> dict:
    dirs = find_run_dirs(paths)
    if not dirs:
        raise FileNotFoundError(f"no run directories (with metrics.jsonl) under {', '.join(paths)}")
    rounds, loads = sweep_info(paths)
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
        base = next((r for r in runs if getattr(_strategy_class(r.strategy), "reference", False)), runs[0])
    for r in runs:
        r.stats["timing"] = bootstrap_ratio(r.stats["rounds"], base.stats["rounds"])
    par = {r.label: ({"status": "baseline"} if r is base else parity(r, base)) for r in runs}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {"loss": plot_loss(runs, base, out_dir), "loss_diff": plot_loss_diff(runs, base, out_dir),
               "memory": plot_memory(runs, out_dir), "step_time": plot_step_time(runs, base, out_dir),
               "comm": plot_comm(runs, out_dir)}
    table, ptable, mtable = summary_table(runs, base, par), parity_table(runs, base, par), memory_table(runs)
    ttable, machine = timing_table(runs, base), machine_line(runs, loads)
    b = base.summary
    conditions = (f"{b.get('model', '?')} ({b.get('n_params', '?')} params), world {base.world}, "
                  f"global batch {b.get('global_batch', '?')}, {b.get('steps', '?')} steps, "
                  f"optimizer {b.get('optimizer', '?')}; baseline: {base.label}")
    md = [f"# Strategy comparison\n\n{conditions}\n\n{machine}\n",
          "Step times exclude the first step; p50 ÷ base is the median step time over the baseline's, "
          "with its 95 % bootstrap interval (~: within noise). Memory is the measured model states on rank 0 (the predicted "
          "ledger in brackets, when the run logged one). Comm is bytes sent by rank 0 per step, ring-cost "
          "model, against 2Ψ(N−1)/N × gradient bytes.\n", table,
          "\n## Parity\n",
          "Function space first: every run evaluated the same fixed held-out batches at the end "
          "(zerolab.digest); Δeval-loss is the largest per-batch loss difference, max abs Δlogit the "
          "largest logit difference (in brackets: relative to the baseline's largest logit). Then the "
          "final weights: max rel Δparam = max over tensors of max|Δ| / max|baseline|, over elements whose "
          "gradient fp32 can resolve. Elements whose gradient is at rounding-noise level (found by each "
          "run's float64/fp32 gradient probe, e.g. the key third of attn.qkv.bias, whose true gradient is "
          "zero) drift apart under any change of summation order: they are listed apart, with their Δ, and "
          "do not decide the verdict. Tolerances: fp32 1e-4 (function) / 1e-5 (weights); 16-bit loosely.\n",
          ptable, "\n## Step time against the baseline\n",
          "Ratio of p50 step times with a 95 % bootstrap interval (resampling rounds, then steps within "
          "them; seeded, so the same data gives the same verdict). \"within noise\" unless the interval "
          "excludes 1.0. With one round the interval holds only the spread between steps of each run, "
          "not a change of the machine's load between runs: run the sweep with hydra.launcher.rounds=2 "
          "(or more) to pool rounds in alternating order.\n", ttable,
          "\n## Memory per rank (MiB)\n", mtable,
          "\n## Peak memory of a step per rank (MiB)\n",
          "Measured: the model states the strategy holds + the activations saved for backward (measured) + the "
          "transients of the same moment (the loss's logits buffers, a recomputed block with checkpointing, the "
          "buffers the strategy recorded); predicted: the planner's composition for the run (zerolab/memory/peak.py).\n",
          peak_table(runs), "\n## Figures\n"]
    md += [f"![{k}]({p.name})" for k, p in figures.items()]
    md += ["\n## Runs\n"] + [f"- {r.label}: `{r.path}`" + "".join(f", `{x.path}`" for x in r.repeats) for r in runs]
    (out_dir / "report.md").write_text("\n".join(md) + "\n")
    result = {"report": str(out_dir / "report.md"), "figures": {k: str(v) for k, v in figures.items()},
              "table": table, "parity": par, "baseline": base.label, "runs": [r.label for r in runs],
              "timing": {r.label: r.stats["timing"] for r in runs}, "machine": machine, "loadavg": loads}
    (out_dir / "report.json").write_text(json.dumps({k: v for k, v in result.items() if k != "table"},
                                                    indent=2, default=str))
    if wandb_mode != "disabled":
        log_to_wandb(runs, result, wandb_mode, paths)
    return result


def timing_table(runs: list[Run], base: Run) -> str:
    lines = [f"| run | rounds × steps timed | p50 ms | p50 ÷ {base.label} | 95 % interval | verdict |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        t = r.stats["timing"]
        n = f"{len(r.stats['rounds'])} × {'/'.join(str(len(x)) for x in r.stats['rounds'])}"
        if r is base:
            lines.append(f"| {r.label} | {n} | {_f(r.stats['p50'] * 1e3, '{:.1f}')} | 1 | — | baseline |")
            continue
        lines.append(f"| {r.label} | {n} | {_f(r.stats['p50'] * 1e3, '{:.1f}')} | {_f(t['ratio'], '{:.3f}')} | "
                     f"[{_f(t['lo'], '{:.3f}')}, {_f(t['hi'], '{:.3f}')}] | **{t['verdict']}** |")
    return "\n".join(lines)


def machine_line(runs: list[Run], loads: list[dict]) -> str:
    """What the machine was doing: load averages around the sweep (from the launcher), else at
    the end of each run (from its digest)."""
    def la(v) -> str:
        return "/".join(f"{x:.2f}" for x in v)

    head = f"Machine: {os.cpu_count()} cores here (report host). "
    if loads:
        return head + "Load average (1/5/15 min) " + "; ".join(
            f"{x['sweep']}: before {la(x['before'])}, after {la(x.get('after', []))}" for x in loads) + "."
    ends = [(r.label, r.summary.get("eval_digest", {}).get("loadavg_end")) for r in runs]
    ends = [(k, v) for k, v in ends if v]
    return head + ("Load average (1/5/15 min) at the end of each run: " +
                   ", ".join(f"{k} {la(v)}" for k, v in ends) + "." if ends else "Load average: not recorded.")


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
    run.finish()


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab compare",
                                description="compare zerolab runs: report.md + PNGs (loss, memory, time, comm, parity)")
    p.add_argument("paths", nargs="+", help="run directories and/or sweep directories")
    p.add_argument("--out", default="report", help="output directory (default: report/)")
    p.add_argument("--baseline", default=None, help="label or strategy of the baseline run (default: the reference strategy's run)")
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
    print(result["machine"])
    for k, t in result["timing"].items():
        if k != result["baseline"] and t["verdict"] != "no timings":
            print(f"step time {k}: {t['ratio']:.3f} x {result['baseline']} "
                  f"[{t['lo']:.3f}, {t['hi']:.3f}] {t['verdict']}")
    bad = [k for k, v in result["parity"].items() if v["status"] == "MISMATCH"]
    if bad:
        print(f"parity MISMATCH against {result['baseline']}: {', '.join(bad)}", file=sys.stderr)
        for k in bad:
            v = result["parity"][k]
            print(f"  {k}: {v.get('detail', '')}" + (f"; cause: {v['cause']}" if v.get("cause") else ""),
                  file=sys.stderr)
    return 1 if bad and args.fail_on_mismatch else 0
