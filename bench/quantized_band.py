"""ZeRO++'s quantized collectives against their loss band (docs/nodes.md, "The loss band"): gpt_small
on 4 gloo ranks laid out as 2 nodes x 2, zero3 with and without qwZ/qgZ, the same seed and batches.

    flock /tmp/zerolab-heavy.lock .venv/bin/python bench/quantized_band.py --out /tmp/qband

Runs (one torchrun job each, OMP_NUM_THREADS=1 per rank, 200 steps of AdamW in fp32, micro-batch 4
per rank; a finished one already in --out is reused): zero3 (the reference), zero3 with qwZ and
qgZ, with each alone, ddp (the same arithmetic summed in another order: how far fp32 rounding
alone carries two runs apart), and zero3 with two other seeds (the run-to-run spread). Printed:

1. per quantized run, the per-step loss difference from zero3 against the band that
   zerolab.report.band computes (the figures the report's parity line uses), the held-out loss at
   every eval, and the final weights' distance from zero3's, global and per tensor;
2. the band's assumptions, measured in this process at zero3's weights of steps 0 and 200 (the
   batches of the step after each): qwZ's forward term L(ŵ) − L(w) beside its two bounds, and the
   gradient errors of qgZ (a replay of its two int4 hops) and of qwZ (the gradient at ŵ) beside
   the minibatch gradient noise, estimated from 16 micro-batches;
3. the run-to-run spread S of the held-out loss (three seeds) beside the exact run's per-step loss
   noise σ (the band stands for S by √2·σ: docs/nodes.md), and each quantized run's held-out loss
   difference from zero3 in units of S and of (r/√2)·S, the linear-response estimate.

--root runs the training from another tree (a `git archive` of a commit, say), as
bench/same_weights.py does; the analysis is this tree's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from zerolab.report.band import Z, loss_band, step_noise  # noqa: E402

WORLD, PER_NODE, BLOCK = 4, 2, 256
COMMON = ["model=gpt_small", "data.micro_batch=4", f"dist.ranks_per_node={PER_NODE}", "trainer.eval_every=20",
          "trainer.eval_batches=4", "logging.wandb.mode=disabled", "logging.progress=false"]
QW, QG = "strategy.quantize_weights=true", "strategy.quantize_grads=true"
RUNS = {
    "zero3": ["strategy=zero3"],
    "qwz_qgz": ["strategy=zero3", QW, QG],
    "qwz": ["strategy=zero3", QW],
    "qgz": ["strategy=zero3", QG],
    "ddp": ["strategy=ddp"],
    "zero3_seed_1338": ["strategy=zero3", "trainer.seed=1338"],
    "zero3_seed_1339": ["strategy=zero3", "trainer.seed=1339"],
}
QUANTIZED = {"qwz_qgz": 127, "qwz": 127, "qgz": 0}  # label -> L of the forward's weight rounding (Lossy)
SEEDS = ("zero3", "zero3_seed_1338", "zero3_seed_1339")


# ---- the runs ----------------------------------------------------------------------------------------
def train(label: str, steps: int, out: Path, root: Path) -> Path:
    run_dir = out / label
    if (run_dir / "summary.json").exists() and (run_dir / "model.safetensors").exists():
        return run_dir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(root / "train.py"), *COMMON, *RUNS[label], f"trainer.max_steps={steps}", f"run.dir={run_dir}",
           "run.overwrite=true"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    print(f"# training {label}: {' '.join(cmd[5:])}", flush=True)
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{label} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(str(run_dir / "model.safetensors")).items()}


def conditions(root: Path) -> str:
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    tree = "this tree" if root == HERE else str(root)
    return (f"# {datetime.datetime.now().isoformat(timespec='minutes')}, commit {git('rev-parse', '--short', 'HEAD')}"
            f"{' (uncommitted changes)' if git('status', '--porcelain') else ''}, training from {tree}; {cpu}, "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; torch {torch.__version__}; {WORLD} gloo ranks as "
            f"{WORLD // PER_NODE} nodes x {PER_NODE}, OMP_NUM_THREADS=1; " + " ".join(COMMON))


# ---- 1. the loss curves and the final weights -----------------------------------------------------
def distance(a: dict, b: dict, w0: dict) -> tuple[float, dict, dict]:
    """Global ‖a − b‖/‖b‖; per tensor ‖a − b‖/‖b‖; per tensor the share of b's movement ‖a − b‖/‖b − w0‖."""
    rel = {k: ((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in b}
    share = {k: ((a[k] - b[k]).norm() / (b[k] - w0[k]).norm().clamp_min(1e-12)).item() for k in b}
    num = math.sqrt(sum((a[k] - b[k]).pow(2).sum().item() for k in b))
    return num / math.sqrt(sum(v.pow(2).sum().item() for v in b.values())), rel, share


def weight_line(label: str, got: dict, ref: dict, w0: dict) -> str:
    glob, rel, share = distance(got, ref, w0)
    worst = max(rel, key=rel.get)
    med = lambda d: sorted(d.values())[len(d) // 2]
    return (f"final weights vs zero3: global ‖Δw‖/‖w‖ {glob:.3e}; per tensor ‖Δw‖/‖w‖ max {rel[worst]:.3e} "
            f"({worst}), median {med(rel):.3e}; share of zero3's movement ‖Δw‖/‖w − w0‖ max {max(share.values()):.3f}"
            f" ({max(share, key=share.get)}), median {med(share):.3f}")


def compare(label: str, got: list[dict], ref: list[dict], levels: int, max_weight: float, decay: float) -> dict:
    band = loss_band(got, ref, (levels, 0), max_weight, decay)
    print(f"\n## {label} against zero3: d = L_{label} − L_zero3 per step, band = forward + "
          f"{band['k']:g}·√2·σ (σ: zero3's own per-step loss noise)\n")
    print("| step | L zero3 | d | forward | σ | band | abs(d)/band |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in band["rows"]:
        if row["step"] in (1, 2, 5, 10, band["worst_step"]) or row["step"] % 25 == 0:
            print(f"| {row['step']} | {row['ref']:.4f} | {row['d']:+.2e} | {row['forward']:.2e} | {row['sigma']:.2e} "
                  f"| {row['band']:.2e} | {abs(row['d']) / row['band']:.3f} |")
    ratios = sorted(abs(r["d"]) / r["band"] for r in band["rows"])
    print(f"\n{label}: {band['verdict']}: {band['outside']} of {len(ratios)} steps outside; abs(d)/band max "
          f"{ratios[-1]:.3f} (step {band['worst_step']}), p95 {ratios[int(0.95 * len(ratios))]:.3f}, median "
          f"{ratios[len(ratios) // 2]:.3f}; max abs(d) {max(abs(r['d']) for r in band['rows']):.3e}; mean d over the "
          f"last 50 steps {band['tail_mean_d']:+.2e} (√2·σ/√50 = {band['tail_sigma']:.2e})")
    return band


def eval_line(got: list[dict], ref: list[dict]) -> str:
    ev = [(r["step"], r["eval_loss"] - e["eval_loss"]) for r, e in zip(got, ref)
          if "eval_loss" in r and "eval_loss" in e]
    return "held-out loss minus zero3's (the same 64 windows each eval): " + ", ".join(f"{s}: {d:+.1e}" for s, d in ev)


# ---- 2. the assumptions, measured in this process ----------------------------------------------------
def qdq(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows quantized and dequantized as the wire does, and each element's s/2 (its block's)."""
    from zerolab.strategies.zero.quantized import decode, encode

    values, scale = decode(encode(rows, BLOCK, bits), rows.shape[1], BLOCK, bits)
    return values, (scale / 2).repeat_interleave(BLOCK, dim=1)[:, :rows.shape[1]]


def buckets(model) -> list[list[torch.nn.Parameter]]:
    """One bucket per unit, as zero3 gathers them: each block, then the root's parameters."""
    units: dict[str, list] = {}
    for name, p in model.named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        units.setdefault(key, []).append(p)
    return list(units.values())


def flat(tensors, n: int) -> torch.Tensor:
    v = torch.cat([t.detach().flatten().double() for t in tensors])
    return torch.cat([v, v.new_zeros(-len(v) % n)])


def qgz_replay(contrib: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """qgZ's two int4 hops on one bucket (zero/quantized.py's module docstring): `contrib[j]` is rank j's
    gradient / N; returns the reduced bucket (chunks in rank order) and each element's bound Σ s/2."""
    n, m = PER_NODE, WORLD // PER_NODE
    c = len(contrib[0]) // WORLD
    out = torch.zeros(WORLD, c, dtype=torch.float64)
    bound = torch.zeros(WORLD, c, dtype=torch.float64)
    for node in range(m):
        partial = torch.zeros(WORLD * c, dtype=torch.float64)
        for j in range(node * n, (node + 1) * n):
            rows = contrib[j].view(m, n, c).transpose(0, 1).reshape(n, m * c).float()  # row l: local rank l's
            values, half = qdq(rows, 4)
            back = lambda x: x.double().reshape(n, m, c).transpose(0, 1).reshape(WORLD, c)
            partial += back(values).flatten()
            bound += back(half)
        values, half = qdq(partial.view(WORLD, c).float(), 4)  # hop 2: each chunk's node partial, to its owner
        out += values.double()
        bound += half.double()
    return out.flatten(), bound.flatten()


def replay(step: int, w: dict, cfg) -> dict:
    from zerolab.data import build_data
    from zerolab.data.sampler import WindowSampler
    from zerolab.models import build_model, lm_loss

    model = build_model(cfg.model)
    model.load_state_dict({k: v.float() for k, v in w.items()})
    data, n_windows = build_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size, cfg.trainer.seed)
    sampler = WindowSampler(n_windows, cfg.trainer.seed, cfg.data.micro_batch, 1, WORLD)
    units = buckets(model)

    def grad(s: int, rank: int) -> tuple[float, list[torch.Tensor]]:
        b = data.train_batch(sampler, s, rank, 0, "cpu")
        model.zero_grad()
        loss = lm_loss(model(b.x), b.y)
        loss.backward()
        return loss.item(), [flat([p.grad for p in u], WORLD) for u in units]

    # the minibatch noise of the global batch's gradient: the spread of 16 micro-batch gradients, / √N
    micro = [grad(s, r) for s in range(step, step + 4) for r in range(WORLD)]
    vecs = [torch.cat(g) for _, g in micro]
    mean16 = torch.stack(vecs).mean(0)
    sigma_g = math.sqrt(sum((v - mean16).pow(2).sum().item() for v in vecs) / (len(vecs) - 1) / WORLD)
    step_grads = micro[:WORLD]  # this step's: ranks 0..3
    exact = [sum(g[u] for _, g in step_grads) / WORLD for u in range(len(units))]
    g_exact = torch.cat(exact)
    loss = statistics.fmean(x for x, _ in step_grads)
    # qgZ: the replayed two hops against the exact mean
    reduced = [qgz_replay([g[u] / WORLD for _, g in step_grads]) for u in range(len(units))]
    e_qg = torch.cat([r for r, _ in reduced]) - g_exact
    bound_qg = torch.cat([b for _, b in reduced]).norm().item()
    # qwZ: every rank's chunk of every bucket rounded to int8, the forward and backward at ŵ
    w_hat, eps_sq = [], 0.0
    for u in units:
        v = flat(u, WORLD).view(WORLD, -1).float()
        values, half = qdq(v, 8)
        w_hat.append(values.double().flatten())
        eps_sq += half.double().pow(2).sum().item()
    w_flat = torch.cat([flat(u, WORLD) for u in units])
    with torch.no_grad():
        for u, v in zip(units, w_hat):
            offset = 0
            for p in u:
                p.copy_(v[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    at_hat = [grad(step, r) for r in range(WORLD)]
    loss_hat = statistics.fmean(x for x, _ in at_hat)
    e_qw = torch.cat([sum(g[u] for _, g in at_hat) / WORLD for u in range(len(units))]) - g_exact
    gn, max_w = g_exact.norm().item(), w_flat.abs().max().item()
    ratios = {"qgz": e_qg.norm().item() / sigma_g, "qwz": e_qw.norm().item() / sigma_g}
    print(f"\n## the assumptions at zero3's weights of step {step} (the batches of step {step + 1})\n")
    print(f"- gradient ‖g‖ {gn:.4f}; minibatch noise of the global batch σ_g {sigma_g:.4f} ({sigma_g / gn:.2f} ‖g‖)")
    e = e_qg.norm().item()
    print(f"- qgZ: ‖e‖ {e:.4f} = {e / gn:.3f} ‖g‖ = r {e / sigma_g:.3f} σ_g; its bound ‖Σ s/2‖ {bound_qg:.4f} = "
          f"{bound_qg / sigma_g:.3f} σ_g; along g: e·g/‖g‖² "
          f"{(e_qg @ g_exact).item() / gn ** 2:+.2e} (a bias would shrink or grow every step)")
    print(f"- qwZ, gradient at ŵ: ‖g(ŵ) − g(w)‖ {e_qw.norm().item():.4f} = r {e_qw.norm().item() / sigma_g:.3f} σ_g")
    print(f"- qwZ, forward: ‖ŵ − w‖ {(torch.cat(w_hat) - w_flat).norm().item():.4f} of its bound ε = √Σ(s/2)² "
          f"{math.sqrt(eps_sq):.4f}; L(ŵ) − L(w) {loss_hat - loss:+.3e} against ‖g‖·ε {gn * math.sqrt(eps_sq):.3e} "
          f"(Cauchy-Schwarz) and Z·‖g‖·max|w|/127 {Z * gn * max_w / 127:.3e} (Hoeffding, p = 1e-4; max|w| {max_w:.3f})")
    return ratios


# ---- 3. the run-to-run spread -------------------------------------------------------------------------
def spread(m: dict, r: dict[str, float]) -> None:
    """S_t: the standard deviation of a difference of two seeds' held-out losses (3 seeds, on the same
    64 windows), beside σ_t of zero3's curve: the band stands for S_t by √2·σ_t, which needs
    S_t <= √2·σ_t (docs/nodes.md). Each quantized run's held-out difference from zero3 in units of
    S_t (a rerun's: the band's premise), and of (r/√2)·S_t (what linear response would give it)."""
    from zerolab.report.band import BURST_WINDOW

    ref = m["zero3"]
    curve = [x["loss"] for x in ref]
    sigma = dict(zip([x["step"] for x in ref], map(max, step_noise(curve), step_noise(curve, BURST_WINDOW))))
    r_of = {"qwz_qgz": r["qgz"] + r["qwz"], "qwz": r["qwz"], "qgz": r["qgz"]}  # r of both: at most the sum
    labels = [x for x in QUANTIZED if x in m]
    print(f"\n## the held-out loss: the spread S over 3 seeds beside σ; each quantized run's Δ from zero3 as "
          f"Δ/S and Δ/((r/√2)·S), r the largest measured ({', '.join(f'{k} {v:.3f}' for k, v in r_of.items())})\n")
    print("| step | S | σ | S/(√2·σ) | " + " | ".join(f"{x}: Δ/S, Δ/(r/√2·S)" for x in labels) + " |")
    print("|---:|---:|---:|---:|" + "---:|" * len(labels))
    for recs in zip(*[m[x] for x in (*SEEDS, *labels)]):
        if not all("eval_loss" in x for x in recs):
            continue
        step, vals = recs[0]["step"], [x["eval_loss"] for x in recs[:len(SEEDS)]]
        s_t = math.sqrt(2) * statistics.stdev(vals)  # the std of a difference of two runs
        cells = []
        for lab, x in zip(labels, recs[len(SEEDS):]):
            d = x["eval_loss"] - recs[0]["eval_loss"]
            cells.append(f"{d / s_t:+.2f}, {d / (r_of[lab] / math.sqrt(2) * s_t):+.2f}")
        print(f"| {step} | {s_t:.3f} | {sigma[step]:.3f} | {s_t / (math.sqrt(2) * sigma[step]):.2f} | "
              + " | ".join(cells) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="run directories (kept: a rerun reuses finished runs)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--runs", default=",".join(RUNS), help="labels of RUNS (default: all of them)")
    p.add_argument("--root", type=Path, default=HERE, help="the zerolab tree to train with (default: this one)")
    args = p.parse_args()
    from zerolab.config import compose
    from zerolab.models import build_model

    labels = ["zero3", *[x for x in args.runs.split(",") if x != "zero3"]]
    print(conditions(args.root.resolve()), flush=True)
    dirs = {label: train(label, args.steps, args.out, args.root.resolve()) for label in labels}
    m = {label: metrics(d) for label, d in dirs.items()}
    cfg = compose(COMMON + RUNS["zero3"] + [f"trainer.max_steps={args.steps}"], world_size=WORLD)
    torch.manual_seed(cfg.trainer.seed)  # the initial weights, as the trainer builds them
    w0 = {k: v.double() for k, v in build_model(cfg.model).state_dict().items()}
    ref, w_ref = m["zero3"], weights(dirs["zero3"])
    norm = math.sqrt(sum(v.pow(2).sum().item() for v in w_ref.values()))
    print(f"\nzero3: loss {ref[0]['loss']:.4f} at step 1, {ref[-1]['loss']:.4f} at {ref[-1]['step']}; held-out "
          f"{ref[-1].get('eval_loss', float('nan')):.4f}; ‖w‖ {norm:.2f}")
    for label in labels[1:]:
        got = weights(dirs[label])
        if label in QUANTIZED:
            max_w = max(max(v.abs().max().item() for v in x.values()) for x in (got, w_ref))
            compare(label, m[label], ref, QUANTIZED[label], max_w, cfg.optim.weight_decay)
        else:
            band = loss_band(m[label], ref)
            print(f"\n## {label} against zero3 (exact arithmetic): max abs(d) "
                  f"{max(abs(r['d']) for r in band['rows']):.3e}; abs(d)/band max {band['worst_ratio']:.3f} "
                  f"(step {band['worst_step']}), {band['outside']} of {len(band['rows'])} steps outside")
        print(eval_line(m[label], ref))
        print(weight_line(label, got, w_ref, w0))
        if label in QUANTIZED:
            _, rel, _ = distance(got, w_ref, w0)
            print("per tensor ‖Δw‖/‖w‖: " + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()))
    found = [replay(step, w, cfg) for step, w in ((0, w0), (args.steps, w_ref))]
    if all(s in m for s in SEEDS):
        spread(m, {k: max(f[k] for f in found) for k in found[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
