"""`python -m zerolab memory`: the predicted ledger of one strategy as a table (or JSON) with the
ZeRO paper beside it, or a sweep over world sizes for every strategy, optionally plotted; and
`python -m zerolab optim-state`: the optimizer state per parameter the ledger's k comes from,
measured from a real step."""
from __future__ import annotations

import argparse

from zerolab.accounting import (GB, GIB, MODEL_STATES, ModelShape, NotPredicted, Prediction, fmt_n, human_bytes,
                                shape_from_params)
from zerolab.memory.paper import (format_paper, gb_figure, paper_bytes, paper_formula, paper_k, paper_k_text,
                                  vs_paper)
from zerolab.memory.prediction import predict, predicted_strategies, prediction_dict
from zerolab.memory.shapes import load_model_config, optimizer_state_elements, shape_from_model_config
from zerolab.precision import COMPUTE_BYTES
from zerolab.precision_modes import GRAD_SHARDS, MASTERS, OPTIM_STATES, TABLE_MODES, Mode
from zerolab.strategies import strategy_class


def _num(x: float) -> str:
    """Two decimals for big figures, four significant digits for small ones."""
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.4g}"


def format_table(pred: Prediction, reference: Prediction | None = None) -> str:
    b, n = pred.bytes(), pred.n_params
    total = b["total"] or 1
    head = (f"{pred.model}: {fmt_n(n)} parameters | strategy {pred.strategy} | precision {pred.precision} | "
            f"optimizer {pred.optim} ({pred.state_elements:g} state elements/param) | world {pred.world} | per rank")
    rows = [f"{'category':<13} {'bytes/param':>11} {'bytes':>19} {'GB':>10} {'GiB':>10} {'share':>7}"]

    def row(label, v):
        rows.append(f"{label:<13} {v / n:>11.3f} {v:>19,} {_num(v / GB):>10} {_num(v / GIB):>10} "
                    f"{100 * v / total:>6.1f}%")

    for cat in MODEL_STATES:
        row(cat, b[cat])
    rows.append("-" * len(rows[0]))
    row("model states", b["model_states"])
    row("buffers", b["buffers"])
    row("total", b["total"])
    opt = b["master"] + b["optim_state"]
    ms = b["model_states"] or 1
    lines = [head, "", *rows, "",
             f"model states (weights + grads + master + optimizer state, the ZeRO paper's definition): "
             f"{b['model_states'] / n:.3f} bytes/param = {_num(b['model_states'] / GB)} GB per rank",
             f"optimizer states (fp32 master + optimizer state): {opt / n:.3f} bytes/param = {_num(opt / GB)} GB "
             f"= {100 * opt / ms:.1f}% of model states"]
    if pred.transient_bytes:
        lines.append(f"transient, on top during part of the step (not in total): {human_bytes(pred.transient_bytes)}")
    lines += _places(pred)
    lines += ["", *format_paper(pred, reference)]
    lines += ["", "where it comes from:"]
    lines += [f"  {t.category:<12} {human_bytes(t.bytes):>10}  {t.what}" for t in pred.terms]
    lines += [f"  note: {note}" for note in pred.notes]
    lines.append("  (activations are not included: they depend on batch and sequence length, not on the strategy)")
    return "\n".join(lines)


def _places(pred: Prediction) -> list[str]:
    """Where the bytes live, when some are on the host (offload): device and host by category."""
    by = pred.by_place()
    if not by["host"]["total"]:
        return []
    cats = [c for c in (*MODEL_STATES, "buffers") if by["host"][c]]
    return ["", "by place (a node's ranks share its host memory): "
            + f"device {human_bytes(by['device']['total'])}, host {human_bytes(by['host']['total'])} ("
            + ", ".join(f"{c} {human_bytes(by['host'][c])}" for c in cats) + ")"
            + f"; transient on the device {human_bytes(pred.transient_bytes_at('device'))}, on the host "
            + human_bytes(pred.transient_bytes_at("host"))]


