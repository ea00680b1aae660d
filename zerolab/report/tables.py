"""The report's markdown tables and its line about the machine."""
from __future__ import annotations

import math
import os

from zerolab.accounting import CATEGORIES
from zerolab.report.load import NOT_CALLED
from zerolab.report.runs import PEAK_PARTS, Run
from zerolab.report.volumes import paper_factor

# Under the summary table, in the console and in report.md: what its marks and brackets mean.
LEGEND = ("~: within noise (the 95 % interval of p50 ÷ base holds 1); ?: not called (the "
          "machine was busier than its cores during a job of that run or of the baseline: the step-time lines say "
          "which). model states (pred): rank 0's measured model states (the ledger's prediction). comm (paper): "
          "bytes rank 0 sent per step, measured, and in brackets the ZeRO paper's volume for the strategy's stage, "
          "in gradient-sized bytes: 2Ψ(N−1)/N for data parallelism and stages 1-2 (the reference's all-reduce; a "
          "reduce-scatter and an all-gather), 3Ψ(N−1)/N for stage 3 (the parameters are gathered in forward and "
          "again in backward); above it is the implementation's own "
          "(comm.png says whose and why).")


def _f(v: float, fmt: str = "{:.4f}") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _mib(b: float) -> str:
    return _f(b / 2**20, "{:.2f}")


def summary_table(runs: list[Run], base: Run, par: dict[str, dict]) -> str:
    head = ("| run | final loss | eval loss | p50 ms | p95 ms | p99 ms | p50 ÷ base | tokens/s | "
            "model states MiB r0 (pred) | comm MiB/step r0 (paper) | max rel Δparam | parity |")
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
            f"{_mib(mem)} ({_mib(pred)})", f"{_mib(comm)} ({_mib(st['comm_theory'] * paper_factor(r))})",
            "baseline" if r is base else _f(p.get("max_rel", float("nan")), "{:.2e}"),
            "baseline" if r is base else p["status"]]) + " |")
    return "\n".join(lines)


def _ratio_cell(r: Run, base: Run) -> str:
    t = r.stats.get("timing", {})
    if r is base or not t or math.isnan(t.get("ratio", float("nan"))):
        return "1" if r is base else "—"
    mark = {"within noise": " ~", NOT_CALLED: " ?"}.get(t["verdict"], "")
    return f"{t['ratio']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}]{mark}"


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
        g = lambda key, fmt: _f(p.get(key, float("nan")), fmt)
        lines.append(f"| {r.label} | {g('d_eval_loss', '{:.2e}')} | {g('max_dlogit', '{:.2e}')} "
                     f"({g('rel_dlogit', '{:.1e}')}) | {g('max_rel', '{:.3e}')} | {p.get('worst', '')} | {noise} | "
                     f"{g('function_tol', '{:.0e}')} / {g('tol', '{:.0e}')} | **{p['status']}** |")
        if p.get("detail"):
            cause = f" Cause: {p['cause']}." if p.get("cause") else ""
            notes.append(f"- **{r.label}**: {p['detail'].rstrip('.')}.{cause}")
    return "\n".join(lines + ([""] + notes if notes else []))


def memory_table(runs: list[Run]) -> str:
    """Bytes per rank by category, and by place: the device's and the host's (offloaded states),
    measured, with the prediction of each place beside them."""
    lines = ["| run | rank | " + " | ".join(CATEGORIES) + " | device | host | predicted model states | "
             "predicted device / host |", "|" + "---|" * (len(CATEGORIES) + 6)]
    for r in runs:
        for rank, mem in enumerate(r.stats["mem"]):
            pred = r.stats["mem_pred"][rank] if rank < len(r.stats["mem_pred"]) else None
            pred_s = _mib(sum(pred.get(c, 0) for c in ("params", "grads", "master", "optim_state"))) if pred else "—"
            places = f"{_mib(pred.get('device', 0))} / {_mib(pred.get('host', 0))}" if pred else "—"
            lines.append(f"| {r.label} | {rank} | " + " | ".join(_mib(mem.get(c, 0)) for c in CATEGORIES) +
                         f" | {_mib(mem.get('device', 0))} | {_mib(mem.get('host', 0))} | {pred_s} | {places} |")
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

def breakdown_table(runs: list[Run]) -> str:
    """Where the profiled steps went, one row per run: the median of each of the four parts (they
    add up to the step in every step; their medians nearly), the step's, the time some collective was
    in flight, the share of it hidden, and MFU (median over the logged steps after the first); each
    median with its 95 % interval in brackets (rounds, then steps: zerolab.report.runs.breakdown)."""
    lines = ["| run | rounds × steps × ranks | step ms | compute ms | optimizer ms | exposed comm ms | worst rank's "
             "exposed ms | other ms | comm in flight ms | comm hidden | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        b = r.stats.get("breakdown")
        if not b:
            continue
        worst = max(x["comm_exposed_s"] for x in b["per_rank"])
        cell = lambda k: f"{_f(b[k] * 1e3, '{:.1f}')} [{_f(b['spread'][k][0] * 1e3, '{:.1f}')}, " \
                         f"{_f(b['spread'][k][1] * 1e3, '{:.1f}')}]"
        per_round = b["steps"] // max(b["rounds"], 1)
        lines.append(f"| {r.label} | {b['rounds']} × {per_round} × {len(b['per_rank'])} | {cell('step_s')} | "
                     f"{cell('compute_s')} | {cell('optimizer_s')} | {cell('comm_exposed_s')} | "
                     f"{_f(worst * 1e3, '{:.1f}')} | {cell('other_s')} | {cell('comm_s')} | "
                     f"{_f(b['hidden'] * 100, '{:.0f} %')} | "
                     f"{_f(r.stats.get('mfu', float('nan')) * 100, '{:.1f} %')} |")
    return "\n".join(lines)


def timing_table(runs: list[Run], base: Run) -> str:
    lines = [f"| run | rounds × steps timed | p50 ms | p50 ÷ {base.label} | 95 % interval | per round | verdict |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for r in runs:
        t = r.stats["timing"]
        n = f"{len(r.stats['rounds'])} × {'/'.join(str(len(x)) for x in r.stats['rounds'])}"
        if r is base:
            lines.append(f"| {r.label} | {n} | {_f(r.stats['p50'] * 1e3, '{:.1f}')} | 1 | — | — | baseline |")
            continue
        rounds = " / ".join(f"{v:.3f}" for v in t.get("round_ratios", {}).values()) or "—"
        lines.append(f"| {r.label} | {n} | {_f(r.stats['p50'] * 1e3, '{:.1f}')} | {_f(t['ratio'], '{:.3f}')} | "
                     f"[{_f(t['lo'], '{:.3f}')}, {_f(t['hi'], '{:.3f}')}] | {rounds} | **{t['verdict']}** |")
        if t.get("why"):
            notes.append(f"- **{r.label}**: {t['verdict']} (the interval alone: {t['interval_verdict']}): {t['why']}.")
    return "\n".join(lines + ([""] + notes if notes else []))


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
