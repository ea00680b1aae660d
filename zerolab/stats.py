"""Small statistics shared by the trainer, the report and the benchmarks."""
from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) as one of the values: nearest rank, no interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