def sweep_predictions(shape: ModelShape, worlds: list[int], precision: str, optim: str, bucket_mb: float = 25.0,
                      state_elements: float | None = None, mode: Mode = Mode()) -> dict[str, list[Prediction]]:
    """Rank 0's prediction for each strategy (each of its Traits.sweep_stages) at each world
    size, in the registry's order; strategies that cannot run `precision`, or do not hold their
    master and state as `mode` says (precision.master, ...), are left out."""
    k = optimizer_state_elements(optim) if state_elements is None else state_elements
    out = {}
    for strategy in predicted_strategies():
        if not all(strategy_class(strategy).reads(key, None) for key in mode.keys):
            continue
        for stage in strategy_class(strategy).traits.sweep_stages:
            try:
                row = [predict(shape, strategy, w, precision, optim, stage=stage, bucket_mb=bucket_mb,
                               state_elements=k, mode=mode) for w in worlds]
            except NotPredicted:
                continue
            out[row[0].strategy] = row
    return out


def format_sweep(shape: ModelShape, worlds: list[int], preds: dict[str, list[Prediction]], precision: str,
                 optim: str) -> str:
    """Per world size, the paper's figure beside the ledger's for each implementation; then, at the
    largest N, why they differ."""
    first = next(iter(preds.values()))[0]
    lines = [f"{shape.name}: {fmt_n(shape.n_params)} parameters | precision {precision} | optimizer {optim} | "
             "GB on rank 0",
             f"paper: the ZeRO paper's formula (Rajbhandari et al. 2019), {paper_k_text(first)}; "
             "ledger: model states + buffers as this implementation allocates them", ""]
    lines.append(f"{'':<12}{'':<16}" + "".join(f"{'N=' + str(w):>16}" for w in worlds))
    lines.append(f"{'strategy':<12}{'paper formula':<16}" + "".join(f"{'paper':>8}{'ledger':>8}" for _ in worlds))
    for label, row in preds.items():
        lines.append(f"{label:<12}{paper_formula(row[0]):<16}"
                     + "".join(f"{gb_figure(paper_bytes(p)):>8}{gb_figure(p.bytes()['total']):>8}" for p in row))
    lines += ["", f"why ledger and paper differ (N={worlds[-1]}):"]
    lines += [f"  {label:<12} {vs_paper(row[-1])}" for label, row in preds.items()]
    return "\n".join(lines)


