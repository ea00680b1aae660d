"""The report's PNGs (matplotlib, imported only when a figure is drawn), each labelled at its foot
with the day it was drawn and the zerolab commit that drew it."""
from __future__ import annotations

import datetime
import math
from pathlib import Path

from zerolab.accounting import CATEGORIES
from zerolab.report.load import NOT_CALLED
from zerolab.report.runs import TIME_PARTS, Run, series
from zerolab.report.volumes import comm_note, paper_factor


COLORS = {"params": "#4c72b0", "grads": "#dd8452", "master": "#55a868", "optim_state": "#c44e52", "buffers": "#8172b3"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def commit(root: Path = Path(__file__).resolve().parents[2]) -> str:
    """The short commit of the zerolab checkout at `root`, read from .git (no process), or "unknown"."""
    try:
        git = root / ".git"
        if git.is_file():  # a worktree or submodule: "gitdir: PATH"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            loose = git / ref
            if loose.exists():
                head = loose.read_text().strip()
            else:
                packed = (git / "packed-refs").read_text().splitlines()
                head = next(line.split()[0] for line in packed if line.endswith(" " + ref))
        return head[:7]
    except (OSError, StopIteration, IndexError):
        return "unknown"


def label() -> str:
    return f"zerolab {commit()}, {datetime.date.today().isoformat()}"


def _save(plt, fig, path: Path, bottom: float = 0.035) -> Path:
    """Every figure ends the same way: tight layout above its label (date and commit) and whatever
    the figure writes under its axes (`bottom`: the share of its height kept free), a PNG at 110
    dpi, the figure closed."""
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.text(0.995, 0.005, label(), ha="right", va="bottom", fontsize=7, color="#666666")
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
    ref = dict(series(base, "loss"))
    for i, r in enumerate(runs):
        # drawn first = drawn widest: a later run on the same curve leaves a rim of every earlier one
        wider = len(runs) - 1 - i
        style = dict(ls=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], label=r.label)
        wide = dict(ms=4 + 1.5 * wider, lw=1.2 + 0.8 * wider, alpha=0.9)
        s = series(r, "loss")
        every = max(1, len(s) // 8)
        stagger = (i * every // max(1, len(runs)), every)
        ax1.plot([x for x, _ in s], [y for _, y in s], markevery=stagger, **style, **wide)
        d = [(x, y - ref[x]) for x, y in s if x in ref]  # apart already: plain lines
        ax2.plot([x for x, _ in d], [y for _, y in d], markevery=stagger, ms=4, lw=1.2, **style)
    draw_eval(ax3, runs)
    ax1.set(title="train loss (mean over ranks)", xlabel="step", ylabel="loss")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set(title=f"train loss minus {base.label}'s", xlabel="step", ylabel="Δ loss")
    lo, hi = ax3.get_ylim()
    if hi - lo < 0.02:  # runs that agree to 1e-7 would fill the panel with their rounding: widen
        mid = (lo + hi) / 2
        ax3.set_ylim(mid - 0.01, mid + 0.01)
    ax3.ticklabel_format(axis="y", useOffset=False)
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
    return _save(plt, fig, out / "loss.png")


def draw_eval(ax, runs: list[Run]) -> None:
    """Eval loss as points, one marker per eval and run, never joined: a run evaluates a few times
    (the default job: steps 15 and 30), and a line between two evals would draw a curve that was
    never measured. Runs on the same value stay visible as markers of shrinking size."""
    for i, r in enumerate(runs):
        e = series(r, "eval_loss")
        ax.plot([x for x, _ in e], [y for _, y in e], ls="none", marker=MARKERS[i % len(MARKERS)],
                ms=5 + 1.5 * (len(runs) - 1 - i), alpha=0.9, label=r.label)
    ax.set(title="eval loss (each point one eval: not joined)", xlabel="step", ylabel="loss")


def plot_loss_diff(runs: list[Run], base: Run, out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ref = dict(series(base, "loss"))
    for i, r in enumerate(runs):
        if r is base:
            continue
        s = [(x, y - ref[x]) for x, y in series(r, "loss") if x in ref]
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
    colors = ["#4c72b0" if x["verdict"] in ("slower", "faster") else "#999999" for x in t]
    ax2.bar(ox, ratios, 0.6, color=colors, yerr=err, capsize=6, ecolor="k")
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    for x, v in zip(ox, t):
        ax2.annotate(v["verdict"], (x, v["hi"]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax2.set_xticks(ox, [r.label for r in others], fontsize=9, rotation=20, ha="right")
    if any(x["verdict"] == NOT_CALLED for x in t):
        caveat = "grey: not called (the machine was loaded: report.md says which job) or within noise"
    elif all(x["verdict"] == "within noise" for x in t):
        caveat = "all within noise: no run measurably differs"
    else:
        caveat = "grey: within noise (interval holds 1.0)"
    ax2.set(title=f"p50 ÷ {base.label}'s, 95 % bootstrap interval\n{caveat}", ylabel="ratio")
    ax2.margins(y=0.15)
    return _save(plt, fig, out / "step_time.png")


def comm_bars(runs: list[Run]) -> list[dict]:
    """Per run, what comm.png draws (MiB per step, rank 0): measured, data parallelism's 2Ψ(N−1)/N,
    the ZeRO paper's volume for its stage (3Ψ(N−1)/N for stage 3, else the same 2Ψ) and the note
    on why it sits where it does (zerolab.report.volumes)."""
    return [{"label": r.label, "measured": (r.stats["comm_per_step"][0] if r.stats["comm_per_step"] else 0) / 2**20,
             "two_psi": r.stats["comm_theory"] / 2**20, "paper": r.stats["comm_theory"] * paper_factor(r) / 2**20,
             "note": comm_note(r)} for r in runs]


def plot_comm(runs: list[Run], out: Path) -> Path:
    """Measured bytes beside the 2Ψ of data parallelism and, for stage-3 strategies, the paper's
    3Ψ; numbered notes under the axes say why a bar sits above 2Ψ (the paper's stage 3, or the
    implementation's own collectives)."""
    plt = _plt()
    bars = comm_bars(runs)
    notes = [(i, b) for i, b in enumerate(bars) if b["note"]]
    height = 4.8 + 0.15 * len(notes)  # inches: a line of 7-point text under the axes for each note
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(runs) + 3), height))
    for i, b in enumerate(bars):
        ax.bar(i - 0.27, b["measured"], 0.27, color="#4c72b0", label="measured (rank 0)" if i == 0 else None)
        ax.bar(i, b["two_psi"], 0.27, color="#bbbbbb", label="2Ψ(N−1)/N: data parallelism, ZeRO stages 1-2"
               if i == 0 else None)
        if b["paper"] > b["two_psi"]:
            ax.bar(i + 0.27, b["paper"], 0.27, color="#888888", hatch="//", edgecolor="white",
                   label="3Ψ(N−1)/N: the ZeRO paper's stage 3" if not any(
                       x["paper"] > x["two_psi"] for x in bars[:i]) else None)
    for k, (i, b) in enumerate(notes, 1):
        ax.annotate(f"[{k}]", (i - 0.27, b["measured"]), textcoords="offset points", xytext=(0, 2), ha="center",
                    fontsize=8)
    ax.set_xticks(range(len(runs)), [b["label"] for b in bars], fontsize=8, rotation=20, ha="right")
    ax.set(title="bytes sent per rank per step (× gradient bytes; Rajbhandari et al. 2019, §7)", ylabel="MiB")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="upper left")
    text = "\n".join(f"[{k}] {b['label']}: {b['note']}" for k, (_, b) in enumerate(notes, 1))
    if text:
        fig.text(0.01, 0.2 / height, text, ha="left", va="bottom", fontsize=7)
    return _save(plt, fig, out / "comm.png", bottom=(0.3 + 0.15 * len(notes)) / height)


PART_COLORS = {"compute_s": "#4c72b0", "optimizer_s": "#55a868", "comm_exposed_s": "#c44e52", "other_s": "#bbbbbb"}
PART_NAMES = {"compute_s": "compute (forward + backward)", "optimizer_s": "optimizer (clip + step)",
              "comm_exposed_s": "exposed communication", "other_s": "other (data, host work)"}


def plot_breakdown(runs: list[Run], out: Path) -> Path:
    """Stacked bars, one per run: its profiled steps' median compute, optimizer, exposed
    communication and other (they add up to the step's nearly), the step's own median and its 95 %
    interval as a black bar; above each bar, the time communication was in flight and the share of it
    hidden behind other work."""
    plt = _plt()
    shown = [r for r in runs if r.stats.get("breakdown")]
    fig, ax = plt.subplots(figsize=(max(9, 1.3 * len(shown) + 5), 4.8))
    for i, r in enumerate(shown):
        b, bottom = r.stats["breakdown"], 0.0
        for part in TIME_PARTS:
            v = b[part] * 1e3
            ax.bar(i, v, 0.6, bottom=bottom, color=PART_COLORS[part], label=PART_NAMES[part] if i == 0 else None)
            bottom += v
        lo, hi = (v * 1e3 for v in b["spread"]["step_s"])
        ax.errorbar(i, b["step_s"] * 1e3, yerr=[[b["step_s"] * 1e3 - lo], [hi - b["step_s"] * 1e3]], fmt="_",
                    color="k", capsize=4, label="step: median, 95 % interval" if i == 0 else None)
        bottom = max(bottom, hi)
        hidden = "—" if math.isnan(b["hidden"]) else f"{b['hidden'] * 100:.0f} %"
        ax.annotate(f"comm {b['comm_s'] * 1e3:.0f} ms\nhidden {hidden}", (i, bottom), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(range(len(shown)), [r.label for r in shown], fontsize=9, rotation=20, ha="right")
    ax.set(title="where the profiled steps go (median over steps and ranks)", ylabel="ms per step")
    ax.margins(y=0.18)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    return _save(plt, fig, out / "breakdown.png")
