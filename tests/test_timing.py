"""zerolab.timing.StepClock on CPU: one time per step, read back in order (no device here; the
CUDA branch records events instead and is exercised on a GPU machine only)."""
import torch

from zerolab.timing import StepClock


def test_one_time_per_step_in_order():
    clock = StepClock(torch.device("cpu"))
    for _ in range(3):
        clock.start()
        torch.ones(64, 64) @ torch.ones(64, 64)
        clock.stop()
    times = clock.times()
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert clock.last() == times[-1] and clock.times() == times  # reading does not change them
