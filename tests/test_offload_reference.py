"""The reference strategies' offload beside zerolab's: DeepSpeed's offload_optimizer (ZeRO-Offload,
Ren et al. 2021) and FSDP2's CPUOffloadPolicy, on 2 real gloo ranks, against DDP's parameters.

On this CPU both run: DeepSpeed steps the host's partition with its CPU Adam (the cpu_adam op,
built at install by zerolab.ds_ops), FSDP2 copies nothing (host and device are one memory) but
runs its offload path: the optimizer step on the sharded parameters it keeps on the host. Their
weights after 10 steps are held to the non-offloaded runs' bound against ddp
(tests/test_reference_strategies.py: TOL_FP32, the largest per-tensor relative L2 difference), and
every rank's bytes, by category and by place (device, host), equal the ledger's prediction.
The settings neither can honour are refused before anything starts (fast tier).
"""

import pytest

from conftest import load_weights, missing, read_metrics, rel_l2_diff, run_train

COMMON = ["model=gpt_tiny", "model.bias=false", "trainer.max_steps=10", "trainer.eval_every=0"]
TOL_FP32 = 1e-6  # tests/test_reference_strategies.py's bound for the same job without offload


def _placed_as_predicted(run, nproc=2):
    """The first update's record: every rank's model states by category and the device and host
    totals equal the prediction, and the host holds something (the offloaded states)."""
    first = next(r for r in read_metrics(run) if "rank0/mem_pred/master_bytes" in r)
    for r in range(nproc):
        for key in ("params", "grads", "master", "optim_state", "device", "host"):
            assert first[f"rank{r}/mem/{key}_bytes"] == first[f"rank{r}/mem_pred/{key}_bytes"], (r, key)
        assert first[f"rank{r}/mem/host_bytes"] > 0, r


@pytest.mark.slow
def test_offloaded_reference_strategies_match_ddp(tmp_path, shared_run, deepspeed_ops):
    """One ddp reference (shared with test_reference_strategies in a whole-suite run), then
    DeepSpeed stage 2 with offload_optimizer and FSDP2 with CPUOffloadPolicy."""
    from zerolab import ds_ops

    if not all(ds_ops.built_ops(ds_ops.OFFLOAD_OPS).values()):  # its first-use compile takes minutes
        missing(f"DeepSpeed's cpu_adam op is not built in {ds_ops.ops_dir()}: `make install` builds it")
    ddp = load_weights(shared_run(2, *COMMON, "strategy=ddp", "data.micro_batch=4"))
    for name, overrides in (("deepspeed", ["strategy=deepspeed", "strategy.stage=2",
                                           "strategy.offload_optimizer=true"]),
                            ("fsdp", ["strategy=fsdp", "strategy.offload_optimizer=true",
                                      "strategy.offload_params=true"])):
        run = tmp_path / name
        run_train(run, 2, *COMMON, *overrides, "data.micro_batch=4")
        diff = rel_l2_diff(load_weights(run), ddp)
        assert diff < TOL_FP32, f"{name} offloaded vs ddp: largest per-tensor relative L2 difference {diff:.3g}"
        _placed_as_predicted(run)


# ---- refused before any process starts (zerolab.config.validate: ConfigError, exit 2) ----------------
@pytest.mark.parametrize("overrides,says", [
    (["strategy=fsdp", "strategy.offload_optimizer=true"], "CPUOffloadPolicy"),
    (["strategy=fsdp", "strategy.offload_params=true"], "CPUOffloadPolicy"),
    (["strategy=deepspeed", "strategy.stage=2", "strategy.offload_params=true"], "stage 3 only"),
    (["strategy=deepspeed", "strategy.stage=0", "strategy.offload_optimizer=true"], "stages 1-3"),
    (["strategy=deepspeed", "strategy.stage=2", "strategy.offload_optimizer=true", "optim=lamb",
      "strategy.client_optimizer=true"], "client optimizer"),
])
def test_offload_a_reference_cannot_honour_is_refused_naming_zerolabs_own(overrides, says):
    from zerolab.config import compose, validate
    from zerolab.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose([*COMMON, *overrides]), world_size=2)
    message = str(err.value)
    assert says in message and "strategy=zero" in message, message
    assert "\n" not in message  # one paragraph


def test_offload_settings_reach_the_engines_configs():
    """What each strategy hands its engine: DeepSpeed's zero_optimization offload sections (pinned
    only with CUDA), FSDP2's CPUOffloadPolicy for the two settings together."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    from zerolab.config import compose, validate
    from zerolab.strategies.deepspeed import build_ds_config
    from zerolab.strategies.fsdp import FSDPStrategy

    cfg = validate(compose([*COMMON, "strategy=deepspeed", "strategy.stage=3", "strategy.offload_optimizer=true",
                            "strategy.offload_params=true"]), world_size=2)
    zero = build_ds_config(cfg, 2, 4)["zero_optimization"]
    pin = torch.cuda.is_available()
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": pin} == zero["offload_param"]
    cfg = validate(compose([*COMMON, "strategy=fsdp", "strategy.offload_optimizer=true",
                            "strategy.offload_params=true"]), world_size=2)
    fsdp = FSDPStrategy.__new__(FSDPStrategy)
    fsdp.settings = cfg.strategy
    assert isinstance(fsdp.offload_policy(), CPUOffloadPolicy) and fsdp.offload_policy().pin_memory == pin


def test_the_report_names_offloaded_runs_apart_and_shows_both_places(tmp_path):
    """`python -m zerolab compare`: an offloaded run is its own job beside the same strategy without
    offload (labelled as the planner's rows are), and the memory table has device and host columns."""
    from zerolab.report.runs import Run, compute_stats, label_runs
    from zerolab.report.tables import memory_table

    mem = {"rank0/mem/params_bytes": 2**20, "rank0/mem/master_bytes": 2**21, "rank0/mem/host_bytes": 2**21,
           "rank0/mem/total_bytes": 3 * 2**20, "step": 1}
    runs = [Run(tmp_path / name, {"strategy": {"name": "deepspeed", "stage": 2, **extra}}, [mem], {})
            for name, extra in (("plain", {}), ("off", {"offload_optimizer": True}))]
    label_runs(runs)
    assert [r.label for r in runs] == ["deepspeed-s2", "deepspeed-s2+offload"]
    for r in runs:
        compute_stats(r)
    table = memory_table(runs)
    assert "| device | host |" in table and "| 1.00 | 2.00 |" in table  # MiB: 1 on the device, 2 on the host
