"""Loading run directories for the report: one Run per run (config, metrics, summary), labels,
launcher rounds merged into one Run, and the per-run statistics the tables and figures read."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from zerolab.comm import theory_bytes_per_step
from zerolab.accounting import CATEGORIES
from zerolab.memory.peak import PARTS as PEAK_PARTS  # the split the trainer logs as mem/peak_<part>_bytes
from zerolab.precision import COMPUTE_BYTES as GRAD_BYTES  # gradients travel in the compute dtype
from zerolab.report.intervals import median_interval
from zerolab.stats import percentile


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

    from zerolab.run.metrics import read_jsonl

    cfg = OmegaConf.to_container(OmegaConf.load(path / "config.yaml")) if (path / "config.yaml").exists() else {}
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
    return Run(path, cfg, read_jsonl(str(path / "metrics.jsonl")), summary)


def strategy_class(name: str):
    """The run's strategy class (its label, known causes, whether it is the reference), or None
    for a strategy this zerolab does not know (a run from another version)."""
    from zerolab.strategies import REGISTRY, strategy_class

    return strategy_class(name) if name in REGISTRY else None


def label_runs(runs: list[Run]) -> None:
    for r in runs:
        cls = strategy_class(r.strategy)
        s = r.config.get("strategy", {})
        r.label = cls.label(s) if cls else r.strategy
        # offload, as the planner names its rows: a run beside the same strategy without it is another job
        r.label += ("+offload" if s.get("offload_optimizer") or s.get("offload_params") else "") + \
            ("+p" if s.get("offload_params") else "")
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


def series(run: Run, key: str) -> list[tuple[int, float]]:
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
            return [_placed({c: m.get(f"rank{r}/{prefix}/{c}_bytes", 0) for c in CATEGORIES},
                            m.get(f"rank{r}/{prefix}/host_bytes", 0)) for r in range(run.world)]
    if prefix == "mem_pred":
        pred = run.summary.get("memory_ledger", {}).get("predicted_bytes_per_rank")
        if pred:
            return [_placed({c: p.get(c, 0) for c in CATEGORIES}, p.get("host", 0)) for p in pred]
    return []


def _placed(by_category: dict, host: float) -> dict:
    """Bytes by category with the places added: host (offloaded states; 0 in a run without them, or
    recorded before places were) and device, the rest."""
    return {**by_category, "host": host or 0, "device": sum(by_category.values()) - (host or 0)}




def _rank_peaks(run: Run, prefix: str) -> list[dict[str, float]]:
    """Per-rank step peak and its split (`rank{r}/<prefix>/peak_<part>_bytes`, zerolab.memory.peak)
    from the last record that has them; prefix mem (measured) or mem_pred (predicted)."""
    for m in reversed(run.metrics):
        if f"rank0/{prefix}/peak_bytes" in m:
            return [{"peak": m.get(f"rank{r}/{prefix}/peak_bytes"),
                     **{p: m.get(f"rank{r}/{prefix}/peak_{p}_bytes") for p in PEAK_PARTS}} for r in range(run.world)]
    return []


def step_times(run: Run) -> list[float]:
    """Logged step times, the first step (warm-up) left out. Profiled steps stay in: on CPU without a
    trace their profiling costs about nothing (bench/step_profile.py, bench/RESULTS.md)."""
    return [t for s, t in series(run, "step_time_s") if s > 1] or [t for _, t in series(run, "step_time_s")]


TIME_PARTS = ("compute_s", "optimizer_s", "comm_exposed_s", "other_s")  # disjoint: they add up to step_s


BREAKDOWN_KEYS = (*TIME_PARTS, "comm_s", "step_s")


def profiled_samples(runs: list[Run]) -> dict[int, list[list[dict]]]:
    """Each rank's profiled steps (rank{r}/time/... in metrics.jsonl), per run of `runs` (one job's
    rounds): rank -> [one list per round of {part: seconds}]."""
    out: dict[int, list[list[dict]]] = {}
    for i, x in enumerate(runs):
        for m in x.metrics:
            for r in range(x.world):
                if f"rank{r}/time/step_s" in m:
                    rounds = out.setdefault(r, [])
                    rounds.extend([] for _ in range(i + 1 - len(rounds)))
                    rounds[i].append({k: float(m[f"rank{r}/time/{k}"]) for k in BREAKDOWN_KEYS})
    return out


def median_spread(rounds: list[list[float]]) -> dict:
    """The median of samples pooled over rounds and its 95 % interval (zerolab.report.intervals:
    a bootstrap over the rounds, then the samples of each): what moves between runs of the same job
    is in it, not only what moves between steps."""
    pooled = [v for r in rounds for v in r]
    lo, hi = median_interval(rounds) if pooled else (float("nan"), float("nan"))
    return {"median": statistics.median(pooled) if pooled else float("nan"), "lo": lo, "hi": hi}


def breakdown(runs: list[Run]) -> dict:
    """Where the profiled steps went, pooled over `runs` (one job's rounds), their steps and ranks:
    the median of each part, of comm_s and step_s (seconds), each with its 95 % interval
    (`spread`: part -> (lo, hi)); the share of communication time hidden behind other work
    (1 - exposed / in flight, of the medians); per rank the same medians. Medians, not means: one
    step disturbed by something else on the machine moves a mean, not a median; the parts' medians
    need not add up to the step's exactly. {} when no step was profiled."""
    by_rank = profiled_samples(runs)
    if not by_rank:
        return {}
    n_rounds = max(len(v) for v in by_rank.values())
    pooled = [[row for r in sorted(by_rank) for row in (by_rank[r][i] if i < len(by_rank[r]) else [])]
              for i in range(n_rounds)]

    def medians(rounds: list[list[dict]], spread: bool) -> dict:
        out, bounds = {}, {}
        for k in BREAKDOWN_KEYS:
            m = median_spread([[row[k] for row in rnd] for rnd in rounds]) if spread else \
                {"median": statistics.median(row[k] for rnd in rounds for row in rnd)}
            out[k] = m["median"]
            if spread:
                bounds[k] = (m["lo"], m["hi"])
        out["hidden"] = 1 - out["comm_exposed_s"] / out["comm_s"] if out["comm_s"] > 0 else float("nan")
        return {**out, "spread": bounds} if spread else out
    samples = sum(map(len, pooled))
    return {**medians(pooled, spread=True), "samples": samples, "rounds": n_rounds,
            "steps": samples // len(by_rank), "per_rank": [medians(by_rank[r], spread=False) for r in sorted(by_rank)]}


def compute_stats(run: Run) -> None:
    rounds = [step_times(x) for x in [run, *run.repeats]]
    times = [t for r in rounds for t in r]  # pooled over rounds
    tokens = [t for x in [run, *run.repeats] for s, t in series(x, "tokens_per_s") if s > 1]
    mfu = [v for x in [run, *run.repeats] for s, v in series(x, "mfu") if s > 1]
    comm = [[v for s, v in series(run, f"rank{r}/comm_bytes") if s > 1] for r in range(run.world)]
    n_params = run.summary.get("n_params") or 0
    st = run.stats
    st["rounds"] = rounds
    st["p50"] = percentile(times, 50) if times else float("nan")
    st["p95"] = percentile(times, 95) if times else float("nan")
    st["p99"] = percentile(times, 99) if times else float("nan")
    st["tokens_per_s"] = statistics.median(tokens) if tokens else float("nan")
    st["mfu"] = statistics.median(mfu) if mfu else float("nan")
    st["breakdown"] = breakdown([run, *run.repeats])
    st["comm_per_step"] = [statistics.mean(c) if c else float("nan") for c in comm]
    st["comm_theory"] = theory_bytes_per_step(n_params, GRAD_BYTES.get(run.precision, 4), run.world)
    st["mem"] = _rank_figures(run, "mem")
    st["mem_pred"] = _rank_figures(run, "mem_pred")
    st["peak"], st["peak_pred"] = _rank_peaks(run, "mem"), _rank_peaks(run, "mem_pred")
    train = series(run, "loss")
    st["final_loss"] = train[-1][1] if train else float("nan")
    ev = series(run, "eval_loss")
    st["eval_loss"] = ev[-1][1] if ev else float("nan")
