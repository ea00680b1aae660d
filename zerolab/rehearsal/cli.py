"""`python -m zerolab dry-run`: the command and its table."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from zerolab.accounting import CATEGORIES, human_bytes
from zerolab.config import ConfigError
from zerolab.models.blocks_report import blocks_line
from zerolab.predict import cli as predict_cli
from zerolab.predict.report import format_prediction
from zerolab.rehearsal.run import NOT_COUNTED, Rehearsal, rehearsal_config, rehearse

FIGURES = [  # (key of the run's per-rank figures, row label)
    *((f"mem/{c}_bytes", c) for c in CATEGORIES),
    ("mem/model_states_bytes", "model states"),
    ("mem/device_bytes", "on the device"),  # the categories by place (zerolab.accounting.placed)
    ("mem/host_bytes", "on the host"),
    *((f"mem/host/{c}_bytes", f"  host {c}") for c in CATEGORIES),
    ("mem/activations_bytes", "activations"),
    ("mem/peak_bytes", "peak"),
    ("mem/peak_model_states_bytes", "  model states"),
    ("mem/peak_activations_bytes", "  activations"),
    ("mem/peak_transient_bytes", "  transient"),
]



def format_rehearsal(r: Rehearsal) -> str:
    head = (f"dry run of rank {r.rank} of {r.world}: model {r.model}"
            + (f" ({r.n_params:,} parameters)" if r.n_params else "")
            + f" | strategy {r.strategy} | precision {r.precision}"
            + (" | CUDA's kernels (attention, dropout, layer norm)" if r.kernels == "cuda" else ""))
    blocks = [blocks_line(r.blocks)] if r.blocks else []  # last: which modules the job takes as its blocks
    if r.not_rehearsed:
        lines = [head, f"not rehearsed: {r.not_rehearsed}.", "the ledger's prediction for this rank:"]
        lines += [f"  {label:<15} {human_bytes(r.predicted[key]):>12}" for key, label in FIGURES if key in r.predicted]
        return "\n".join(lines + blocks)
    lines = [head, f"{'':<17}{'rehearsed':>12} {'ledger':>12} {'difference':>12}"]
    for key, label in FIGURES:
        m, p = r.measured.get(key), r.predicted.get(key)
        if m is None:
            continue
        diff = "" if p is None else f"{m - p:+,}" if abs(m - p) < 10_000 else f"{100 * (m - p) / p:+.2f}%" if p else ""
        lines.append(f"{label:<17}{human_bytes(m):>12} {human_bytes(p) if p is not None else '-':>12} {diff:>12}")
    host = r.measured.get("mem/host_bytes", 0)
    if host:  # a node's ranks share its host's memory
        per_node = r.ranks_per_node or 1
        lines.append(f"host memory of a node ({per_node} rank(s) alike): {human_bytes(host * per_node)}")
    phase = r.measured.get("mem/peak_phase")
    lines.append(f"the peak is in the {phase}" + (f" (the ledger's: in the {r.predicted['mem/peak_phase']})"
                                                  if "mem/peak_phase" in r.predicted else ""))
    lines.append(f"{r.steps} steps rehearsed in {r.seconds:.1f} s (this process's peak RSS "
                 f"{human_bytes(r.rss_peak_bytes)}); peaks per step: {', '.join(human_bytes(p) for p in r.peaks)}")
    lines.append(NOT_COUNTED)
    return "\n".join(lines + blocks)


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerolab dry-run",
        description="Rehearse rank R of an N-rank job in this process, on fake tensors and a fake process group: "
                    "the job's own model, strategy, forward, backward, reduction and optimizer step, and the "
                    "memory a real run would count, beside the ledger's prediction.")
    parser.add_argument("--world", type=int, required=True, help="ranks of the job rehearsed")
    parser.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON (the run's mem/... keys) instead of a table")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for train.py (strategy=zero3 model=hf ...)")
    predict_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error("--world must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        cfg, topo = rehearsal_config(args.overrides, args.world), None
        if args.hardware:  # refused before anything is rehearsed; the dry run's nodes are the prediction's
            topo = predict_cli.topology(args, args.world, cfg.dist.ranks_per_node)
            cfg.dist.ranks_per_node = predict_cli.ranks_per_node(topo) or cfg.dist.ranks_per_node
        # A GPU named by --hardware: the rehearsal runs what CUDA runs where its kernels differ
        target = "cuda" if args.hardware and args.hardware != "cpu" else ""
        result = rehearse([], args.world, args.rank, record=topo is not None, cfg=cfg, target=target)
        prediction = predict_cli.priced(result, topo) if topo is not None and result.record is not None else None
    except ConfigError as err:
        print(f"zerolab dry-run: {err}", file=sys.stderr)
        return 2
    if args.json:
        extra = {"prediction": prediction.to_dict()} if prediction else {}
        print(json.dumps({**result.to_dict(), **extra}, indent=2))
        return 0
    print(format_rehearsal(result))
    if prediction is not None:
        print("\n" + format_prediction(prediction))
    elif topo is not None:
        print(f"\nno time predicted: {result.strategy} is not rehearsed, so there is no step to price")
    return 0
