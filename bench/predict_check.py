"""The time model against real runs on this machine (docs/predict.md, bench/RESULTS.md).

  flock /tmp/zerolab-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/predict_check.py \
      [--models gpt_mid,gpt_small,llama] [--worlds 2,3] [--strategies ddp,...,zero3+offload+p] [--rounds 2]

Needs this machine's figures first (python -m zerolab.predict calibrate; the table prints the
calibration's date and load). The default is the default job's (experiment=compare: gpt_mid, 8 x
128 tokens per rank, 2 ranks, fp32 AdamW, steps 4, 6, ... profiled, each after a step neither
logged nor profiled) under every strategy it predicts and the offload rows (`zero2+offload`:
strategy.offload_optimizer=true; `+offload+p`: parameters too, as the report and the planner
label them); --models adds gpt_small (10.8M parameters) and a Llama from transformers written
here (hidden 384, 6 layers, grouped-query attention, 8.95M parameters, 4 x 128 tokens per rank,
synthetic tokens), --worlds 3 ranks. Every job runs --rounds times, the rounds in alternating
order.

Measured, as `python -m zerolab compare` measures it (zerolab.report.runs.breakdown): the median
of each part and of the step over the profiled steps and ranks of every round, with a 95 %
interval from a bootstrap over the rounds, then their steps, so it holds what moves between runs
of the same job, not only between steps. Predicted, as the report predicts it
(zerolab.rehearsal.predict_run: the first round's config, rank 0 rehearsed and recorded, priced on
`--hardware cpu`). Printed per job: both, the ratio with the measurement's interval, the parts,
each round's median, the load average around each run; per (model, world), whether the predicted
order of each pair of strategies agrees with the measured one where the measured difference is
outside its interval; and how many ratios lie within 0.90-1.10 and within 0.80-1.20.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerolab.predict.hardware import calibration_path  # noqa: E402
from zerolab.predict.host import split_label  # noqa: E402
from zerolab.predict.runs import plot_comparison  # noqa: E402
from zerolab.report.intervals import bootstrap_ratio  # noqa: E402
from zerolab.report.predicted import measured_parts  # noqa: E402
from zerolab.report.runs import breakdown, load_run  # noqa: E402

PARTS = ("compute", "optimizer", "comm_exposed", "other")
STRATEGIES = ("ddp,zero1,zero2,zero3,fsdp,torch_zero,zero1+offload,zero2+offload,zero3+offload,zero3+offload+p,"
              "fsdp+offload+p")


def write_llama(path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=384, intermediate_size=896, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2).to_json_file(str(path))
    return path


def job(model: str, label: str, llama: Path) -> list[str]:
    """train.py's overrides: the default job's settings (experiment=compare), its model or another."""
    strategy, settings = split_label(label)
    shape = {"gpt_mid": [],
             "gpt_small": ["model=gpt_small", "data=synthetic", "data.micro_batch=8"],
             "llama": ["model=hf", f"model.config={llama}", "model.block_size=128", "data=synthetic",
                       "data.micro_batch=4"]}[model]
    return ["experiment=compare", *shape, f"strategy={strategy}", *(f"strategy.{k}=true" for k in settings),
            "precision=fp32", "optim=adamw"]


def measured(overrides: list[str], world: int, steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "train.py"), *overrides, f"trainer.max_steps={steps}", "run.save_model=false",
           "logging.wandb.mode=disabled", f"run.dir={run_dir}"]
    before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return {"run": load_run(run_dir), "load": (before, os.getloadavg()[0])}


def row(model: str, world: int, label: str, runs: list[dict]) -> dict:
    """Measured as the report measures it (all rounds pooled), predicted from the first round's run."""
    from zerolab.rehearsal import predict_run

    b = breakdown([m["run"] for m in runs])
    pred = predict_run(str(runs[0]["run"].path), "cpu", measured=measured_parts(b))
    step = pred["parts"]["step"]
    rounds = [breakdown([m["run"]])["step_s"] for m in runs]
    ms = lambda values: " / ".join(f"{v * 1e3:.1f}" for v in values)
    print(f"| {model} | {world} | {label} | {step['predicted'] * 1e3:.1f} | {step['measured'] * 1e3:.1f} "
          f"[{step['lo'] * 1e3:.1f}, {step['hi'] * 1e3:.1f}] | {step['ratio']:.3f} [{step['ratio_lo']:.3f}, "
          f"{step['ratio_hi']:.3f}] | {ms(pred['parts'][k]['predicted'] for k in PARTS)} | "
          f"{ms(pred['parts'][k]['measured'] for k in PARTS)} | {ms(rounds)} | "
          f"{min(m['load'][0] for m in runs):.2f}-{max(m['load'][1] for m in runs):.2f} |", flush=True)
    steps = [[row["step_s"] for row in rnd] for rnd in _rounds(runs)]
    return {"predicted": pred, "rounds": steps, "ratio": step["ratio"], "label": f"{model} {world} {label}"}