def plot_sweep(path: str, shape: ModelShape, worlds: list[int], table: dict[str, list[int]], precision: str,
               optim: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]  # strategies that coincide (two stage-3 sharders) stay visible
    for i, (label, values) in enumerate(table.items()):
        ax.plot(worlds, [v / GB for v in values], marker="os^vDx*P"[i % 8], linestyle=styles[i % 4], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("GB on rank 0 (model states + buffers)")
    ax.set_title(f"{shape.name}, {precision}, {optim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- below the paper's floor: a column per master/state mode ------------------------------------
def mode_rows() -> list[tuple[str, int]]:
    """(name, ZeRO stage) of every strategy that holds its own master (reads precision.master)."""
    return [(n, strategy_class(n).traits.stage) for n in predicted_strategies()
            if strategy_class(n).reads("precision.master", None)]


def format_modes(shape: ModelShape, world: int, optim: str, bucket_mb: float = 25.0) -> str:
    """Model-state bytes per parameter on rank 0 under bf16, as the ledger predicts them (padding
    included), for every mode of zerolab/precision_modes.py's TABLE_MODES beside the ZeRO paper's
    figure; GB per rank below each row."""
    head = f"{'':<7}{'paper':>8}" + "".join(f"{i + 1:>8}" for i in range(len(TABLE_MODES)))
    lines = [f"{shape.name}: {fmt_n(shape.n_params)} parameters | N = {world} | bf16 | {optim} | model states on "
             "rank 0 per parameter, bytes (the ledger, padding included)", "", head]
    for name, stage in mode_rows():
        cells, gbs = [], []
        for m in TABLE_MODES:
            if not all(strategy_class(name).reads(key, None) for key in m.keys):
                cells.append(f"{'-':>8}")
                gbs.append(f"{'-':>8}")
                continue
            states = predict(shape, name, world, "bf16", optim, bucket_mb=bucket_mb, mode=m).bytes()["model_states"]
            cells.append(f"{states / shape.n_params:>8.4g}")
            gbs.append(f"{states / 1e9:>8.3g}")
        paper = paper_bytes(predict(shape, name, world, "bf16", optim, bucket_mb=bucket_mb))
        lines.append(f"{name:<7}{paper / shape.n_params:>8.4g}" + "".join(cells))
        lines.append(f"{'  GB':<7}{paper / 1e9:>8.3g}" + "".join(gbs))
    lines += ["", "columns: " + "; ".join(f"{i + 1} {m.label}" + (" (lossy)" if m.lossy else "")
                                          for i, m in enumerate(TABLE_MODES)),
              "paper: Rajbhandari et al. 2019's (2 + 2 + K) bytes split by stage; a bf16 gradient shard is lossless "
              "where micro-batches are not summed in it (the reduction is bf16 already)"]
    return "\n".join(lines)


# ---- the CLI: python -m zerolab memory ------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerolab memory",
                                description="Predicted memory per rank by category, for any model size and strategy.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    src.add_argument("--model", help="a model config name from conf/model/ (built on the meta device)")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks N")
    names = predicted_strategies()  # the first is plain data parallelism
    p.add_argument("--strategy", default=names[0], choices=names)
    p.add_argument("--stage", type=int, default=0,
                   help="strategy.stage: the ZeRO stage (1, 2, 3) of a strategy that offers several")
    p.add_argument("--rank", type=int, default=0,
                   help="which rank (where shards are uneven, e.g. whole tensors assigned to ranks)")
    p.add_argument("--precision", default="bf16", choices=list(COMPUTE_BYTES))
    p.add_argument("--optim", default="adamw", help="adamw | adam | lamb | lars | sgd | sgd_momentum")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (strategy.bucket_mb)")
    p.add_argument("--master", default="fp32", choices=MASTERS,
                   help="precision.master under bf16: fp32 (a copy), remainder (exact, 2 bytes), bf16 (lossy)")
    p.add_argument("--optim-states", default="fp32", choices=OPTIM_STATES, help="precision.optim_states under bf16")
    p.add_argument("--grad-shard", default="fp32", choices=GRAD_SHARDS, help="precision.grad_shard under bf16")
    p.add_argument("--modes", action="store_true",
                   help="bytes per parameter per rank of every master/state mode (a column each) beside the paper's, "
                        "for every strategy that holds its own master, at --world")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="strategy.offload_optimizer=true: the master, optimizer state and gradient shard on the host")
    p.add_argument("--offload-params", action="store_true",
                   help="strategy.offload_params=true (with --offload-optimizer): the weight shards on the host too")
    p.add_argument("--offload", action="store_true",
                   help="device and host bytes per rank (and host per node) of every offload mode, beside the "
                        "reference implementation's own estimate, at --world ranks on one node (docs/offload.md)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sweep-world", help="comma-separated world sizes, e.g. 1,2,4,8,16,64: one line per strategy")
    p.add_argument("--plot", help="with --sweep-world: also write this PNG (GB per rank against N)")
    return p


def _sweep(args, shape: ModelShape) -> None:
    import json
    import sys

    try:
        worlds = [int(w) for w in args.sweep_world.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--sweep-world={args.sweep_world!r}: give integers separated by commas, e.g. 1,2,4,8")
    if not worlds or min(worlds) < 1:
        raise ValueError(f"--sweep-world={args.sweep_world!r}: world sizes must be >= 1")
    preds = sweep_predictions(shape, worlds, args.precision, args.optim, args.bucket_mb)
    table = {label: [p.bytes()["total"] for p in row] for label, row in preds.items()}
    if args.json:
        first = next(iter(preds.values()))[0]
        print(json.dumps({"model": shape.name, "n_params": shape.n_params, "worlds": worlds,
                          "precision": args.precision, "optim": args.optim, "total_bytes": table,
                          "paper_bytes": {label: [paper_bytes(p) for p in row] for label, row in preds.items()},
                          "paper_formula": {label: paper_formula(row[0]) for label, row in preds.items()},
                          "paper_K": paper_k(first),
                          "vs_paper": {label: [vs_paper(p) for p in row] for label, row in preds.items()}},
                         indent=2))
    else:
        print(format_sweep(shape, worlds, preds, args.precision, args.optim))
    if args.plot:  # files only where the user asked for them
        plot_sweep(args.plot, shape, worlds, table, args.precision, args.optim)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)


