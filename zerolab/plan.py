"""`python -m zerolab plan`: will it fit? The largest micro-batch per rank for each strategy, without
activation checkpointing, with every block recomputed and with selective (op-level) checkpointing,
under a GPU's memory with a safety margin, before anyone books a node.

Peak per rank = the larger of two moments of a step (composed in zerolab/memory/peak.py, shared
with the run's ledger and the trainer's CPU accounting):
  backward  model states + buffers (zerolab.memory.predict) + activations (zerolab.activations,
            everything the forward saved, at its largest when backward starts) + the transients of
            that moment:
              - logits buffers: 8·b·s·V bytes. Backward of the loss holds the fp32 gradient of the
                log-probabilities and of the logits at once (4 + 4 bytes per logit); the forward's
                logits (c bytes) and their fp32 copy (4, 16-bit only) are gone by then and are
                never more than that.
              - one checkpointed block recomputed (its activations minus what it kept: its input,
                and under selective checkpointing the kept op outputs its backward reads).
              - the strategy's communication buffers during backward, as its memory prediction
                states them (transient terms with when="backward": buckets in flight, a reduce
                bucket, gathered weights of a parameter-sharding stage).
  step      model states + buffers + what exists inside the optimizer step only (the transient
            terms with when="step": fp32 gradient copies, all-gather inputs).
Not counted: the CUDA context and allocator fragmentation (the margin is for them), the gradients
of activations flowing through one layer during backward, NCCL's own buffers.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace

from zerolab.activations import predict_activations
from zerolab.precision import COMPUTE_BYTES
from zerolab.precision_modes import Mode
from zerolab.memory import Prediction, human_bytes, load_model_config, shape_from_model_config, sweep_predictions
from zerolab.memory.peak import predicted_peak
from zerolab.predict import cli as predict_cli
from zerolab.predict import host as offload
from zerolab.predict.plan_tables import format_exact, format_speed  # noqa: F401  (format_speed: tests import it here)

CATEGORIES = ("params", "grads", "master", "optim_state", "buffers", "activations", "transient")
MAX_MICRO_BATCH = 1 << 16
# model.activation_checkpointing settings every strategy is planned with: none, every block
# recomputed, and selective (op-level: the matmuls' and attention's outputs kept; between the two)
PLANNED_CHECKPOINTING = ("none", "blocks", "selective")
# rows the config refuses, so the plan does not offer them: DeepSpeed stage 3's Linear adds its bias
# in place into the matmul output selective checkpointing keeps (zerolab/config.py)
REFUSED = {("deepspeed-3", "selective")}
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str, what: str = "--gpu-mem") -> int:
    """'80GB', '24 GiB', '81920MiB', '8e10B' -> bytes. A unit is required: a bare number is ambiguous."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"{what}={text!r} is not a memory size; give a number and a unit, e.g. 80GB, 24GiB or "
                         f"40960MiB (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{what}={text!r} must be more than zero")
    return int(value)


