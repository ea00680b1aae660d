"""The loss band of a run that rounds on purpose (docs/nodes.md, "The loss band"): ZeRO++'s
quantized collectives today (Strategy.lossy), held against an exact run of the same job.

Both runs start from the same weights and draw the same batches, so the logged training loss
differs at step t by d_t = L_q − L. The band, per logged step:

    band_t = forward_t + K·√2·σ_t

- forward_t: what rounding the forward's weights costs at that step. Each weight is off by at most
  s/2 = max|w|/(2L) (L = Lossy.forward_levels); with the rounding errors independent of the
  gradient and of mean zero, Hoeffding's inequality bounds the first-order change g·δ by
  Z·‖g‖·s_max except with probability p = 1e-4 per step; max|w| over the run is bounded from the
  final weights back (an Adam-type step moves a weight by at most lr, weight decay shrinks it by
  at most lr·λ·|w|). 0 when neither run rounds its forward's weights.
- K·√2·σ_t: the trajectory term. Quantization noise of mean zero and smaller than the minibatch
  gradient noise (measured: bench/quantized_band.py) moves the run no further from the exact one
  than a rerun with another seed moves, whose spread on common batches is S_t. σ_t is the
  baseline's own per-step loss noise (second differences of its curve, so the trend cancels; the
  larger of a wide window's estimate, stable, and a narrow one's, which follows a burst such as a
  loss spike); √2·σ_t, the least per-step spread of a rerun (it draws other batches), stands for
  S_t, which needs S_t <= √2·σ_t (measured there: at most 1.08 of it); K = 4 standard deviations.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

K = 4.0  # the trajectory term's width in standard deviations: one step in 16,000 outside for Gaussian noise
HOEFFDING_P = 1e-4  # the forward term's failure probability per step
Z = math.sqrt(math.log(2 / HOEFFDING_P) / 2)  # P(|Σ g_i δ_i| >= Z·√Σ(g_i s_i)²) <= p, with |δ_i| <= s_i/2
HALF_WINDOW = 50  # σ_t from the second differences within ±50 logged steps ...
BURST_WINDOW = 5  # ... or within ±5, where that is larger: a spike of height h there adds ~1.7h to the band
MIN_STEPS = 20  # fewer common logged steps: no band (σ_t needs a few dozen second differences)


def step_noise(losses: list[float], half: int = HALF_WINDOW) -> list[float]:
    """σ_t of one loss curve: white noise of std σ has second differences of variance 6σ², and a
    smooth trend's second differences are ~0; their mean square within ±half logged steps. On white
    noise around a trend (200 steps, 50 curves) every window's estimate was within 0.75-1.33 σ."""
    d2 = [(losses[i - 1] - 2 * losses[i] + losses[i + 1]) ** 2 for i in range(1, len(losses) - 1)]
    out = []
    for t in range(len(losses)):
        lo = max(0, min(t - 1, len(d2) - 1) - half)
        out.append(math.sqrt(statistics.fmean(d2[lo:lo + 2 * half + 1]) / 6))
    return out


def weight_ceiling(max_final: float, records: list[dict], weight_decay: float) -> float:
    """A bound on max|w| over the run from the final weights' max|w|: going back a step undoes at
    most lr of an Adam-type update and a decay of lr·λ·|w|, so |w_t| <= (|w_T| + Σlr)·e^(λΣlr)."""
    steps = [r["step"] for r in records]
    total_lr = sum(r["lr"] * (s - p) for r, s, p in zip(records, steps, [0] + steps[:-1]))
    return (max_final + total_lr) * math.exp(weight_decay * total_lr)


def loss_band(got: list[dict], ref: list[dict], levels: tuple[int, int] = (0, 0), max_weight: float = 0.0,
              weight_decay: float = 0.0) -> dict:
    """d_t and band_t at every step both runs logged (metrics.jsonl records), and the verdict.
    `levels`: Lossy.forward_levels of (got, ref); `max_weight`: max|w| of the final weights."""
    a = {r["step"]: r for r in got if _finite(r.get("loss"))}
    b = {r["step"]: r for r in ref if _finite(r.get("loss"))}
    steps = sorted(a.keys() & b.keys())
    if len(steps) < MIN_STEPS:
        return {"verdict": "no band", "why": f"{len(steps)} common logged steps (the band needs {MIN_STEPS})",
                "rows": [], "k": K}
    curve = [b[s]["loss"] for s in steps]
    sigma = [max(x, y) for x, y in zip(step_noise(curve), step_noise(curve, BURST_WINDOW))]
    ceiling = weight_ceiling(max_weight, [b[s] for s in steps], weight_decay)
    rows = []
    for s, sig in zip(steps, sigma):
        # Z·‖g‖·s_max per run that rounds its forward's weights, s_max = ceiling/L
        forward = sum(Z * r[s].get("grad_norm", 0.0) * ceiling / lv for r, lv in ((a, levels[0]), (b, levels[1])) if lv)
        d = a[s]["loss"] - b[s]["loss"]
        rows.append({"step": s, "ref": b[s]["loss"], "d": d, "forward": forward, "sigma": sig,
                     "band": forward + K * math.sqrt(2) * sig})
    worst = max(rows, key=lambda r: abs(r["d"]) / r["band"])
    tail = rows[-50:]
    return {"verdict": "within band" if all(abs(r["d"]) <= r["band"] for r in rows) else "OUTSIDE BAND",
            "rows": rows, "k": K, "worst_step": worst["step"], "worst_ratio": abs(worst["d"]) / worst["band"],
            "worst": worst, "outside": sum(abs(r["d"]) > r["band"] for r in rows),
            "tail_mean_d": statistics.fmean(r["d"] for r in tail),
            "tail_sigma": math.sqrt(2) * statistics.fmean(r["sigma"] for r in tail) / math.sqrt(len(tail))}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def band_verdict(kind: str, what: str, band: dict, weight_distance: Optional[float], fn: Optional[dict]) -> dict:
    """The parity verdict of a lossy run: '<kind>: within band' or '<kind>: OUTSIDE BAND' (or
    '<kind>: no band' without a loss curve to hold), with the figures; never 'match'."""
    figures = [what]
    if band["rows"]:
        w = band["worst"]
        n = len(band["rows"])
        figures.append((f"loss within its band at all {n} logged steps" if not band["outside"] else
                        f"loss outside its band at {band['outside']} of {n} logged steps") + ", "
                       f"worst |Δloss|/band {band['worst_ratio']:.2f} at step {w['step']} (|Δloss| {abs(w['d']):.2e}, "
                       f"band {w['band']:.2e} = forward {w['forward']:.2e} + {band['k']:g}·√2·σ "
                       f"{w['band'] - w['forward']:.2e})")
    else:
        figures.append(band["why"])
    if weight_distance is not None:
        figures.append(f"final weights ‖Δw‖/‖w‖ {weight_distance:.2e}")
    if fn is not None:
        figures.append(f"Δeval-loss {fn['d_eval_loss']:.2e}")
    # the match tolerances do not apply: the table shows "—" for them
    return {"status": f"{kind}: {band['verdict']}", "detail": "; ".join(figures), "lossy": True,
            "tol": float("nan"), "function_tol": float("nan")}