def _one(args, shape: ModelShape) -> tuple[Prediction, Prediction | None]:
    """The prediction for one strategy and rank, and another implementation of the same ZeRO
    stage beside it, where the strategy names one (and it can run this precision)."""
    if not 0 <= args.rank < args.world:
        raise ValueError(f"--rank={args.rank} must be in [0, --world={args.world})")
    mode = Mode(args.master, args.optim_states, args.grad_shard)
    if mode != Mode() and args.precision != "bf16":
        raise ValueError(f"--master/--optim-states/--grad-shard hold a bf16 run's master and state otherwise; "
                         f"give --precision bf16 (not {args.precision})")
    pred = predict(shape, args.strategy, args.world, args.precision, args.optim, stage=args.stage,
                   bucket_mb=args.bucket_mb, rank=args.rank, mode=mode, settings=_offload_settings(args))
    reference = None
    if strategy_class(args.strategy).traits.memory_reference is not None:
        other, stage = strategy_class(args.strategy).traits.memory_reference
        try:
            reference = predict(shape, other, args.world, args.precision, args.optim, stage=stage,
                                bucket_mb=args.bucket_mb, state_elements=pred.state_elements, rank=args.rank)
        except NotPredicted:
            pass
    return pred, reference


def _offload_settings(args) -> dict:
    """--offload-optimizer / --offload-params as strategy.* settings, where the strategy runs them."""
    settings = {k: True for k in ("offload_optimizer", "offload_params") if getattr(args, k)}
    runs = getattr(strategy_class(args.strategy), "offload_modes", lambda: [{}])()
    if settings not in runs:
        raise ValueError(f"--strategy {args.strategy} does not offload as asked; it runs: "
                         + ", ".join(" ".join(f"--{k.replace('_', '-')}" for k in m) or "no offload" for m in runs))
    return settings


def cli_main(argv: list[str]) -> int:
    import json
    import sys

    args = _parser().parse_args(argv)
    try:
        shape = shape_from_params(args.params) if args.params is not None else \
            shape_from_model_config(load_model_config(args.model))
        if args.sweep_world:
            _sweep(args, shape)
            return 0
        if args.modes:
            print(format_modes(shape, args.world, args.optim, args.bucket_mb))
            return 0
        if args.offload:
            from zerolab.memory.offload import format_offload, offload_rows

            print(json.dumps(offload_rows(shape, args.world, args.precision, args.optim, args.bucket_mb), indent=2)
                  if args.json else format_offload(shape, args.world, args.precision, args.optim, args.bucket_mb))
            return 0
        pred, reference = _one(args, shape)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(prediction_dict(pred), indent=2) if args.json else format_table(pred, reference))
    return 0


def optim_state_main(argv: list[str]) -> int:
    import torch

    from zerolab.config import compose
    from zerolab.models import build_model, lm_loss, param_groups
    from zerolab.optim import measure_state
    from zerolab.schema import OPTIMIZERS

    p = argparse.ArgumentParser(prog="python -m zerolab optim-state",
                                description="optimizer state elements per parameter, measured from one real step")
    p.add_argument("--optim", nargs="+", choices=[*OPTIMIZERS, "all"], default=["all"])
    p.add_argument("--model", default="mlp", help="a conf/model/*.yaml name (default: mlp)")
    a = p.parse_args(argv)
    names = list(OPTIMIZERS) if "all" in a.optim else a.optim
    print(f"model={a.model}: one real step (fp32 params), state counted from optimizer.state")
    print(f"{'optimizer':14s} {'state/param':>11s} {'state bytes':>12s} {'params':>10s}")
    for name in names:
        cfg = compose([f"model={a.model}", f"optim={name}"])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))

        def loss_fn():
            return lm_loss(model(x), x)

        elements, nbytes, n = measure_state(cfg.optim, param_groups(model, cfg.optim.weight_decay), loss_fn)
        print(f"{name:14s} {elements / n:11.3g} {nbytes:12,d} {n:10,d}")
    return 0
