"""`plan --host-mem`: offload rows beside the rows that fit without offload, held to the GPU's
memory and to the node's host memory; and the host's side of the time model
(zerolab/predict/host.py). In process, formula activations (a --params shape): fast."""
import json

import pytest

from zerolab.plan import cli_main
from zerolab.predict import host as offload
from zerolab.predict.hardware import DEVICES
from zerolab.predict.record import Op, StepRecord

THIRTEEN_B = ["--params", "13e9", "--seq", "2048", "--gpu-mem", "24GB", "--json"]


def _plan(capsys, *args) -> dict:
    assert cli_main([*THIRTEEN_B, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_13b_model_on_one_24gb_gpu_fits_only_with_offload_and_says_its_host_memory(capsys):
    plain = _plan(capsys)
    assert plain["rows"] and not [r for r in plain["rows"] if r["max_micro_batch"]]  # nothing fits
    assert not [r for r in plain["rows"] if "offload" in r["strategy"]]  # no --host-mem: no offload rows
    rows = _plan(capsys, "--host-mem", "512GB")["rows"]
    fits = [r for r in rows if r["max_micro_batch"]]
    assert fits and all("+offload" in r["strategy"] for r in fits)
    # the optimizer alone is not enough: 13B 16-bit weights are 26 GB; the parameters go to the host too
    assert {r["strategy"] for r in fits} <= {"zero3+offload+p", "deepspeed-3+offload+p", "fsdp+offload+p"}
    n = plain["n_params"]
    for r in fits:
        # host: at least the fp32 master and gradient and Adam's m and v, 16 bytes per parameter (FSDP2's
        # fp32 shard is its weights; the others add a 16-bit copy)
        assert 16 * n <= r["host_bytes_per_node"] <= 512e9 * 0.9, r
        assert r["peak_bytes"] <= 24e9 * 0.9


def test_a_host_too_small_refuses_the_offload_rows_and_says_why(capsys):
    rows = _plan(capsys, "--host-mem", "128GB")["rows"]
    offloaded = [r for r in rows if "+offload" in r["strategy"]]
    assert offloaded and not [r for r in offloaded if r["max_micro_batch"]]
    assert {r["dominant"] for r in offloaded} == {"host memory"}


def test_host_mem_needs_a_unit(capsys):
    assert cli_main([*THIRTEEN_B, "--host-mem", "512"]) == 2
    assert "--host-mem" in capsys.readouterr().err


def test_offload_rows_are_exactly_what_the_strategies_accept():
    """Every row the planner offers validates as a job; every combination it leaves out is refused
    (zerolab's own zero1/2/3, DeepSpeed's stages, FSDP2's CPUOffloadPolicy)."""
    from zerolab.config import compose, validate
    from zerolab.errors import ConfigError
    from zerolab.plan import strategy_overrides

    for label in ("zero1", "zero2", "zero3", "deepspeed-1", "deepspeed-2", "deepspeed-3", "fsdp"):
        offered = offload.offload_suffixes(label, "adamw")
        for suffix in ("+offload", "+offload+p"):
            job = ["model=gpt_tiny", "precision=bf16", *strategy_overrides(label + suffix)]
            if suffix in offered:
                validate(compose(job), world_size=2)
            else:
                with pytest.raises(ConfigError):
                    validate(compose(job), world_size=2)


def _record(forward_s: float, backward_s: float, optimizer_s: float, dev) -> StepRecord:
    """A step of three memory-bound ops whose priced times are the given seconds on `dev`."""
    rate = dev.memory_bandwidth * dev.achievable
    rec = StepRecord()
    for phase, s in (("forward", forward_s), ("backward", backward_s), ("optimizer", optimizer_s)):
        rec.events.append(Op("add", phase, 0, 0.0, int(s * rate), 1, True, "", -1))
    return rec


def test_the_host_side_adds_the_exposed_copies_and_the_host_step():
    dev, h = DEVICES["h100"], offload.HOSTS["dgx-h100"]
    dev = type(dev)(**{**dev.__dict__, "name": "h100-plain"})  # the roofline pricing, not the GPU kernel table
    record = _record(0.01, 0.02, 0.005, dev)
    phases = offload.phase_seconds(record, dev)
    assert phases["backward"] == pytest.approx(0.02, rel=1e-6)
    shard = offload.Shard(elements=10**9, grad_bytes=2, weight_bytes=2)
    one = offload.price_offload(record, 0.04, dev, h, shard, ranks_on_node=1)
    copy, step = offload.rates(h, dev, 1)
    assert one.parts["device"] == pytest.approx(0.04 - 0.005, rel=1e-6)  # the device's optimizer kernels leave
    assert one.parts["host_step"] == pytest.approx(1e9 * 28 / step)
    assert one.parts["grads_down_exposed"] == pytest.approx(max(0.0, 2e9 / copy - 0.02))
    assert one.parts["weights_up"] == pytest.approx(2e9 / copy)
    assert one.parts["params_up_exposed"] == 0.0 and one.step_s == pytest.approx(sum(one.parts.values()))
    # eight ranks share the host's memory bandwidth: the host step of the same shard is slower
    eight = offload.price_offload(record, 0.04, dev, h, shard, ranks_on_node=8)
    assert eight.parts["host_step"] > one.parts["host_step"]
    # parameter offload: two copies up per micro-batch, hidden behind 30 ms of compute only in part
    params = offload.price_offload(record, 0.04, dev, h, offload.Shard(10**9, 2, 2, params=True), 1)
    assert params.parts["params_up_exposed"] == pytest.approx(max(0.0, 4e9 / copy - 0.03))
    assert any("DGX H100" in a for a in one.assumptions) and any("PCIe 5.0" in a for a in one.assumptions)


def test_hardware_ranks_offload_rows_with_the_rest_on_one_rehearsal_each(monkeypatch):
    """plan --hardware: an offload row is priced on its job without offload (rehearsed once for
    both), its host side added, and ranked with the rows that fit without offload by tokens/s.
    The rehearsal and the GPU pricing are stand-ins here (they are tested with the time model)."""
    import zerolab.rehearsal
    from zerolab.plan import Planner, load_model_config, rank_by_speed
    from zerolab.predict import cli as predict_cli
    from zerolab.predict.model import Prediction

    dev = DEVICES["a100"]
    asked = []

    def rehearse(overrides, world, **_):
        asked.append([o for o in overrides if o.startswith("strategy")])
        return zerolab.rehearsal.Rehearsal(world, 0, "zero2", "gpt_tiny", "bf16", record=_record(0.01, 0.02, 0.0, dev),
                                           tokens_per_rank=2048)

    monkeypatch.setattr(zerolab.rehearsal, "rehearse", rehearse)
    monkeypatch.setattr(predict_cli, "priced", lambda r, topo: Prediction(
        "a100", "", topo.world, "bf16", 0.04, {"comm_exposed": 0.0}, 2048 / 0.04, 0.5, 0.0, [], ["gpu"]))
    planner = Planner(load_model_config("gpt_tiny"), 2, 64, host_mem=10**9, ranks_per_node=8)
    fits = [f for f in planner.table(10**9) if f.label in ("zero2", "zero2+offload") and f.checkpointing == "none"]
    topo = predict_cli.topology(predict_cli.arguments("a100"), 2)
    speed = rank_by_speed(planner, ["model=gpt_tiny"], fits, topo, [1])
    assert asked == [["strategy=zero2", "strategy.bucket_mb=25.0"]]  # one rehearsal, the job without offload
    plain, off = speed["rows"]  # fastest first: the offload row pays its host side
    assert (plain["strategy"], off["strategy"]) == ("zero2", "zero2+offload")
    assert off["step_s"] > plain["step_s"] == 0.04 and off["host_bytes_per_node"] > 0
    assert off["parts"]["host_step"] > 0 and any(a.startswith("host: NVIDIA DGX A100") for a in speed["assumptions"])
