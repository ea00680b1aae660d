"""The comparison report read by someone who has not read report.md (fast tier, synthetic run
directories): the console table's marks and columns are explained under it; comm.png draws each
strategy's own ZeRO-paper volume and says why a bar sits above 2Ψ; eval loss is points, never a
line; and a step-time verdict is called only on a machine that was not busier than its cores
during the jobs compared."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zerolab.report.build import cli_main, load_runs

PSI = 100_000  # parameters of the synthetic model: 2Ψ(N−1)/N fp32 bytes = 400,000 at N = 2
TWO_PSI = 2 * PSI * 4 * (2 - 1) / 2


def write_run(d: Path, strategy: dict, step_ms: list[float], comm: float, evals=(5, 10)) -> Path:
    """A run directory as train.py leaves one, with given step times (ms, step 2 on) and bytes sent per
    step: config.yaml, metrics.jsonl, summary.json, model.safetensors, eval_logits.safetensors."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(json.dumps({"strategy": strategy, "precision": {"name": "fp32"},
                                               "optim": {"name": "adamw"}}))
    records = []
    for step, ms in enumerate([step_ms[0], *step_ms], 1):
        rec = {"step": step, "loss": 3.0 - 0.01 * step, "step_time_s": ms / 1e3, "tokens_per_s": 1e5,
               "rank0/comm_bytes": comm, "rank1/comm_bytes": comm}
        if step in evals:
            rec["eval_loss"] = 3.1 - 0.01 * step
        records.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({"n_params": PSI, "world_size": 2, "steps": len(records),
                                                "global_batch": 16, "model": "synthetic", "optimizer": "adamw"}))
    save_file({"w": torch.ones(4)}, str(d / "model.safetensors"))
    save_file({"logits/0": torch.linspace(-1, 1, 8).reshape(1, 2, 4), "loss": torch.tensor([2.0])},
              str(d / "eval_logits.safetensors"))
    return d


def steps(rng: random.Random, median_ms: float, n: int = 25) -> list[float]:
    return [median_ms * (1 + rng.gauss(0, 0.03)) for _ in range(n)]


def write_sweep(root: Path, ms: dict[str, list[float]], loads: dict[tuple[str, int], tuple], cores: int = 2,
                comm: dict[str, float] | None = None) -> Path:
    """A sweep directory: one run per (strategy, round) with p50 `ms[strategy][round]`, and sweep.json
    recording each job's 1-minute load before and after it (`loads`, default quiet) and its seconds."""
    rng, jobs = random.Random(0), []
    names = {"ddp": {"name": "ddp"}, "zero3": {"name": "zero3"}, "torch_zero": {"name": "torch_zero"},
             "fsdp": {"name": "fsdp"}, "deepspeed": {"name": "deepspeed", "stage": 2}, "zero2": {"name": "zero2"}}
    for num, (label, per_round) in enumerate(ms.items()):
        for rnd, p50 in enumerate(per_round):
            name = f"{num}-{label}" + (f"-r{rnd}" if rnd else "")
            d = write_run(root / name, names[label], steps(rng, p50), (comm or {}).get(label, TWO_PSI))
            before, after = loads.get((label, rnd), (1.9, 2.0))
            jobs.append({"num": num, "round": rnd, "name": name, "run_dir": str(d), "seconds": 20.0,
                         "loadavg_before": [before, 1.0, 1.0], "loadavg_after": [after, 1.0, 1.0]})
    (root / "sweep.json").write_text(json.dumps({"jobs": jobs, "loadavg": {"before": [1.0] * 3, "after": [2.0] * 3,
                                                                           "cores": cores}}))
    return root


def verdicts(sweep: Path) -> dict[str, dict]:
    runs, _, _ = load_runs([str(sweep)])
    return {r.label: r.stats["timing"] for r in runs}


# ---- 7: verdicts a loaded machine cannot flip ----------------------------------------------------------
def test_a_loaded_machine_gets_no_verdict_and_is_named(tmp_path):
    """zero3 1.3x slower than ddp in both rounds; a loaded machine during ddp's second job: the
    interval alone says "slower", the report calls nothing and names the job and its load."""
    ms = {"ddp": [100, 100], "zero3": [130, 130]}
    quiet = verdicts(write_sweep(tmp_path / "quiet", ms, {}))
    assert quiet["zero3"]["verdict"] == "slower" and quiet["zero3"]["interval_verdict"] == "slower"
    # 1-min load 2.0 -> 3.5 over 20 s: (3.5 - 2.0·e^(-1/3)) / (1 - e^(-1/3)) ≈ 7.3 runnable on 2 cores
    loaded = verdicts(write_sweep(tmp_path / "loaded", ms, {("ddp", 1): (2.0, 3.5)}))["zero3"]
    assert loaded["interval_verdict"] == "slower" and loaded["verdict"] == "not called", loaded
    assert "the machine was loaded (runnable processes on average" in loaded["why"]
    assert "on 2 cores: 0-ddp-r1 7.3)" in loaded["why"], loaded["why"]