def _rounds(runs: list[dict]) -> list[list[dict]]:
    """Each round's profiled steps, every rank's (zerolab.report.runs.profiled_samples, pooled over ranks)."""
    from zerolab.report.runs import profiled_samples

    out = []
    for m in runs:
        by_rank = profiled_samples([m["run"]])
        out.append([row for r in sorted(by_rank) for row in by_rank[r][0]])
    return out


def order_check(rows: dict) -> list[str]:
    """Pairs whose measured ratio's interval excludes 1: does the prediction order them the same?"""
    out = []
    for a, b in combinations(sorted(rows), 2):
        ratio = bootstrap_ratio(rows[a]["rounds"], rows[b]["rounds"])
        if ratio["verdict"] == "within noise":
            continue
        pa, pb = (rows[k]["predicted"]["parts"]["step"]["predicted"] for k in (a, b))
        same = (pa > pb) == (ratio["ratio"] > 1)
        out.append(f"{a} / {b}: measured {ratio['ratio']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3f}], predicted "
                   f"{pa / pb:.3f}: {'agrees' if same else 'DISAGREES'}")
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
    print("| model | world | strategy | predicted ms | measured median ms [95 %] | predicted ÷ measured [95 %] | "
          "predicted parts (compute / optimizer / exposed / other) ms | measured parts (medians) ms | "
          "median ms of each round | load averages |")
    print("|---|---:|---|---:|---:|---:|---|---|---|---|", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt_mid", help="gpt_mid (the default job's), gpt_small, llama")
    p.add_argument("--worlds", default="2")
    p.add_argument("--strategies", default=STRATEGIES, help="labels as the report's: zero2+offload, zero3+offload+p")
    p.add_argument("--steps", type=int, default=30, help="trainer.max_steps (the default job's 30: 14 profiled)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--plot", default="", help="also draw predicted beside measured parts into this PNG")
    p.add_argument("--keep", default="", help="keep the runs in this directory (default: a temporary one)")
    p.add_argument("--again", action="store_true",
                   help="run nothing: predict the runs --keep holds again (after a new calibration)")
    args = p.parse_args()
    header()
    labels = args.strategies.split(",")
    with tempfile.TemporaryDirectory(prefix="zerolab-predict-check-") as d:
        where = Path(args.keep or d)
        where.mkdir(parents=True, exist_ok=True)
        llama = write_llama(where / "llama.json")
        jobs = [(m, w, s) for m in args.models.split(",") for w in map(int, args.worlds.split(",")) for s in labels]
        runs: dict = {j: [] for j in jobs}
        for k in range(args.rounds):
            for j in (jobs if k % 2 == 0 else jobs[::-1]):
                run_dir = where / f"r{k}-{j[0]}-{j[1]}-{j[2]}"
                runs[j].append({"run": load_run(run_dir), "load": (float("nan"),) * 2} if args.again else
                               measured(job(j[0], j[2], llama), j[1], args.steps, run_dir))
        ratios, preds = [], []
        for model, world in dict.fromkeys((m, w) for m, w, _ in jobs):
            rows = {s: row(model, world, s, runs[model, world, s]) for s in labels}
            for line in order_check(rows):
                print(f"  order, {model} at {world}: {line}", flush=True)
            ratios.extend(r["ratio"] for r in rows.values())
            preds.extend({**r["predicted"], "label": r["label"]} for r in rows.values())
        print(f"predicted ÷ measured median: {sum(0.9 <= x <= 1.1 for x in ratios)} of {len(ratios)} within "
              f"0.90-1.10, {sum(0.8 <= x <= 1.2 for x in ratios)} within 0.80-1.20, range "
              f"{min(ratios):.3f}-{max(ratios):.3f}; load average now {os.getloadavg()[0]:.2f}")
        if args.plot:
            print(f"plot: {plot_comparison(preds, args.plot)}")


if __name__ == "__main__":
    main()
