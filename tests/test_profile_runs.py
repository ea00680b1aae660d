"""Where the step goes, on real gloo ranks (slow: tests/ranks.py forks them from a warm server).

zero2 and zero3 on gpt_small at 2 ranks with profile.steps=[4,5] (zero3 with its Chrome traces
too): every profiled step's four disjoint parts add up to its time, 0 <= exposed <= in flight,
and the final weights are bitwise those of the same run without profiling. A straggler
(fault.slow_rank=1 fault.slow_ms=400 at a profiled step): rank 0 waits for it, rank 1 does not,
and rank 1's 0.4 s lands in its `other`. Every other strategy's collectives are counted too.
MFU is its formula from the logged figures. No timing is asserted but the straggler's own 400 ms.
"""
import gzip
import json

import pytest
import torch

import ranks
from conftest import load_weights, read_metrics

pytestmark = pytest.mark.slow

STEPS = ["trainer.max_steps=5", "trainer.eval_every=0", "trainer.eval_batches=1"]
PROFILE = "profile.steps=[4,5]"
KEYS = ("compute_s", "optimizer_s", "comm_exposed_s", "other_s", "comm_s", "step_s")


def parts(record: dict, rank: int) -> dict:
    return {k: record[f"rank{rank}/time/{k}"] for k in KEYS}


