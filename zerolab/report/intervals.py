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
    ratios = np.sort(_medians(rng, rounds, reps) / _medians(rng, base_rounds, reps))
    lo, hi = float(ratios[int((1 - INTERVAL) / 2 * reps)]), float(ratios[int((1 + INTERVAL) / 2 * reps) - 1])
    ratio = statistics.median([t for r in rounds for t in r]) / statistics.median([t for r in base_rounds for t in r])
    return {"ratio": ratio, "lo": lo, "hi": hi, "verdict": timing_verdict(lo, hi),
            "rounds": len(rounds), "steps": sum(map(len, rounds))}


def median_interval(rounds: list[list[float]], reps: int = BOOTSTRAP_REPS, seed: int = 0) -> tuple[float, float]:
    """The pooled p50 step time's 95 % interval, by the same bootstrap over rounds, then steps."""
    import numpy as np

    medians = np.sort(_medians(np.random.default_rng(seed), [r for r in rounds if r], reps))
    return float(medians[int((1 - INTERVAL) / 2 * reps)]), float(medians[int((1 + INTERVAL) / 2 * reps) - 1])


def _medians(rng, rs: list[list[float]], reps: int):
    """`reps` bootstrap medians: draw rounds (with replacement), then steps within each drawn round."""
    import numpy as np

    table = np.full((len(rs), max(map(len, rs))), np.nan)
    for i, r in enumerate(rs):
        table[i, :len(r)] = r
    lens = np.array([len(r) for r in rs])
    drawn = rng.integers(0, len(rs), (reps, len(rs)))
    n = lens[drawn][..., None]  # the drawn round's step count
    steps = (rng.random((reps, len(rs), table.shape[1])) * n).astype(int)
    values = table[drawn[..., None], steps]
    values[np.arange(table.shape[1]) >= n] = np.nan  # a short round contributes only its own count
    return np.nanmedian(values.reshape(reps, -1), axis=1)


def timing_verdict(lo: float, hi: float) -> str:
    """'within noise' unless the interval excludes 1.0."""
    return "slower" if lo > 1.0 else "faster" if hi < 1.0 else "within noise"