def test_the_residue_of_a_finished_job_is_not_load(tmp_path):
    """A sweep started right after a heavy job: the 1-minute average is still high before the first
    job and decays during it (3.4 -> 3.0 over 20 s: about 2 runnable, the job's own two ranks)."""
    from zerolab.report.load import busy_during

    job = {"loadavg_before": [3.4], "loadavg_after": [3.0], "seconds": 20.0}
    assert abs(busy_during(job) - 1.99) < 0.01  # (3.0 - 3.4·0.7165) / 0.2835, by hand
    ms = {"ddp": [100, 100], "zero3": [130, 130]}
    assert verdicts(write_sweep(tmp_path / "s", ms, {("ddp", 0): (3.4, 3.0)}))["zero3"]["verdict"] == "slower"


def test_more_cores_than_load_is_quiet(tmp_path):
    ms = {"ddp": [100, 100], "zero3": [130, 130]}
    t = verdicts(write_sweep(tmp_path / "s", ms, {("ddp", 1): (2.0, 3.5)}, cores=16))["zero3"]
    assert t["verdict"] == "slower" and "why" not in t


def test_each_rounds_own_ratio_is_kept_beside_the_pooled_one(tmp_path):
    t = verdicts(write_sweep(tmp_path / "s", {"ddp": [100, 200], "zero3": [130, 260]}, {}))["zero3"]
    assert [round(v, 1) for v in t["round_ratios"].values()] == [1.3, 1.3]


# ---- 6: the report's own words ------------------------------------------------------------------------
def test_the_console_table_explains_its_marks_and_columns(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s", {"ddp": [100, 100], "zero3": [101, 100], "fsdp": [150, 150]},
                        {("fsdp", 0): (2.0, 3.5)})
    assert cli_main([str(sweep), "--out", str(tmp_path / "report"), "--wandb", "disabled"]) == 0
    out = capsys.readouterr().out
    table, rest = out.split("\n\n", 1)[0], out.split("\n\n", 1)[-1]
    assert " ~ |" in table and " ? |" in table and "comm MiB/step r0 (paper)" in table
    legend = next(line for line in out.splitlines() if line.startswith("~: within noise"))
    assert all(s in legend for s in ("?: not called", "model states (pred)", "comm (paper)", "2Ψ(N−1)/N",
                                     "3Ψ(N−1)/N for stage 3"))
    assert "step time fsdp:" in rest and "not called: the machine was loaded" in rest
    md = (tmp_path / "report" / "report.md").read_text()
    assert legend in md and "the interval alone: slower" in md


def test_comm_shows_each_strategys_paper_volume_and_why_it_is_above(tmp_path):
    from zerolab.report.figures import comm_bars

    comm = {"ddp": TWO_PSI, "zero3": 1.5 * TWO_PSI, "fsdp": 1.49 * TWO_PSI, "torch_zero": 1.5 * TWO_PSI,
            "deepspeed": 1.5 * TWO_PSI, "zero2": TWO_PSI}
    sweep = write_sweep(tmp_path / "s", {k: [100] for k in comm}, {}, comm=comm)
    runs, _, _ = load_runs([str(sweep)])
    bars = {b["label"]: b for b in comm_bars(runs)}
    two = TWO_PSI / 2**20
    for label in ("ddp", "zero2"):
        assert bars[label]["paper"] == bars[label]["two_psi"] == pytest.approx(two) and bars[label]["note"] == ""
    for label in ("zero3", "fsdp"):  # the paper's stage 3: 1.5 times data parallelism
        assert bars[label]["paper"] == pytest.approx(1.5 * two) and "the paper's own 3Ψ" in bars[label]["note"]
        assert "× the paper's" not in bars[label]["note"]
    assert "ZeroRedundancyOptimizer's broadcast" in bars["torch_zero"]["note"]
    assert "1.50× the paper's: DeepSpeed all-reduces each gradient bucket" in bars["deepspeed-s2"]["note"]
    from zerolab.report.figures import plot_comm

    assert plot_comm(runs, tmp_path).stat().st_size > 1000


def test_eval_loss_is_drawn_as_points_never_joined(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zerolab.report.figures import draw_eval

    sweep = write_sweep(tmp_path / "s", {"ddp": [100], "zero3": [100]}, {})
    runs, _, _ = load_runs([str(sweep)])
    fig, ax = plt.subplots()
    draw_eval(ax, runs)
    lines = ax.get_lines()
    assert len(lines) == 2 and all(len(line.get_xdata()) == 2 for line in lines)  # two evals per run
    assert all(line.get_linestyle() == "None" and line.get_marker() not in (None, "None", "") for line in lines)
    plt.close(fig)