def check_parts(record: dict, world: int = 2) -> None:
    """Every rank's parts of one profiled record: disjoint ones add up to the step, exposed within
    in flight, and the step is the trainer's own step time."""
    for r in range(world):
        p = parts(record, r)
        four = p["compute_s"] + p["optimizer_s"] + p["comm_exposed_s"] + p["other_s"]
        # Exact by construction (zerolab.profile.step_parts); 5 % is the bound.
        assert abs(four - p["step_s"]) <= 0.05 * p["step_s"], (r, p)
        assert 0 <= p["comm_exposed_s"] <= p["comm_s"], (r, p)
        assert min(p.values()) >= 0, (r, p)
    # Rank 0's window is the trainer's clock of the same step (both host clocks around the same
    # code, a few calls apart); another rank's window is its own, and logged under its own name.
    assert abs(parts(record, 0)["step_s"] - record["step_time_s"]) <= 0.05 * record["step_time_s"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """zero2 and zero3, each with and without profiling (zero3's profiled run also traces)."""
    root = tmp_path_factory.mktemp("profile")
    out = {}
    for strategy in ("zero2", "zero3"):
        for profiled in (False, True):
            extra = ([PROFILE] + (["profile.trace=true"] if strategy == "zero3" else [])) if profiled else []
            d = root / f"{strategy}-{'on' if profiled else 'off'}"
            ranks.train(d, 2, f"strategy={strategy}", "model=gpt_small", *STEPS, *extra)
            out[strategy, profiled] = d
    return out


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_profiled_steps_add_up_and_change_no_weight(runs, strategy):
    on, off = runs[strategy, True], runs[strategy, False]
    metrics = read_metrics(on)
    profiled = [m for m in metrics if "rank0/time/step_s" in m]
    assert [m["step"] for m in profiled] == [4, 5]
    for m in profiled:
        check_parts(m)
        assert all(parts(m, r)["comm_s"] > 0 for r in range(2))  # reduce-scatters and all-gathers, timed
    assert not any("rank0/time/step_s" in m for m in read_metrics(off))
    a, b = load_weights(on), load_weights(off)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    summary = json.loads((on / "summary.json").read_text())
    assert summary["profiled_steps"] == [4, 5] and len(summary["time_per_rank"]) == 2
    for r, mean in enumerate(summary["time_per_rank"]):
        for k in KEYS:
            assert mean[f"time/{k}"] == pytest.approx(sum(parts(m, r)[k] for m in profiled) / 2, rel=1e-12)


def test_profiled_steps_leave_a_chrome_trace_per_rank(runs):
    traces = sorted(p.name for p in (runs["zero3", True] / "traces").iterdir())
    assert traces == ["steps4-5-rank0.json.gz", "steps4-5-rank1.json.gz"]  # one per rank: the run of steps 4-5
    events = json.loads(gzip.open(runs["zero3", True] / "traces" / "steps4-5-rank1.json.gz").read())["traceEvents"]
    spans = [e.get("name") for e in events]
    assert spans.count("zerolab:step") == 2 and spans.count("zerolab:optimizer") == 2
    assert spans.count("zerolab:compute") == 2 and "zerolab:wait" in spans
    assert not (runs["zero2", True] / "traces").exists()  # profile.trace=false: no trace


def test_mfu_is_its_formula_from_the_logged_figures(runs):
    d = runs["zero2", True]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["peak_flops"] > 0 and summary["peak_flops_source"].startswith("measured: ")
    assert summary["peak_flops_source"].endswith("mean of 2 rank(s)")
    terms = summary["flops_terms"]
    assert summary["flops_per_token"] == 6 * terms["n"] + 12 * terms["layers"] * terms["width"] * terms["seq"]
    for m in read_metrics(d):
        assert m["flops_per_token"] == summary["flops_per_token"]
        per_device = m["global_batch"] * 128 / 2 / m["step_time_s"]  # gpt_small's 128-token windows, 2 ranks
        assert m["tokens_per_s_per_device"] == pytest.approx(per_device, rel=1e-12)
        assert m["mfu"] == pytest.approx(m["tokens_per_s_per_device"] * m["flops_per_token"] / summary["peak_flops"],
                                         rel=1e-12)


def test_a_straggler_shows_as_the_others_exposed_wait(tmp_path):
    # Rank 1 sleeps 1.5 s before its first forward of step 4 (fault.at_step=4): far longer than
    # gpt_mid's forward+backward (~0.1 s on a quiet rank here, 0.28 s beside another test's ranks).
    d = tmp_path / "slow"
    ranks.train(d, 2, "strategy=zero2", "model=gpt_mid", *STEPS, PROFILE, "fault.slow_rank=1", "fault.slow_ms=1500",
                "fault.at_step=4")
    m = next(m for m in read_metrics(d) if m["step"] == 4)
    check_parts(m)
    fast, slow = parts(m, 0), parts(m, 1)
    # Rank 1's sleep lies inside its step window and outside its compute, optimizer and waits: all
    # of it is `other` (time.sleep sleeps at least its argument, on the same monotonic clock).
    assert slow["other_s"] >= 1.5
    # The ranks start the step together (the previous step's stop agreement is a collective), and
    # rank 0 cannot finish the step's reduce-scatters before rank 1 joins them, 1.5 s in at the
    # earliest: whatever of those 1.5 s rank 0 did not spend on its own work (compute, optimizer,
    # the rest of its step, all measured, so a loaded machine's longer compute is read, not assumed)
    # it spent waiting.
    assert fast["comm_exposed_s"] >= 1.5 - fast["compute_s"] - fast["optimizer_s"] - fast["other_s"], (fast, slow)
    # Rank 1 finds every collective already started by rank 0: it waits for their transfer only.
    assert slow["comm_exposed_s"] < fast["comm_exposed_s"], (fast, slow)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "torch_zero", "fsdp", "deepspeed"])
def test_every_strategy_s_collectives_are_counted(strategy, tmp_path, request):
    if strategy == "deepspeed":
        request.getfixturevalue("deepspeed_ops")
    d = tmp_path / strategy
    ranks.train(d, 2, f"strategy={strategy}", "model=gpt_tiny", "trainer.max_steps=3", "trainer.eval_every=0",
                "trainer.eval_batches=1", "profile.steps=[2,3]")
    profiled = [m for m in read_metrics(d) if "rank0/time/step_s" in m]
    assert [m["step"] for m in profiled] == [2, 3]
    for m in profiled:
        check_parts(m)
        # whoever issues them (DDP's comm hook, ZeroRedundancyOptimizer, FSDP2, DeepSpeed's comm
        # layer): every strategy communicates in every step at 2 ranks
        assert all(parts(m, r)["comm_s"] > 0 and parts(m, r)["comm_exposed_s"] > 0 for r in range(2)), m
