"""Where the step goes, in-process (fast tier): FLOPs per token by hand, MFU's formula, the peak's
sources, the breakdown's arithmetic on synthetic intervals (CPU and CUDA), the collective watch on
a one-process gloo group, profiling off creating nothing, the slow-rank fault, profile.steps'
validation, and the report's breakdown table and figure on synthetic runs. The multi-rank
must-shows are tests/test_profile_runs.py (slow)."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab import profile as zp
from zerolab.profile import profiler as zp_profiler
from zerolab.config import ConfigError, FaultConfig, compose
from zerolab.run.fault import FaultInjector
from zerolab.models import build_model, count_params


# ---- FLOPs per token ------------------------------------------------------------------------------
def test_flops_per_token_of_gpt_small_is_6n_plus_12_l_d_t_by_hand():
    m = compose(["model=gpt_small"]).model
    L, d, T, V = m.n_layer, m.n_embd, m.block_size, m.vocab_size
    # Per block: ln_1 and ln_2 (2d each), qkv (3d² + 3d), attn proj (d² + d), fc (4d² + 4d), mlp proj
    # (4d² + d). Outside: the token embedding V·d (tied to the head: a matmul's weight, counted once),
    # ln_f 2d; the position table T·d is only looked up and is left out.
    n = L * (12 * d * d + 13 * d) + V * d + 2 * d
    model = build_model(m, device="meta")
    assert n == count_params(model) - T * d
    got = zp.flops_per_token(model, T)
    assert (got["n"], got["layers"], got["width"], got["seq"]) == (n, 6, 384, 128)
    assert got["flops_per_token"] == 6 * n + 12 * L * d * T == 6 * 10_745_856 + 12 * 6 * 384 * 128


def test_flops_of_a_model_without_blocks_has_no_attention_term():
    m = compose(["model=mlp"]).model
    model = build_model(m, device="meta")
    got = zp.flops_per_token(model, m.block_size)
    # NextTokenMLP: an untied embedding (looked up: left out), hidden Linears, a norm and the head.
    assert got["layers"] == 0
    assert got["n"] == count_params(model) - m.vocab_size * m.mlp_hidden
    assert got["flops_per_token"] == 6 * got["n"]


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.q, self.up = nn.LayerNorm(d), nn.Linear(d, d, bias=False), nn.Linear(d, 3 * d, bias=False)


class _UserModel(nn.Module):
    """Llama-like: an untied input embedding, blocks in a ModuleList under another name, a head."""

    def __init__(self, v=50, d=16, layers=3):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, d)
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleList(_Block(d) for _ in range(layers))
        self.heads = nn.ModuleList([nn.Linear(d, v, bias=False)])  # a shorter list: not the blocks
        self.norm = nn.LayerNorm(d)


def test_flops_of_any_model_finds_its_blocks_and_width():
    model = _UserModel()
    got = zp.flops_per_token(model, seq_len=32)
    n = count_params(model) - 50 * 16  # the untied embedding is only looked up
    assert (got["layers"], got["width"], got["n"]) == (3, 16, n)
    assert got["flops_per_token"] == 6 * n + 12 * 3 * 16 * 32


# ---- the peak and MFU -------------------------------------------------------------------------------
def test_known_gpus_come_from_the_table_and_others_are_measured():
    assert zp.table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16)[0] == 989.4e12
    assert zp.table_peak("NVIDIA H200", torch.bfloat16)[0] == 989.4e12
    assert zp.table_peak("NVIDIA H100 PCIe", torch.bfloat16)[0] == 756.5e12
    value, source = zp.table_peak("NVIDIA A100-SXM4-80GB", torch.float32)
    assert value == 19.5e12 and "A100 fp32 dense" in source
    assert zp.table_peak("NVIDIA GeForce GTX 1080", torch.bfloat16) is None
    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    assert zp.peak_flops(2e12, ctx, torch.float32) == {"peak_flops": 2e12, "peak_flops_source": "trainer.peak_flops"}
    measured = zp.peak_flops(0.0, ctx, torch.float32)
    assert measured["peak_flops"] > 0 and measured["peak_flops_per_rank"] == [measured["peak_flops"]]
    assert (measured["peak_flops_source"].startswith("measured: ")
            and "float32 matmul on cpu" in measured["peak_flops_source"])


def _ctx(world=2, rank=0):
    return SimpleNamespace(device=torch.device("cpu"), world_size=world, rank=rank,
                           gather_objects=lambda x: [x] * world)


def test_mfu_is_tokens_per_second_per_device_times_flops_over_the_peak(tmp_path):
    cfg = compose(["model=gpt_small", "data.micro_batch=8", "trainer.grad_accum_steps=2", "trainer.peak_flops=1e12"])
    model = build_model(cfg.model, device="meta")
    prof = zp.StepProfiler(cfg, _ctx(world=2), model, str(tmp_path), torch.float32)
    r = prof.rates(0.5)
    tokens_per_device = 8 * 2 * 128  # micro-batch × accumulation × sequence, per rank per step
    assert r["tokens_per_s_per_device"] == tokens_per_device / 0.5
    assert r["flops_per_token"] == zp.flops_per_token(model, 128)["flops_per_token"]
    assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * r["flops_per_token"] / 1e12, rel=1e-15)
    s = prof.summary([0.4, 0.5, 0.6])
    assert s["peak_flops"] == 1e12 and s["peak_flops_source"] == "trainer.peak_flops"
    assert s["mfu_p50"] == r["mfu"] and "time_per_rank" not in s  # no profile.steps: nothing gathered


# ---- the arithmetic of the parts ------------------------------------------------------------------
def test_intervals():
    assert zp.merged([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert zp.subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert zp.subtract([(0, 1), (2, 3)], [(-1, 0.5), (2.5, 2.7)]) == [(0.5, 1), (2, 2.5), (2.7, 3)]
    assert zp.total(zp.clipped([(-5, 1), (2, 20)], 0, 10)) == 9


def _check_parts(p: dict) -> None:
    assert sum(p[k] for k in zp.PARTS) == pytest.approx(p["time/step_s"], abs=1e-12)
    assert all(p[k] >= 0 for k in p)
    assert p["time/comm_exposed_s"] <= p["time/comm_s"] + 1e-12


def test_parts_are_disjoint_and_add_up_to_the_step():
    # step [0, 10]: data until 1, forward+backward [1, 6] with a 1 s wait at [4, 5], optimizer
    # [6.5, 9] with a sync collective [7, 7.5], a wait for a collective in flight before the step
    # at [0.2, 0.4] (before the compute window: exposed, not compute).
    p = zp.step_parts((0, 10), compute=[(1, 6)], optimizer=[(6.5, 9)],
                      exposed=[(4, 5), (7, 7.5), (0.2, 0.4)], comm=[(2, 5), (7, 7.5), (-3, 0.4)])
    _check_parts(p)
    assert p["time/compute_s"] == pytest.approx(4.0)
    assert p["time/optimizer_s"] == pytest.approx(2.0)
    assert p["time/comm_exposed_s"] == pytest.approx(1.7)
    assert p["time/other_s"] == pytest.approx(10 - 4 - 2 - 1.7)
    assert p["time/comm_s"] == pytest.approx(3 + 0.5 + 0.4)  # in flight, within the step only


def test_parts_of_random_intervals_always_add_up():
    g = torch.Generator().manual_seed(0)

    def some(n, lo=-2.0, hi=12.0):
        x = torch.rand(n, 2, generator=g, dtype=torch.float64) * (hi - lo) + lo
        return [(min(a, b), max(a, b)) for a, b in x.tolist()]
    for _ in range(200):
        comm = some(4)
        p = zp.step_parts((0.0, 10.0), some(3), some(2), exposed=zp.clipped(comm, -1, 11)[:2], comm=comm)
        _check_parts(p)


def test_device_parts_count_only_communication_no_kernel_overlaps():
    # CUDA: compute kernels [0, 4] and [5, 8] (compute stream), an NCCL kernel [3, 6] on another
    # stream: [3, 4] and [5, 6] overlap compute, [4, 5] is exposed; the optimizer's kernels [8.5, 9].
    ev = [("zerolab:step", "annotation", 0.0, 10.0), ("zerolab:compute", "annotation", 0.0, 8.0),
          ("zerolab:optimizer", "annotation", 8.2, 9.5), ("sm80_gemm", "kernel", 0.0, 4.0),
          ("sm80_gemm", "kernel", 5.0, 8.0), ("ncclDevKernel_ReduceScatter_Sum_f32", "kernel", 3.0, 6.0),
          ("multi_tensor_apply_kernel", "kernel", 8.5, 9.0), ("Memcpy DtoH", "memcpy", 9.6, 9.7)]
    p = zp.device_parts(ev)
    _check_parts(p)
    assert p["time/comm_s"] == pytest.approx(3.0)
    assert p["time/comm_exposed_s"] == pytest.approx(1.0)
    assert p["time/compute_s"] == pytest.approx(7.0)
    assert p["time/optimizer_s"] == pytest.approx(1.3)
    assert p["time/step_s"] == 10.0
    # Without the phases' device spans (a profiler that did not record them): the kernels' extent
    # is the step, the other kernels' own time is compute; the parts still add up.
    bare = zp.device_parts([e for e in ev if e[1] != "annotation"])
    _check_parts(bare)
    assert bare["time/step_s"] == pytest.approx(9.0) and bare["time/compute_s"] == pytest.approx(7.5)
    assert bare["time/comm_exposed_s"] == pytest.approx(1.0)


# ---- the watch, on a real one-process gloo group -----------------------------------------------------
def test_the_watch_times_collectives_and_waits_and_puts_everything_back(one_rank):
    from torch._C._distributed_c10d import ProcessGroup, Work

    before = {name: vars(ProcessGroup)[name] for name in zp.COLLECTIVES if name in vars(ProcessGroup)}
    before.update(wait=vars(Work)["wait"], get_future=vars(Work)["get_future"])
    watch = zp.CommWatch()
    watch.install()
    try:
        t = torch.ones(1000)
        dist.all_reduce(t)  # synchronous: launch and wait both exposed
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future()  # handed out, as DDP's comm hook does: waited for by wait_handed
        watch.wait_handed()
        assert fut.done()
        work.wait()
    finally:
        watch.uninstall()
    after = {name: vars(ProcessGroup)[name] for name in zp.COLLECTIVES if name in vars(ProcessGroup)}
    after.update(wait=vars(Work)["wait"], get_future=vars(Work)["get_future"])
    assert all(after[k] is before[k] for k in before)
    assert t[0].item() == 1.0  # one rank: the sums are the tensor itself
    exposed, flight = watch.intervals(end=float("inf"))
    assert len(watch.launched) == 2 and all(e[1] is not None for e in watch.launched)
    assert len(exposed) >= 3  # two launches, at least one wait
    assert all(a <= b for a, b in exposed + flight)
    watch.keep_running(end=float("inf"), carry=True)
    assert watch.launched == [] and watch.live == {}  # both completed: nothing carried


def test_a_wait_for_a_collective_launched_before_the_watch_counts_from_the_step_start(one_rank):
    work = dist.all_reduce(torch.ones(10), async_op=True)  # before the watch: its launch is unknown
    work.get_future().wait()
    watch = zp.CommWatch()
    watch.install()
    try:
        work.wait()
    finally:
        watch.uninstall()
    [(a, b)] = watch.in_flight
    assert a > -math.inf  # complete when waited for: only the wait itself is in flight
    assert (a, b) == watch.waits[0]


# ---- off costs nothing --------------------------------------------------------------------------------
def test_profiling_off_creates_nothing_per_step(tmp_path, monkeypatch):
    cfg = compose(["model=gpt_tiny", "trainer.peak_flops=1e12", "trainer.max_steps=10"])
    prof = zp.StepProfiler(cfg, _ctx(), build_model(cfg.model, device="meta"), str(tmp_path), torch.float32)

    def refuse(*args, **kwargs):
        raise AssertionError("profiling is off: nothing may be created")
    monkeypatch.setattr(zp_profiler, "CommWatch", refuse)  # where StepProfiler looks them up
    monkeypatch.setattr(zp_profiler, "Phases", refuse)
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    assert all(prof.step(s, None, None) is zp.NULL for s in range(10))
    assert not any(prof.profiles(s) for s in range(10))
    assert prof.rank_figures(3) == {}


def test_which_steps_are_profiled_and_armed(tmp_path):
    cfg = compose(["model=gpt_tiny", "trainer.peak_flops=1e12", "trainer.max_steps=10", "profile.steps=[4,5,9]"])
    prof = zp.StepProfiler(cfg, _ctx(), build_model(cfg.model, device="meta"), str(tmp_path), torch.float32)
    assert [s for s in range(10) if prof.profiles(s)] == [3, 4, 8]  # 0-based steps of 1-based 4, 5, 9
    kinds = ["null" if prof.step(s, None, None) is zp.NULL else "on" for s in range(10)]
    # armed: the step before each run of profiled steps (2 before 3-4, 7 before 8); nothing else
    assert kinds == ["null", "null", "on", "on", "on", "null", "null", "on", "on", "null"]


def test_profile_every_repeats_after_the_last_named_step(tmp_path):
    cfg = compose(["model=gpt_tiny", "trainer.peak_flops=1e12", "trainer.max_steps=11", "profile.steps=[2,4]",
                   "profile.every=3"])
    prof = zp.StepProfiler(cfg, _ctx(), build_model(cfg.model, device="meta"), str(tmp_path), torch.float32)
    assert [s + 1 for s in range(11) if prof.profiles(s)] == [2, 4, 7, 10]  # 1-based, to max_steps
    assert zp_profiler.profiled_steps([4], 2, 4) == [4] and zp_profiler.profiled_steps([], 2, 9) == []
    # the default job's: every second step from 4, each after a step that is neither logged nor profiled
    job = compose(["experiment=compare"])
    steps = zp_profiler.profiled_steps(job.profile.steps, job.profile.every, job.trainer.max_steps)
    assert steps == list(range(4, 31, 2)) and job.trainer.log_every == job.trainer.max_steps == 30
    assert job.trainer.eval_every == 0


# ---- the slow rank ----------------------------------------------------------------------------------
def test_a_slow_rank_spends_its_time_once_before_the_first_forward(monkeypatch):
    slept = []
    monkeypatch.setattr("zerolab.run.fault.time.sleep", slept.append)
    cfg = FaultConfig(slow_rank=1, slow_ms=400, at_step=3)  # step 3, as metrics.jsonl counts: loop index 2
    for rank in (0, 1):
        f = FaultInjector(cfg, rank, 2)
        for step in range(6):
            for phase in ("forward", "backward", "forward", "backward", "optimizer"):  # two micro-batches
                if rank == 1 and step == 2 and phase == "backward":
                    assert slept == [0.4]  # in the chosen step, before anything after its first forward
                f.in_phase(step, phase)
    assert slept == [0.4]


# ---- validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["profile.steps=[0]"], "not in 1..trainer.max_steps=5"),
    (["profile.steps=[5,6]"], "[6] not in 1..trainer.max_steps=5"),
    (["profile.steps=[2,2]"], "names a step twice"),
    (["profile.trace=true"], "profile.steps is empty"),
    (["profile.every=2"], "profile.every=2 repeats after the last of profile.steps, and profile.steps is empty"),
    (["profile.steps=[2]", "profile.every=-1"], "profile.every=-1 must be >= 0"),
    (["trainer.peak_flops=-1"], "trainer.peak_flops=-1.0 must be >= 0"),
    (["fault.slow_rank=2", "fault.slow_ms=10", "fault.at_step=1"], "fault.slow_rank=2 but the job has 2 ranks"),
    (["fault.slow_rank=1", "fault.at_step=1"], "a slow rank needs all of"),
    (["fault.slow_ms=100"], "a slow rank needs all of"),
    (["fault.slow_rank=1", "fault.slow_ms=100"], "a slow rank needs all of"),
    # fault.* counts steps as metrics.jsonl and profile.steps do: from 1
    (["fault.kill_rank=1", "fault.at_step=0"], "fault.at_step=0: steps count from 1, as in metrics.jsonl"),
    (["fault.inf_grad_step=0"], "fault.inf_grad_step=0: steps count from 1"),
])
def test_profile_and_slow_rank_settings_are_checked(overrides, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=None) as err:
        compose(["trainer.max_steps=5", *overrides])
    assert message in str(err.value)


def test_good_profile_settings_pass(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose(["trainer.max_steps=5", "profile.steps=[1,5]", "profile.trace=true", "fault.slow_rank=1",
                   "fault.slow_ms=400", "fault.at_step=3", "trainer.peak_flops=2.5e12"])
    assert cfg.profile.steps == [1, 5] and cfg.fault.slow_ms == 400 and cfg.trainer.peak_flops == 2.5e12


# ---- the report ----------------------------------------------------------------------------------------
def _write_run(root: Path, name: str, strategy: str, exposed: list[float]) -> Path:
    """A run directory with 6 logged steps, steps 4 and 5 profiled on 2 ranks."""
    d = root / name
    d.mkdir()
    (d / "config.yaml").write_text(f"strategy:\n  name: {strategy}\nprecision:\n  name: fp32\n")
    (d / "summary.json").write_text(json.dumps({"world_size": 2, "n_params": 1000, "strategy": strategy}))
    lines = []
    for step in range(1, 7):
        m = {"step": step, "loss": 3.0, "step_time_s": 0.1 if step not in (4, 5) else 5.0, "tokens_per_s": 1.0,
             "mfu": 0.25}
        if step in (4, 5):
            for r in range(2):
                parts = {"compute_s": 0.06, "optimizer_s": 0.01, "comm_exposed_s": exposed[r], "other_s": 0.005}
                parts.update(comm_s=exposed[r] * 2, step_s=sum(parts.values()))
                m.update({f"rank{r}/time/{k}": v for k, v in parts.items()})
        lines.append(json.dumps(m))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_the_report_shows_where_the_step_goes(tmp_path):
    from zerolab.report import build_report
    from zerolab.report.runs import breakdown, load_run, step_times

    a = _write_run(tmp_path, "0-ddp", "ddp", [0.01, 0.02])
    b = _write_run(tmp_path, "1-zero3", "zero3", [0.03, 0.05])
    run = load_run(b)
    assert sorted(set(step_times(run))) == [0.1, 5.0]  # profiled steps are timed like the others
    got = breakdown([run])
    assert got["steps"] == 2 and got["samples"] == 4 and got["rounds"] == 1
    # medians over steps and ranks: rank 0 exposed 0.03 in both steps, rank 1 0.05
    assert got["comm_exposed_s"] == pytest.approx(0.04) and got["comm_s"] == pytest.approx(0.08)
    assert got["hidden"] == pytest.approx(0.5)
    assert [x["comm_exposed_s"] for x in got["per_rank"]] == pytest.approx([0.03, 0.05])
    lo, hi = got["spread"]["comm_exposed_s"]  # a bootstrap median of these four samples lies between them
    assert 0.03 <= lo <= got["comm_exposed_s"] <= hi <= 0.05 and got["spread"]["compute_s"] == (0.06, 0.06)
    result = build_report([str(a), str(b)], str(tmp_path / "report"))
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Where the step goes" in md and "![breakdown](breakdown.png)" in md
    row = next(line for line in md.splitlines() if line.startswith("| zero3 | 1 × 2 × 2 |"))
    assert "| 60.0 [60.0, 60.0] |" in row and "| 50.0 |" in row and "| 50 % | 25.0 % |" in row
    assert Path(result["figures"]["breakdown"]).stat().st_size > 0
    assert result["breakdown"]["ddp"]["comm_exposed_s"] == pytest.approx(0.015)


def test_a_report_without_profiled_steps_has_no_breakdown(tmp_path):
    from zerolab.report import build_report

    d = _write_run(tmp_path, "0-ddp", "ddp", [0.01, 0.02])
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    (d / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in m.items() if "/time/" not in k}) + "\n"
                                             for m in lines))
    result = build_report([str(d)], str(tmp_path / "report"))
    assert ("breakdown" not in result["figures"]
            and "Where the step goes" not in (tmp_path / "report" / "report.md").read_text())


def test_figures_are_labelled_by_commit_read_from_git_files(tmp_path):
    from zerolab.report.figures import commit

    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert commit(tmp_path / "repo") == "0123456"
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text("# pack-refs\nfedcba9876543210fedcba9876543210fedcba98 refs/heads/main\n")
    assert commit(tmp_path / "repo") == "fedcba9"
    assert commit(tmp_path / "nowhere") == "unknown"
