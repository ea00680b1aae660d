"""The time model against real runs on this machine (docs/predict.md, bench/RESULTS.md).

  flock /tmp/zerolab-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/predict_check.py \
      [--models gpt_small,llama] [--worlds 2,3] [--strategies ddp,zero1,zero2,zero3,fsdp] [--steps 21]

Needs this machine's figures first (python -m zerolab.predict calibrate; the table prints the
calibration's date and load). For every model x world x strategy: the real job (torchrun, gloo,
fp32, AdamW, synthetic tokens) with every second step profiled from step 4 on and nothing else
logged, so each profiled step follows a step that was not logged, as in a long run; --rounds runs
of each job, the rounds in alternating order. Then each job predicted from its first round's
directory as `python -m zerolab compare` predicts it (zerolab.rehearsal.predict_run: the run's own
config, rank 0 rehearsed and recorded, priced on `--hardware cpu`); --plot draws them
(zerolab.predict.runs.plot_comparison). Measured: the p50 of the profiled steps'
step_time_s of all rounds pooled, with a 95 % interval from a bootstrap over rounds and then steps
(zerolab.report.intervals), so it holds what moves between runs of the same job (fsdp's p50 moved by
17 % between two runs an hour apart on 2026-12-03) and not only between steps; the parts are the
mean of the rounds' (summary.json's time_per_rank, averaged over the ranks). Printed: predicted,
measured with its interval, their ratio, and per (model, world) whether the predicted order of each pair of
strategies agrees with the measured one where the measured difference is outside its interval
(the same bootstrap over rounds and steps of both jobs: the ratio's interval excludes 1).
Models: gpt_small (10.8M parameters, 8 x 128 tokens per rank) and a Llama from transformers
written here (bench/models.py's: hidden 384, 6 layers, grouped-query attention, 8.95M parameters,
4 x 128 tokens per rank).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerolab.predict.hardware import calibration_path  # noqa: E402
from zerolab.predict.runs import plot_comparison  # noqa: E402
from zerolab.report.intervals import bootstrap_ratio, median_interval  # noqa: E402
from zerolab.run.metrics import read_jsonl  # noqa: E402

PARTS = ("compute", "optimizer", "comm_exposed", "other")


def write_llama(path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=384, intermediate_size=896, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2).to_json_file(str(path))
    return path


def job(model: str, strategy: str, llama: Path) -> list[str]:
    shape = (["model=gpt_small", "data.micro_batch=8"] if model == "gpt_small" else
             ["model=hf", f"model.config={llama}", "model.block_size=128", "data.micro_batch=4"])
    return ["data=synthetic", *shape, f"strategy={strategy}", "precision=fp32", "optim=adamw"]


def predicted(run_dir: Path, label: str) -> dict:
    """The prediction for a finished run, from its directory (python -m zerolab compare's)."""
    from zerolab.rehearsal import predict_run

    got = predict_run(str(run_dir), "cpu")
    return {**got, "label": label, "step_s": got["parts"]["step"]["predicted"],
            **{p: got["parts"][p]["predicted"] for p in PARTS}}


def measured(overrides: list[str], world: int, steps: int, run_dir: Path) -> dict:
    profiled = list(range(4, steps, 2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "train.py"), *overrides, f"trainer.max_steps={steps}",
           f"profile.steps=[{','.join(map(str, profiled))}]", f"trainer.log_every={10 * steps}",
           "trainer.eval_every=0", "trainer.eval_batches=1", "run.save_model=false",
           "logging.wandb.mode=disabled", "logging.progress=false", f"run.dir={run_dir}"]
    before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    times = [m["step_time_s"] for m in read_jsonl(str(run_dir / "metrics.jsonl"))
             if m.get("step") in profiled and "step_time_s" in m]
    ranks = json.loads((run_dir / "summary.json").read_text())["time_per_rank"]
    parts = {p: statistics.mean(r[f"time/{p}_s"] for r in ranks) for p in PARTS}
    return {"times": times, "step_s": statistics.median(times), **parts, "load": (before, os.getloadavg()[0]),
            "run_dir": run_dir}


def order_check(rows: dict) -> list[str]:
    """Pairs whose measured ratio's interval excludes 1: does the prediction order them the same?"""
    out = []
    for a, b in combinations(sorted(rows), 2):
        ratio = bootstrap_ratio(rows[a]["rounds"], rows[b]["rounds"])
        if ratio["verdict"] == "within noise":
            continue
        same = (rows[a]["predicted"]["step_s"] > rows[b]["predicted"]["step_s"]) == (ratio["ratio"] > 1)
        out.append(f"{a} / {b}: measured {ratio['ratio']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3f}], predicted "
                   f"{rows[a]['predicted']['step_s'] / rows[b]['predicted']['step_s']:.3f}: "
                   f"{'agrees' if same else 'DISAGREES'}")
    return out


def header() -> None:
    import torch

    cal = json.loads(Path(calibration_path()).read_text())
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    print(f"# {datetime.date.today()}, commit {sha or '?'} (and the working tree), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, OMP_NUM_THREADS=1, gloo, fp32, AdamW; calibration {calibration_path()} of "
          f"{cal['date']} (load average {cal['load_average_before']:.2f} -> {cal['load_average_after']:.2f}); "
          f"load average now {os.getloadavg()[0]:.2f}", flush=True)
    print("| model | world | strategy | predicted ms | measured p50 ms [95 %] | predicted / measured | "
          "predicted parts (compute / optimizer / exposed / other) ms | measured parts ms | p50 ms of each round | "
          "load averages |")
    print("|---|---:|---|---:|---:|---:|---|---|---|---|", flush=True)


def row(model: str, world: int, strategy: str, pred: dict, runs: list[dict]) -> dict:
    """Measured: the p50 of every round's profiled steps pooled, its interval from the bootstrap over
    rounds, then steps (zerolab.report.intervals), so it holds the spread between runs as well as
    between steps; the parts are the mean over the rounds."""
    rounds = [m["times"] for m in runs]
    p50 = statistics.median([t for r in rounds for t in r])
    lo, hi = median_interval(rounds)
    parts = {k: statistics.mean(m[k] for m in runs) for k in PARTS}
    ms = lambda values: " / ".join(f"{v * 1e3:.0f}" for v in values)
    print(f"| {model} | {world} | {strategy} | {pred['step_s'] * 1e3:.0f} | {p50 * 1e3:.0f} "
          f"[{lo * 1e3:.0f}, {hi * 1e3:.0f}] | {pred['step_s'] / p50:.3f} | {ms(pred[k] for k in PARTS)} | "
          f"{ms(parts[k] for k in PARTS)} | {ms(m['step_s'] for m in runs)} | "
          f"{min(m['load'][0] for m in runs):.2f}-{max(m['load'][1] for m in runs):.2f} |", flush=True)
    return {"predicted": pred, "rounds": rounds, "ratio": pred["step_s"] / p50}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt_small,llama")
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plot", default="", help="also draw predicted beside measured parts into this PNG")
    args = p.parse_args()
    header()
    with tempfile.TemporaryDirectory(prefix="zerolab-predict-check-") as d:
        llama = write_llama(Path(d) / "llama.json")
        jobs = [(m, w, s) for m in args.models.split(",") for w in map(int, args.worlds.split(","))
                for s in args.strategies.split(",")]
        runs: dict = {j: [] for j in jobs}
        for k in range(args.rounds):
            for j in (jobs if k % 2 == 0 else jobs[::-1]):
                name = f"r{k}-{j[0]}-{j[1]}-{j[2]}"
                runs[j].append(measured(job(j[0], j[2], llama), j[1], args.steps, Path(d) / name))
        summary: list = []
        preds = {j: predicted(runs[j][0]["run_dir"], f"{j[0]} {j[1]} {j[2]}") for j in jobs}
        for model, world in dict.fromkeys((m, w) for m, w, _ in jobs):
            rows = {s: row(model, world, s, preds[model, world, s], runs[model, world, s])
                    for s in args.strategies.split(",")}
            for line in order_check(rows):
                print(f"  order, {model} at {world}: {line}", flush=True)
            summary.extend(r["ratio"] for r in rows.values())
        print(f"predicted / measured p50: {sum(0.8 <= x <= 1.2 for x in summary)} of {len(summary)} within 20 %, "
              f"range {min(summary):.3f}-{max(summary):.3f}")
        if args.plot:
            print(f"plot: {plot_comparison([preds[j] for j in jobs], args.plot)}")


if __name__ == "__main__":
    main()
