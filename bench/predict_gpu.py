"""The time model against published GPU runs (docs/predict.md, bench/RESULTS.md).

  .venv/bin/python bench/predict_gpu.py [--only NAME,...] [--records DIR] [--fresh] [--fit]

Each published run (zerolab.predict.published.RUNS: the source, the mapping onto zerolab's
settings, the published tokens/s per GPU) is rehearsed on a GPU target's kernels (a dry run,
fake tensors), its step recorded, and the record priced by zerolab.predict.model on the run's
`--hardware` entry and links. The records are kept in `--records` (default
tests/data/published-records, which tests/test_predict_gpu.py prices), so pricing again after a
change to the time model takes seconds; `--fresh` rehearses again (needed after a change to what
a rehearsal records: tests/test_predict_gpu.py rehearses one row and fails when its record differs
from the stored one). The rehearsals of all ten rows take about 15 minutes on this 2-core
machine; the memory row (82.4 GiB) needs the full rehearsal of its run (until the peak repeats),
the others a quick one.

Prints, per row: the mapping, published, predicted, the ratio, the predicted MFU, whether it was
fitted (zerolab.predict.gpu.FITTED_ON names the one row the memory-bound kernels' share of the
bandwidth is fitted on), and then each hardware kind's rows in published and in predicted order,
and the assumptions of the model. `--fit` first fits that share again on that row, by bisection,
and prints it (zerolab.predict.gpu.MEMORY_SHARE holds the value the table uses).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerolab.predict import gpu  # noqa: E402
from zerolab.predict.published import RUNS, gpt2_config, load, order_agrees, predict_row, save  # noqa: E402
from zerolab.rehearsal import rehearse  # noqa: E402


def records_dir(given: str) -> Path:
    return Path(given) if given else ROOT / "tests" / "data" / "published-records"


def rehearse_row(run, quick: bool = True):
    """The row's rehearsal on CUDA's kernels, recorded (zerolab.rehearsal.rehearse); the full one
    (until the memory peak repeats) where the row also checks memory."""
    with tempfile.TemporaryDirectory() as d:
        config = run.model
        if run.model.startswith("gpt2:"):
            config = str(Path(d) / "config.json")
            Path(config).write_text(json.dumps(gpt2_config(run.model, run.seq)))
        return rehearse(run.overrides(config), world=run.world, record=True, quick=quick and not run.memory_gib,
                        target="cuda")


def load_or_rehearse(run, where: Path, fresh: bool):
    path = where / f"{run.name}.json.gz"
    if not path.exists() or fresh:
        t0 = time.perf_counter()
        r = rehearse_row(run)
        print(f"# rehearsed {run.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        where.mkdir(parents=True, exist_ok=True)
        save(r, path)
    return load(path)


def fit_memory_share(run, rec) -> float:
    """The memory-bound kernels' share of the bandwidth at which `run` is predicted at its published
    tokens/s: bisection (tokens/s rises with the share)."""
    saved = dict(gpu.KERNELS)
    lo, hi = 0.05, 1.0
    try:
        for _ in range(30):
            mid = (lo + hi) / 2
            for name, k in saved.items():
                gpu.KERNELS[name] = dataclasses.replace(k, memory=mid)
            lo, hi = (mid, hi) if predict_row(run, rec).tokens_per_s_per_device < run.published else (lo, mid)
    finally:
        gpu.KERNELS.update(saved)
    return (lo + hi) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated row names (default: all)")
    p.add_argument("--records", default="", help="where the rehearsed records are kept")
    p.add_argument("--fresh", action="store_true", help="rehearse again even where a record is kept")
    p.add_argument("--fit", action="store_true", help=f"fit the memory share again on {gpu.FITTED_ON}")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or [r.name for r in RUNS]
    where = records_dir(args.records)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"# commit {sha.strip()}")
    if args.fit:
        run = next(r for r in RUNS if r.name == gpu.FITTED_ON)
        share = fit_memory_share(run, load_or_rehearse(run, where, args.fresh))
        print(f"# memory-bound kernels' share of the bandwidth fitted on {run.name}: {share:.4f} "
              f"(zerolab.predict.gpu.MEMORY_SHARE = {gpu.MEMORY_SHARE})")
    print("| row | mapping | `--hardware`, GPUs | published tokens/s/GPU | predicted | ratio | MFU | role |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    got, assumptions = {}, []
    for run in (r for r in RUNS if r.name in names):
        rec = load_or_rehearse(run, where, args.fresh)
        pred = predict_row(run, rec)
        got[run.name] = pred.tokens_per_s_per_device
        assumptions = pred.assumptions
        mem = (f"; peak {rec.peak_bytes / 2**30:.1f} GiB (published {run.memory_gib} GiB)"
               if run.memory_gib else "")
        print(f"| {run.name} | {run.mapping()}{mem} | `{run.hardware}`, {run.world} | {run.published:,} | "
              f"{pred.tokens_per_s_per_device:,.0f} | {pred.tokens_per_s_per_device / run.published:.2f} | "
              f"{100 * pred.mfu:.1f} % | {run.role()} |")
    for hardware, agrees, published, predicted in order_agrees(got):
        print(f"{hardware}: published order {', '.join(published)}; predicted {', '.join(predicted)}: "
              f"{'the same' if agrees else 'NOT the same'}")
    print("assumptions (last row): " + " | ".join(assumptions))


if __name__ == "__main__":
    main()
