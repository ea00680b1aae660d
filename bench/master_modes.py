"""Below the floor, measured in one process: gpt_small trained in bf16 under every master and state
mode (zerolab/precision_modes.py) with zerolab's model, data, optimizer and step arithmetic, as
ddp computes it at one rank (MasterCopy, the global norm, clipping, the update, the weights
refreshed); and how often the remainder's weight rounding differs from torch's in a real run.

  python bench/master_modes.py --steps 300               # the lossy modes beside the fp32 master
  python bench/master_modes.py --steps 50 --exact        # remainder vs fp32 master, bit for bit per step

Prints one table (and --json FILE writes the numbers): per mode, loss at a few steps, the final
held-out loss, the final weights' distance to the fp32-master run (relative L2 over the model,
largest per-tensor relative max |Δ|), and bytes per parameter. With --exact: the rebuilt master
against the fp32-master run's after every step, with its weights rounded as the remainder's
(nearest_away: bit for bit) and as torch rounds (nearest_even: the first step bit for bit, then
the even ties' ulps compound), and per step the share of master elements at an even tie (where
the two roundings differ) and the share truncation would move.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zerolab.config import compose  # noqa: E402
from zerolab.data import WindowSampler, build_data  # noqa: E402
from zerolab.master import rebuild  # noqa: E402
from zerolab.models import build_model, lm_loss, param_groups, place  # noqa: E402
from zerolab import numerics  # noqa: E402
from zerolab.optim import build_optimizer  # noqa: E402
from zerolab.optim.schedule import LRSchedule  # noqa: E402
from zerolab.precision import MasterCopy, Precision  # noqa: E402
from zerolab.precision_modes import Mode, model_state_bytes  # noqa: E402
from zerolab.report.band import loss_band  # noqa: E402

MODES = {  # label -> precision overrides
    "fp32 master": [],
    "remainder": ["precision.master=remainder"],
    "bf16 states": ["precision.optim_states=bf16"],
    "remainder + bf16 states": ["precision.master=remainder", "precision.optim_states=bf16"],
    "bf16 master": ["precision.master=bf16"],
    "bf16 master + states": ["precision.master=bf16", "precision.optim_states=bf16"],
}


class Run:
    """One process's bf16 training of the config, step by step."""

    def __init__(self, overrides: list[str], optim: str):
        self.cfg = cfg = compose(["model=gpt_small", "precision=bf16", f"optim={optim}", "data.micro_batch=8",
                                  *overrides])
        torch.manual_seed(cfg.trainer.seed)
        self.model = build_model(cfg.model)
        self.prec = Precision.from_config(cfg.precision)
        place(self.model, torch.device("cpu"), self.prec.compute_dtype)
        groups = param_groups(self.model, cfg.optim.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.names = [n for g in groups for n in g["names"]]
        self.master = MasterCopy(self.params, self.prec)
        self.opt = build_optimizer(cfg.optim, self.master.groups(groups))
        self.data, n = build_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size, cfg.trainer.seed)
        self.sampler = WindowSampler(n, cfg.trainer.seed, cfg.data.micro_batch, 1, 1)

    def step(self, step: int, schedule: LRSchedule) -> float:
        b = self.data.train_batch(self.sampler, step, 0, 0, torch.device("cpu"))
        loss = lm_loss(self.model(b.x), b.y)
        loss.backward()
        self.master.grads_to_master()
        grads = [m.grad for m in self.master.master if m.grad is not None]
        d = numerics.decide_on_host(numerics.norm_sq(grads, torch.device("cpu")), 1.0, self.cfg.optim.grad_clip)
        numerics.multiply(grads, d.multiplier)
        for g in self.opt.param_groups:
            g["lr"] = schedule(step)
        self.opt.step()
        self.master.master_to_model()
        for p, m in zip(self.params, self.master.master):
            p.grad, m.grad = None, None
        return loss.item()

    def fp32(self) -> list[torch.Tensor]:
        return [self.master.fp32(i).clone() for i in range(len(self.params))]

    @torch.no_grad()
    def eval_loss(self, batches: int = 8) -> float:
        losses = [lm_loss(self.model(b.x), b.y).item()
                  for b in (self.data.val_batch(i, 0, 1, 8, torch.device("cpu")) for i in range(batches))]
        return sum(losses) / len(losses)


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(relative L2 over the whole model, the largest per-tensor max|Δ| / max|b|)."""
    num = sum((x.double() - y.double()).pow(2).sum() for x, y in zip(a, b)).sqrt()
    den = sum(y.double().pow(2).sum() for y in b).sqrt()
    worst = max(((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item()
                for x, y in zip(a, b))
    return (num / den).item(), worst


def tie_shares(masters: list[torch.Tensor]) -> tuple[float, float]:
    """Shares of master elements whose two roundings differ (an even tie) and that truncation moves."""
    bits = torch.cat([m.reshape(-1).view(torch.int32).long() & 0xFFFFFFFF for m in masters])
    low, high = bits & 0xFFFF, bits >> 16
    tie = ((low == 0x8000) & (high % 2 == 0)).double().mean().item()
    truncated = ((low > 0x8000) | ((low == 0x8000) & (high % 2 == 1))).double().mean().item()
    return tie, truncated


def lossy_table(steps: int, optim: str) -> dict:
    out = {}
    reference = reference_records = None
    for label, overrides in MODES.items():
        run, t0 = Run(overrides, optim), time.time()
        schedule = LRSchedule.from_config(run.cfg.optim, 8, steps)
        losses = [run.step(s, schedule) for s in range(steps)]
        final = run.fp32()
        if reference is None:
            reference = final
        mode = Mode.of(run.cfg.precision)
        records = [{"step": s + 1, "loss": x, "lr": schedule(s)} for s, x in enumerate(losses)]
        if label == "fp32 master":
            reference_records = records
        band = loss_band(records, reference_records)  # the run report's band (zerolab/report/band.py)
        out[label] = {"loss": {s: losses[s - 1] for s in (1, steps // 3, 2 * steps // 3, steps)},
                      "band": {k: band.get(k) for k in ("verdict", "worst_step", "worst_ratio", "outside")},
                      "losses": losses,
                      "mean_loss_last_50": sum(losses[-50:]) / len(losses[-50:]), "eval_loss": run.eval_loss(),
                      "distance": distance(final, reference), "lossy": mode.lossy,
                      "bytes_per_param": {s: sum(model_state_bytes(s, 8, mode).values()) for s in (0, 1, 2, 3)},
                      "seconds": time.time() - t0}
        print(f"{label}: eval {out[label]['eval_loss']:.4f}  distance {out[label]['distance']}  "
              f"band {out[label]['band']}  {out[label]['seconds']:.0f} s", flush=True)
    return out


def exact_table(steps: int, optim: str) -> dict:
    rem = Run(["precision.master=remainder"], optim)
    away = Run(["precision.weight_rounding=nearest_away"], optim)
    even = Run([], optim)
    schedule = LRSchedule.from_config(rem.cfg.optim, 8, steps)
    rows = []
    for s in range(steps):
        for r in (rem, away, even):
            r.step(s, schedule)
        m_rem, m_away, m_even = rem.fp32(), away.fp32(), even.fp32()
        same_away = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(m_rem, m_away))
        same_even = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(m_rem, m_even))
        differing = sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(m_rem, m_even))
        tie, trunc = tie_shares(m_even)
        rows.append({"step": s + 1, "bitwise_vs_nearest_away": same_away, "bitwise_vs_nearest_even": same_even,
                     "elements_differing_vs_nearest_even": differing,
                     "distance_vs_nearest_even": distance(m_rem, m_even), "even_tie_share": tie,
                     "truncation_moves_share": trunc})
    check = [(w, rebuild(w.detach(), r)) for w, r in zip(rem.params, rem.master.remainders)]
    assert all(torch.isfinite(m).all() for _, m in check)
    return {"per_step": rows, "n_params": sum(p.numel() for p in rem.params)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--exact", action="store_true", help="the remainder against the fp32 master, per step")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    result = exact_table(a.steps, a.optim) if a.exact else lossy_table(a.steps, a.optim)
    if a.exact:
        rows = result["per_step"]
        print(f"{'step':>5} {'=away':>6} {'=even':>6} {'differ':>8} {'rel L2 vs even':>15} {'even ties':>10} "
              f"{'trunc moves':>11}")
        for r in rows:
            print(f"{r['step']:>5} {str(r['bitwise_vs_nearest_away']):>6} {str(r['bitwise_vs_nearest_even']):>6} "
                  f"{r['elements_differing_vs_nearest_even']:>8} {r['distance_vs_nearest_even'][0]:>15.3e} "
                  f"{r['even_tie_share']:>10.2e} {r['truncation_moves_share']:>11.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
