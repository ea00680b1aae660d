"""The table of bench/gpu_check.sh: planner's predicted peak and activations vs what each run measured
(torch.cuda.max_memory_allocated over the training steps, zerolab's ActivationMeter), appended to
bench/RESULTS.md.

    python bench/gpu_check.py --micro-batch 8 --seq 1024 --out bench/RESULTS.md LABEL|CKPT|RUN_DIR ...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab.activations import predict_activations  # noqa: E402
from zerolab.memory import human_bytes, load_model_config  # noqa: E402
from zerolab.plan import Planner  # noqa: E402


def last_record(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return next((r for r in reversed(records) if "rank0/cuda_max_allocated_bytes" in r), None)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--model", default="gpt2_124m")
    p.add_argument("--out", default="bench/RESULTS.md")
    p.add_argument("runs", nargs="+", help="LABEL|CKPT|RUN_DIR")
    args = p.parse_args(argv)
    mcfg = dataclasses.replace(load_model_config(args.model), block_size=args.seq)
    planner = Planner(mcfg, 1, args.seq, "bf16", "adamw", "cuda")
    rows = []
    for run in args.runs:
        label, ck, run_dir = run.split("|", 2)
        rec = last_record(run_dir)
        pred_acts = predict_activations(mcfg, args.micro_batch, args.seq, "bf16", "cuda", checkpointing=ck).bytes
        pred_peak = planner.peak(label, args.micro_batch, ck)[0] if label in planner.states else None
        if rec is None:
            rows.append(f"| {label} | {ck} | failed (see {run_dir}.log) | | | | | |")
            continue
        peak, acts = rec["rank0/cuda_max_allocated_bytes"], rec.get("rank0/mem/activations_bytes", 0)
        pp = f"{human_bytes(pred_peak)} | {pred_peak / peak:.3f}" if pred_peak else "— | —"
        rows.append(f"| {label} | {ck} | {human_bytes(peak)} | {pp} | {human_bytes(acts)} | {human_bytes(pred_acts)} "
                    f"| {pred_acts / acts:.3f} |" if acts else f"| {label} | {ck} | {human_bytes(peak)} | {pp} | — | "
                    f"{human_bytes(pred_acts)} | — |")
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    text = [f"\n## Planner vs allocator on one GPU (bench/gpu_check.sh), {time.strftime('%Y-%m-%d')}\n",
            f"{args.model}, bf16, adamw, world 1, micro-batch {args.micro_batch}, seq {args.seq}; {gpu}, "
            f"torch {torch.__version__}, {platform.node()}. Measured peak: torch.cuda.max_memory_allocated over the "
            "training steps; predicted: zerolab.plan (model states + activations + transients).\n",
            "| strategy | ckpt | measured peak | predicted peak | pred ÷ meas | measured activations | "
            "predicted activations | pred ÷ meas |",
            "|---|---|---:|---:|---:|---:|---:|---:|", *rows]
    with open(args.out, "a") as fh:
        fh.write("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
