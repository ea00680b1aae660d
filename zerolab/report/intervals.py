"""Step-time ratios with their noise: a seeded bootstrap over rounds and steps, and the verdict."""
from __future__ import annotations

import statistics


BOOTSTRAP_REPS = 2000
INTERVAL = 0.95


def bootstrap_ratio(rounds: list[list[float]], base_rounds: list[list[float]], reps: int = BOOTSTRAP_REPS,
                    seed: int = 0) -> dict:
    """p50 step time over the baseline's, with a 95 % percentile-bootstrap interval. Each replicate
    resamples rounds (with replacement), then steps within each drawn round, for both runs; so
    the interval holds the spread between steps and, when the sweep ran several rounds, between
    rounds. A fixed seed: the same data always gives the same interval and verdict."""
    import numpy as np

    rounds, base_rounds = [r for r in rounds if r], [r for r in base_rounds if r]
    if not rounds or not base_rounds:
        return {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"), "verdict": "no timings"}
    rng = np.random.default_rng(seed)

    def resample(rs: list[list[float]]):
        """`reps` bootstrap medians: draw rounds, then steps within each drawn round."""
        table = np.full((len(rs), max(map(len, rs))), np.nan)
        for i, r in enumerate(rs):
            table[i, :len(r)] = r
        lens = np.array([len(r) for r in rs])
        drawn = rng.integers(0, len(rs), (reps, len(rs)))  # rounds, with replacement
        n = lens[drawn][..., None]  # the drawn round's step count
        steps = (rng.random((reps, len(rs), table.shape[1])) * n).astype(int)
        values = table[drawn[..., None], steps]
        values[np.arange(table.shape[1]) >= n] = np.nan  # a short round contributes only its own count
        return np.nanmedian(values.reshape(reps, -1), axis=1)

    ratios = np.sort(resample(rounds) / resample(base_rounds))
    lo, hi = float(ratios[int((1 - INTERVAL) / 2 * reps)]), float(ratios[int((1 + INTERVAL) / 2 * reps) - 1])
    ratio = statistics.median([t for r in rounds for t in r]) / statistics.median([t for r in base_rounds for t in r])
    return {"ratio": ratio, "lo": lo, "hi": hi, "verdict": timing_verdict(lo, hi),
            "rounds": len(rounds), "steps": sum(map(len, rounds))}


def timing_verdict(lo: float, hi: float) -> str:
    """'within noise' unless the interval excludes 1.0."""
    return "slower" if lo > 1.0 else "faster" if hi < 1.0 else "within noise"