def derived_gpt(n_params: float, seq: int, vocab: int = 50304, layers: int = 0, width: int = 0, heads: int = 0):
    """A zerolab GPT config of about `n_params` parameters, GPT-3's proportions (Brown et al. 2020,
    Table 2.1: width ≈ 128 × layers from 6.7B up, head dimension 128): a layer holds 12·h² + 13·h
    parameters, the embeddings (V + s)·h. Any of layers, width, heads given is kept."""
    if n_params <= 0:
        raise ValueError(f"--params must be a positive number of parameters, got {n_params:g}")
    L = layers or max(1, round((n_params / (12 * 128 ** 2)) ** (1 / 3)))
    if not width:
        # 12·L·h² + (V + s)·h = N, h rounded to a multiple of 128 (at least 128)
        a, b = 12 * L, vocab + seq
        h = (-b + math.sqrt(b * b + 4 * a * n_params)) / (2 * a)
        width = max(128, 128 * round(h / 128))
    heads = heads or max(1, width // 128)
    if width % heads:
        raise ValueError(f"--width={width} must be divisible by --heads={heads}")
    base = load_model_config("gpt_tiny")
    return replace(base, name=f"gpt_{n_params:.3g}", n_layer=L, n_embd=width, n_head=heads, vocab_size=vocab,
                   block_size=seq, dropout=0.0, bias=True)


@dataclass
class Fit:
    label: str
    checkpointing: str
    micro_batch: int  # largest that fits; 0: not even 1
    peak: int  # at micro_batch (or at 1 when nothing fits)
    breakdown: dict = field(default_factory=dict)
    phase: str = "backward"  # the moment that sets the peak
    dominant: str = ""
    host: int = 0  # an offload row's host bytes per node (its ranks share the node's memory)

    def to_dict(self) -> dict:
        return {"strategy": self.label, "checkpointing": self.checkpointing, "max_micro_batch": self.micro_batch,
                "peak_bytes": self.peak, "phase": self.phase, "dominant": self.dominant,
                "bytes": dict(self.breakdown), **({"host_bytes_per_node": self.host} if self.host else {})}


class Planner:
    def __init__(self, mcfg, world: int, seq: int, precision: str = "bf16", optim: str = "adamw",
                 device: str = "cuda", bucket_mb: float = 25.0, every_k: int = 2, activations=None,
                 mode: Mode = Mode(), host_mem: int = 0, ranks_per_node: int = 8):
        """`activations(micro_batch, checkpointing)` -> an activation prediction; default
        zerolab.activations' formula for zerolab's models (a user's model: rehearsal.activation_model)."""
        if world < 1:
            raise ValueError(f"--world must be >= 1, got {world}")
        if seq < 1 or seq > mcfg.block_size:
            raise ValueError(f"--seq={seq} must be in [1, the model's block_size={mcfg.block_size}]")
        if precision not in COMPUTE_BYTES:
            raise ValueError(f"unknown precision {precision!r}; known: {', '.join(COMPUTE_BYTES)}")
        self.mcfg, self.world, self.seq, self.precision = mcfg, world, seq, precision
        self.optim, self.device, self.every_k, self.bucket_mb = optim, device, every_k, bucket_mb
        self.activations = activations or (lambda b, ck: predict_activations(
            mcfg, b, seq, precision, device, checkpointing=ck, every_k=every_k))
        self.shape = shape_from_model_config(mcfg)
        # Every strategy (and stage) the memory sweep lists, in the registry's order; those that
        # cannot run `precision` or hold the master as `mode` says are left out (memory.sweep_predictions).
        self.states: dict[str, Prediction] = {
            label: row[0] for label, row in sweep_predictions(self.shape, [world], precision, optim, bucket_mb,
                                                              mode=mode).items()}
        # host_mem (a node's host memory budget, --host-mem): each row's offload variants after it
        # (zerolab.predict.host), held to the host's memory too; not under a master mode (refused there)
        self.host_mem, self.node = host_mem, max(1, min(world, ranks_per_node))
        if host_mem and mode == Mode():
            self.states = offload.with_offload_rows(self.states, self.shape, world, precision, optim, bucket_mb)

    def peak(self, label: str, micro_batch: int, checkpointing: str) -> tuple[int, dict, str]:
        """(peak bytes, bytes by category at that moment, the moment: backward | step)."""
        acts = self.activations(micro_batch, checkpointing)
        pk = predicted_peak(self.states[label], acts, self.mcfg, micro_batch, self.seq)
        return pk.bytes, pk.categories, pk.phase

    def fit(self, label: str, budget: int, checkpointing: str) -> Fit:
        """The largest micro-batch whose peak is at most `budget` (peak grows with it: bisection);
        none where an offload row's host bytes per node are over --host-mem's budget."""
        host = offload.host_bytes(self.states[label]) * self.node if offload.split_label(label)[1] else 0
        if host > self.host_mem:
            peak, parts, phase = self.peak(label, 1, checkpointing)
            return Fit(label, checkpointing, 0, peak, parts, phase, "host memory", host)
        lo, hi = 0, 1
        while hi <= MAX_MICRO_BATCH and self.peak(label, hi, checkpointing)[0] <= budget:
            lo, hi = hi, hi * 2
        hi = min(hi, MAX_MICRO_BATCH + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(label, mid, checkpointing)[0] <= budget else (lo, mid)
        peak, parts, phase = self.peak(label, max(lo, 1), checkpointing)
        dominant = max(parts, key=parts.get)
        return Fit(label, checkpointing, lo, peak, parts, phase, dominant, host)

    def table(self, budget: int) -> list[Fit]:
        return [self.fit(label, budget, ck) for label in self.states for ck in PLANNED_CHECKPOINTING
                if (offload.split_label(label)[0], ck) not in REFUSED]


def format_plan(planner: Planner, fits: list[Fit], gpu_mem: int, margin: float) -> str:
    m, budget = planner.mcfg, int(gpu_mem * (1 - margin))
    shape = (f"L {m.n_layer}, h {m.n_embd}, heads {m.n_head}, V {m.vocab_size}" if m.kind == "gpt" else
             f"{m.config or m.target}, V {m.vocab_size}")
    head = (f"{m.name}: {planner.shape.n_params:,} parameters ({shape}) | {planner.precision} | {planner.optim} | "
            f"world {planner.world} | seq {planner.seq} | activations as on {planner.device}")
    lines = [head, f"budget per rank: {human_bytes(budget)} = {human_bytes(gpu_mem)} × (1 − margin {margin:g})"]
    host = planner.host_mem  # offload rows: the host's column, its budget per node
    lines += ([f"host budget per node of {planner.node} rank(s): {human_bytes(host)} (--host-mem × (1 − margin))"]
              if host else []) + [""]
    w = max([12] + [len(f.label) for f in fits])
    cols = f"{'strategy':<{w}} {'ckpt':<9} {'max mb':>7} {'peak/rank':>10}  " + " ".join(
        f"{c:>11}" for c in ("states", "activations", "transient")) + (f" {'host/node':>11}" if host else "") \
        + "  dominant"
    lines += [cols, "-" * len(cols)]
    for f in fits:
        states = sum(f.breakdown[k] for k in ("params", "grads", "master", "optim_state", "buffers"))
        mb = str(f.micro_batch) if f.micro_batch else "none"
        at = "" if f.micro_batch else " (at mb 1)"
        lines.append(f"{f.label:<{w}} {f.checkpointing:<9} {mb:>7} {human_bytes(f.peak):>10}  "
                     f"{human_bytes(states):>11} {human_bytes(f.breakdown['activations']):>11} "
                     f"{human_bytes(f.breakdown['transient']):>11}"
                     + (f" {human_bytes(f.host) if f.host else '-':>11}" if host else "") + f"  {f.dominant}"
                     + (" (optimizer step)" if f.phase == "step" else "") + at)
    lines += ["", "max mb: the largest micro-batch per rank whose predicted peak fits the budget ('none': not even 1).",
              "peak = model states + buffers (python -m zerolab memory) + activations saved for backward + transients "
              "of the same moment (logits gradients 8·b·s·V bytes, one recomputed block with checkpointing, the "
              "strategy's buckets / gathered weights); or the optimizer step's, if larger. Not counted: CUDA context, "
              "fragmentation (the margin), NCCL buffers. See zerolab/plan.py."]
    if host:
        lines.append("+offload: the optimizer's shard, its gradient and state on the host (ZeRO-Offload, Ren et al., "
                     "USENIX ATC 2021); +offload+p: the parameter shards too (ZeRO-Infinity, Rajbhandari et al., SC "
                     "2021). host/node: the host bytes of a node's ranks together (pinned staging included); "
                     "peak/rank is the device's.")
    return "\n".join(lines)


def plot_plan(path: str, planner: Planner, fits: list[Fit], gpu_mem: int, margin: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    top = max([f.micro_batch for f in fits] + [1])
    mbs = sorted({1, 2} | {2 ** i for i in range(int(math.log2(max(2, top))) + 2)})
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, label in enumerate(planner.states):
        for ck, style in zip(PLANNED_CHECKPOINTING, ("-", "--", ":")):
            ax.plot(mbs, [planner.peak(label, b, ck)[0] / 1e9 for b in mbs], linestyle=style,
                    marker="os^vDx*P"[i % 8], color=f"C{i}", label=f"{label}" + ("" if ck == "none" else f" + {ck}"))
    ax.axhline(gpu_mem / 1e9, color="k", linewidth=1.5, label=f"GPU memory {human_bytes(gpu_mem)}")
    ax.axhline(gpu_mem * (1 - margin) / 1e9, color="k", linestyle=":", label=f"budget (margin {margin:g})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("micro-batch per rank")
    ax.set_ylabel("predicted peak per rank (GB)")
    ax.set_title(f"{planner.mcfg.name}, {planner.precision}, world {planner.world}, seq {planner.seq}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no line hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- --exact: the chosen micro-batches rehearsed (zerolab.rehearsal) -------------------------------
def strategy_overrides(label: str) -> list[str]:
    """A plan row's strategy label (its MemoryModel.memory_identity: name, or name-<stage>, and an
    offload row's suffix: zerolab.predict.host) as overrides."""
    base, settings = offload.split_label(label)
    name, _, stage = base.partition("-")
    return [f"strategy={name}"] + ([f"strategy.stage={stage}"] if stage else []) + [
        f"strategy.{k}=true" for k in settings]


def model_overrides(mcfg) -> list[str]:
    """A derived GPT shape (--params) as the overrides that build it."""
    keys = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size", "dropout", "bias")
    return ["model=gpt_tiny", f"model.name={mcfg.name}", *(f"model.{k}={getattr(mcfg, k)}" for k in keys)]


def mode_of(job: list[str]) -> Mode:
    """The master/state mode a plan's overrides ask for (precision.master=remainder, ...)."""
    given = dict(o.split("=", 1) for o in job if o.startswith("precision.") and "=" in o)
    return Mode.of({k[len("precision."):]: v for k, v in given.items()})


def row_overrides(planner: Planner, job: list[str], fit: Fit, mb: int) -> list[str]:
    """The overrides of the job a plan row describes, at micro-batch `mb`."""
    return [*job, *strategy_overrides(fit.label), f"precision={planner.precision}", f"optim={planner.optim}",
            f"strategy.bucket_mb={planner.bucket_mb}", f"data.micro_batch={mb}",
            f"model.activation_checkpointing={fit.checkpointing}"]


def confirm(fit: Fit, planner: Planner, job: list[str], budget: int) -> dict:
    """Rehearse rank 0 at the row's micro-batch; if its peak is over the budget, find by bisection
    the largest micro-batch whose rehearsed peak is within it. The row's `rehearsed` fields."""
    from zerolab.rehearsal import rehearse

    def peak(mb: int):
        r = rehearse(row_overrides(planner, job, fit, mb), world=planner.world)
        return r.not_rehearsed, r.measured.get("mem/peak_bytes")

    if not fit.micro_batch:
        return {"rehearsed_micro_batch": 0, "rehearsed_peak_bytes": None, "not_rehearsed": "nothing fits the plan"}
    why, at = peak(fit.micro_batch)
    if why:
        return {"rehearsed_micro_batch": None, "rehearsed_peak_bytes": None, "not_rehearsed": why}
    best, best_peak, lo, hi = fit.micro_batch, at, 0, fit.micro_batch
    if at > budget:
        best, best_peak = 0, None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            _, got = peak(mid)
            lo, hi = (mid, hi) if got <= budget else (lo, mid)
            if got <= budget:
                best, best_peak = mid, got
    return {"rehearsed_micro_batch": best, "rehearsed_peak_bytes": best_peak, "planned_peak_rehearsed_bytes": at,
            "not_rehearsed": ""}


def _model(args) -> tuple:
    """(model config, the overrides that build it for a rehearsal, the activation model or None)."""
    if args.params is not None:
        if args.overrides:
            raise ValueError("--params derives a GPT shape; model overrides name a model: give one of them")
        mcfg = derived_gpt(args.params, args.seq or 2048, args.vocab, args.layers, args.width, args.heads)
        return mcfg, model_overrides(mcfg), None
    if args.layers or args.width or args.heads:
        raise ValueError("--layers/--width/--heads shape a model given by --params; --model has its own")
    job = ([f"model={args.model}"] if args.model else []) + list(args.overrides)
    if not any(o.split("=")[0].lstrip("+") in ("model", "model.config", "model.target") for o in job):
        raise ValueError("name the model: --model NAME (conf/model/), --params N, or overrides as for train.py "
                         "(model=hf model.config=PATH, model=custom model.target=pkg.module:Class)")
    from zerolab.config import check_overrides, compose, config_groups
    from zerolab.models import resolve

    check_overrides(job, config_groups())
    mcfg = compose(job).model
    if mcfg.kind == "mlp":
        raise ValueError("the planner sizes language models with blocks (model.kind=mlp has none)")
    if mcfg.kind == "gpt":  # --seq is checked against its block_size (Planner); a rehearsal trains windows of --seq
        return mcfg, job + ([f"model.block_size={args.seq}"] if args.seq else []), None
    if args.seq:  # a user's model: --seq is the training window (checked against its positions)
        job.append(f"model.block_size={args.seq}")
        mcfg = compose(job).model
    resolve(mcfg)  # model=hf: its vocabulary and window
    from zerolab.rehearsal import activation_model

    return mcfg, job, activation_model(mcfg, mcfg.block_size, args.precision)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerolab plan",
                                description="The largest micro-batch per rank that fits each strategy, with and "
                                            "without activation checkpointing, and the peak memory it predicts; "
                                            "with --hardware, what fits ranked by predicted tokens/s per device.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a model config name from conf/model/ (e.g. gpt2_124m)")
    src.add_argument("--params", type=float,
                     help="parameter count, e.g. 7e9: a GPT shape is derived (GPT-3's proportions)")
    p.add_argument("overrides", nargs="*",
                   help="the model as train.py takes it: model=hf model.config=PATH, model=custom model.target=... "
                        "(its activations are then measured on fake tensors)")
    p.add_argument("--layers", type=int, default=0, help="with --params: layers (default: derived)")
    p.add_argument("--width", type=int, default=0, help="with --params: n_embd (default: derived, a multiple of 128)")
    p.add_argument("--heads", type=int, default=0, help="with --params: heads (default: width / 128)")
    p.add_argument("--vocab", type=int, default=50304, help="with --params: vocabulary size")
    p.add_argument("--gpu-mem", required=True, help="memory per GPU, with a unit: 80GB, 24GiB, 40960MiB")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks (GPUs)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's block_size)")
    p.add_argument("--precision", default="bf16", choices=list(COMPUTE_BYTES))
    p.add_argument("--optim", default="adamw", help="adamw | adam | lamb | lars | sgd | sgd_momentum")
    p.add_argument("--margin", type=float, default=0.1, help="share of GPU and host memory kept free (default 0.1)")
    p.add_argument("--host-mem", default="", help="host memory per node, with a unit (e.g. 2TB): adds offload rows, "
                                                  "held to it with the node's ranks together (--gpus-per-node, 8)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="whose kernels save the activations (attention, dropout masks differ)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="strategy.bucket_mb")
    p.add_argument("--strategies", default="", help="only these rows, e.g. zero1,zero2,zero3,fsdp (default: all)")
    p.add_argument("--exact", action="store_true",
                   help="confirm each row's micro-batch by rehearsing rank 0 (python -m zerolab dry-run)")
    p.add_argument("--micro-batches", default="1,2,4",
                   help="with --hardware: the micro-batches per rank to predict, where they fit (default 1,2,4)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", help="also write this PNG: peak per rank against micro-batch, the memory line drawn")
    predict_cli.add_arguments(p)
    return p


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from zerolab.config import ConfigError

    try:
        gpu_mem = parse_bytes(args.gpu_mem)
        if not 0 <= args.margin < 1:
            raise ValueError(f"--margin={args.margin} must be in [0, 1)")
        host_mem = int(parse_bytes(args.host_mem, "--host-mem") * (1 - args.margin)) if args.host_mem else 0
        mcfg, job, activations = _model(args)
        planner = Planner(mcfg, args.world, args.seq or mcfg.block_size, args.precision, args.optim,
                          "cpu (rehearsed)" if activations else args.device, args.bucket_mb, activations=activations,
                          mode=mode_of(job), host_mem=host_mem,
                          ranks_per_node=args.gpus_per_node or predict_cli.DEFAULT_GPUS_PER_NODE)
        topo = predict_cli.topology(args, args.world) if args.hardware else None
        micro_batches = sorted({int(b) for b in args.micro_batches.split(",")})
        if min(micro_batches) < 1:
            raise ValueError(f"--micro-batches={args.micro_batches}: each must be at least 1")
        wanted = set(filter(None, args.strategies.split(",")))
        if wanted - set(planner.states):
            raise ValueError(f"--strategies: no row {', '.join(sorted(wanted - set(planner.states)))}; "
                             f"the rows: {', '.join(planner.states)}")
    except (ValueError, NotImplementedError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget = int(gpu_mem * (1 - args.margin))
    fits = [f for f in planner.table(budget) if not wanted or f.label in wanted]
    confirmed = [confirm(f, planner, job, budget) for f in fits] if args.exact else []
    speed = rank_by_speed(planner, job, fits, topo, micro_batches) if topo is not None else None
    _print(args, planner, fits, confirmed, speed, gpu_mem, budget)
    if args.plot:
        plot_plan(args.plot, planner, fits, gpu_mem, args.margin)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print(args, planner: Planner, fits: list[Fit], confirmed: list[dict], speed, gpu_mem: int, budget: int) -> None:
    if args.json:
        m = planner.mcfg
        rows = [{**f.to_dict(), **(confirmed[i] if confirmed else {})} for i, f in enumerate(fits)]
        print(json.dumps({"model": m.name, "n_params": planner.shape.n_params,
                          "shape": {k: getattr(m, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
                          if m.kind == "gpt" else {"vocab_size": m.vocab_size, "source": m.config or m.target},
                          "precision": args.precision, "optim": args.optim, "world": args.world, "seq": planner.seq,
                          "device": planner.device, "gpu_mem_bytes": gpu_mem, "margin": args.margin,
                          "budget_bytes": budget, "rows": rows, **({"speed": speed} if speed is not None else {})},
                         indent=2))
        return
    print(format_plan(planner, fits, gpu_mem, args.margin))
    if confirmed:
        print(format_exact(fits, confirmed, budget))
    if speed is not None:
        print(format_speed(speed))


# ---- --hardware: what fits, ranked by predicted speed (zerolab.predict) ------------------------------
def rank_by_speed(planner: Planner, job: list[str], fits: list[Fit], topo, micro_batches: list[int]) -> dict:
    """Every (row, micro-batch) that fits, its step rehearsed (rank 0, recorded) and priced on
    `topo`, fastest first; rows that cannot be rehearsed (DeepSpeed) are listed apart. An offload
    row is its job without offload, rehearsed once for both, with the host's side priced on it."""
    from zerolab.rehearsal import rehearse

    rows, skipped, assumptions, host_notes, seen = [], [], [], [], {}
    nodes = [f"dist.ranks_per_node={predict_cli.ranks_per_node(topo)}"] if predict_cli.ranks_per_node(topo) else []
    for fit in fits:
        base, settings = offload.split_label(fit.label)
        for mb in (b for b in micro_batches if b <= fit.micro_batch):
            if fit.label in {s["strategy"] for s in skipped}:
                break
            if (base, fit.checkpointing, mb) not in seen:
                over = row_overrides(planner, job, replace(fit, label=base), mb)
                seen[base, fit.checkpointing, mb] = rehearse([*over, *nodes], world=planner.world, record=True,
                                                             quick=True)
            r = seen[base, fit.checkpointing, mb]
            why = r.not_rehearsed or ("" if not settings or offload.host_of(topo.device) else
                                      f"no host figures for {topo.device.name} (zerolab/predict/host.py)")
            if why:
                skipped.append({"strategy": fit.label, "why": why})
                break
            p = predict_cli.priced(r, topo)
            step, parts = p.step_s, p.parts
            if settings:
                c = COMPUTE_BYTES[planner.precision]
                t = offload.offloaded(r.record, p.step_s, topo, settings, n_params=planner.shape.n_params,
                                      weight_bytes=c, grad_bytes=4 if base == "fsdp" else c)
                step, parts, host_notes = t.step_s, {**p.parts, **t.parts}, t.assumptions
            assumptions = p.assumptions
            rows.append({"strategy": fit.label, "checkpointing": fit.checkpointing, "micro_batch": mb,
                         "peak_bytes": planner.peak(fit.label, mb, fit.checkpointing)[0], "step_s": step,
                         "tokens_per_s_per_device": r.tokens_per_rank / step if step else 0.0,
                         "mfu": p.mfu * p.step_s / step if step else 0.0, "host_bytes_per_node": fit.host,
                         "comm_exposed_share": p.parts["comm_exposed"] / step if step else 0.0, "parts": parts})
    rows.sort(key=lambda row: -row["tokens_per_s_per_device"])
    return {"hardware": topo.device.name, "world": topo.world, "rows": rows, "not_rehearsed": skipped,
            "assumptions": assumptions + host_notes}
