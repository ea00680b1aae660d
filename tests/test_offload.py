"""Offload (ZeRO-Offload, Ren et al. USENIX ATC 2021; ZeRO-Infinity's parameter offload,
Rajbhandari et al. SC 2021) in zerolab's own ZeRO, and the host as a place in every memory figure.

Fast tier: the ledger's places (zerolab.accounting), the refusals. Slow tier: one torchrun launch
of 2 ranks runs several jobs (tests/workers/offload_runs.py) whose results the checks share."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import (ROOT, TORCHRUN, fixed_corpus, load_weights, read_metrics, rel_l2_diff, run_process,
                      run_python, wandb_offline_runs)
from zerolab.checkpoint.reshard import PieceReader
from zerolab.memory.offload import format_offload, offload_rows
from zerolab.rehearsal import rehearse
from zerolab.trainer import Trainer
from zerolab.accounting import Prediction, StorageCounter, device_part, host_per_node, placed
from zerolab.config import ConfigError, compose, validate
from zerolab.memory import cli_main, load_model_config, predict, shape_from_model_config


def test_a_counter_keeps_each_storage_once_and_says_its_place():
    a, b = torch.zeros(10), torch.zeros(6, dtype=torch.float64)
    c = StorageCounter().add("params", [a, a[:3]]).add("master", [b], place="host").add("grads", [b])
    out = c.result()
    assert (out["params"], out["master"], out["grads"], out["total"]) == (40, 48, 0, 88)
    assert (out["device"], out["host"], out["host/master"]) == (40, 48, 48)
    assert device_part(out)["master"] == 0 and device_part(out)["params"] == 40
    assert "host/params" not in out  # only the categories with host bytes get a host/ key
    # the places added to bytes by category (what StorageCounter.result gives)
    assert placed({"params": 4, "master": 8}, {"master": 8}) == {"params": 4, "master": 8, "host": 8, "device": 4,
                                                                 "host/master": 8}


def test_a_prediction_splits_its_terms_by_place_and_sums_a_node():
    p = Prediction("zero2", "fp32", "adamw", 4, "m", 10, 2.0)
    p.add("params", 40, "weights")
    p.add("master", 40, "master", place="host")
    p.add("optim_state", 80, "m, v", place="host")
    p.add("transient", 8, "staged chunk", place="host")
    p.add("transient", 16, "bucket")
    by = p.by_place()
    assert (by["device"]["total"], by["host"]["total"], p.bytes()["total"]) == (40, 120, 160)
    assert p.placed()["host/optim_state"] == 80 and p.placed()["device"] == 40
    assert (p.transient_bytes_at("device"), p.transient_bytes_at("host")) == (16, 8)
    assert host_per_node([p] * 4, 2) == [240, 240]


# ---- refusals: before any rank starts (zerolab.config.validate; train.py exits 2 on its ConfigError) -----
REFUSED = [
    (["strategy=zero1", "strategy.offload_params=true", "strategy.offload_optimizer=true"], "Use strategy=zero3"),
    (["strategy=zero2", "strategy.offload_params=true"], "Use strategy=zero3"),
    (["strategy=zero3", "strategy.offload_params=true"], "strategy.offload_optimizer=true"),
    (["strategy=ddp", "strategy.offload_optimizer=true"], "strategy.offload_optimizer=false"),
    (["strategy=torch_zero", "strategy.offload_optimizer=true"], "strategy.offload_optimizer=false"),
    (["strategy=zero2", "strategy.offload_optimizer=true", "precision=bf16", "precision.master=remainder"],
     "precision.master=fp32"),
    (["strategy=zero1", "strategy.offload_optimizer=true", "precision=bf16", "precision.grad_shard=bf16"],
     "precision.grad_shard=fp32"),
]


@pytest.mark.parametrize("overrides, fix", REFUSED)
def test_an_offload_that_cannot_run_is_refused_in_one_paragraph_naming_the_fix(overrides, fix):
    with pytest.raises(ConfigError) as err:
        validate(compose(["model=gpt_tiny", *overrides]), 2)
    message = str(err.value)
    assert "\n" not in message and fix in message, message
    assert "offload" in message


@pytest.mark.slow
def test_train_py_exits_2_on_a_refused_offload_and_writes_nothing(tmp_path):
    proc = run_python("train.py", f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", "strategy=zero2",
                      "strategy.offload_params=true", check=False, env={"WORLD_SIZE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "strategy.offload_params=true with strategy=zero2" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


def test_the_ledger_moves_the_optimizers_side_to_the_host_and_keeps_the_sum():
    """Per mode, the bytes by place from the ledger (gpt_small, bf16, AdamW, 2 ranks): ZeRO-Offload's
    split (Ren et al., USENIX ATC 2021: 16-bit weights on the device, the fp32 master, state and gradient on
    the host) and ZeRO-Infinity's (nothing persistent left on the device)."""
    shape = shape_from_model_config(load_model_config("gpt_small"))
    by = {}
    for name, strategy, settings in (("z2", "zero2", {}), ("z2o", "zero2", {"offload_optimizer": True}),
                                     ("z3", "zero3", {}), ("z3p", "zero3", OFFLOAD_BOTH)):
        by[name] = predict(shape, strategy, 2, "bf16", "adamw", settings=settings)
    assert by["z2o"].bytes()["total"] == by["z2"].bytes()["total"]  # moved, not added: the master is a copy anyway
    assert by["z2o"].bytes("device")["total"] == by["z2"].bytes()["params"]  # the bf16 weights alone
    assert by["z2o"].bytes("host")["optim_state"] == by["z2"].bytes()["optim_state"]
    assert by["z3p"].bytes("device")["model_states"] == 0
    assert by["z3p"].bytes("host")["total"] == by["z3"].bytes()["total"]
    assert any(t.place == "host" for t in by["z2o"].terms if t.category == "transient")


def test_memory_shows_one_strategys_places_and_refuses_an_offload_it_does_not_run(capsys):
    assert cli_main(["--params", "1e6", "--strategy", "zero3", "--offload-optimizer", "--offload-params"]) == 0
    assert "by place (a node's ranks share its host memory): device 0 B, host 16.00 MB" in capsys.readouterr().out
    assert cli_main(["--params", "1e6", "--strategy", "zero2", "--offload-params"]) == 2
    assert "it runs: no offload, --offload-optimizer" in capsys.readouterr().err


OFFLOAD_BOTH = {"offload_optimizer": True, "offload_params": True}
FP32_TOL = 1e-6  # the zero stages' bound against ddp in fp32 (tests/test_zero.py argues it)


# ---- slow tier: one launch of 2 gloo ranks, gpt_small in fp32 ------------------------------------------
# 4 steps, not the 20: the suite's time allows one launch of ~50 s for all of these jobs
# (gpt_small takes ~0.8 s a step here), and bitwise equality is as strict after 4 steps as after
# 20 (a difference in any step's arithmetic shows at once: each checkpoint round trip resumes at 2).
STEPS = 4
# model.bias=false as in tests/test_ddp.py: the attention key bias's true gradient is exactly zero, so
# what it gets is summation noise, which Adam's and LAMB's normalisation blow up to ~1e-6 against ddp.
RUN = ["model=gpt_small", "model.bias=false", "precision=fp32", "data.micro_batch=1", f"trainer.max_steps={STEPS}",
       "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=2", "logging.wandb.mode=disabled",
       "logging.progress=false", "strategy.bucket_mb=4"]  # several buckets per unit: chunks reach the host one by one
OPT = ["strategy.offload_optimizer=true"]
BOTH = [*OPT, "strategy.offload_params=true"]
SAVE = ["checkpoint.every=2"]
LAMB = ["optim=lamb"]


RECORDED = ("z2o", "z3o")


def jobs(out) -> list:
    ck = lambda name: str(out / name / "checkpoints" / "step_00000002")
    return [
        ("ddp", ["strategy=ddp"]), ("z2", ["strategy=zero2"]), ("z2o", ["strategy=zero2", *OPT, *SAVE]),
        ("z3", ["strategy=zero3", *SAVE]), ("z3o", ["strategy=zero3", *BOTH, *SAVE, "logging.wandb.mode=offline"]),
        ("z3a", ["strategy=zero3", *OPT]),  # the optimizer alone on the host: the device keeps its chunks
        ("ddp_lamb", ["strategy=ddp", *LAMB]), ("z2_lamb", ["strategy=zero2", *LAMB]),
        ("z2o_lamb", ["strategy=zero2", *OPT, *LAMB]), ("z3_lamb", ["strategy=zero3", *LAMB]),
        ("z3o_lamb", ["strategy=zero3", *BOTH, *LAMB]),
        # checkpoints across offload, both ways: resumed at step 2, they must end where the other run did
        ("z2_from_z2o", ["strategy=zero2", f"checkpoint.resume={ck('z2o')}"]),
        ("z3o_from_z3", ["strategy=zero3", *BOTH, f"checkpoint.resume={ck('z3')}"]),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    # whole jobs (metrics.jsonl, summary.json) where the record is checked; the others only step
    spec = [[name, [*RUN, f"data.path={fixed_corpus()}", *extra], name in RECORDED] for name, extra in jobs(out)]
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "tests/workers/offload_runs.py"), str(out),
           json.dumps(spec)]
    proc = run_process(cmd, timeout=540)  # (base_env: OMP_NUM_THREADS=1 per rank)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_offload_is_bitwise_the_run_without_it_and_within_the_stages_bound_of_ddp(runs):
    """zero2 + optimizer offload is zero2, zero3 + optimizer and parameter offload (and optimizer
    offload alone) is zero3, bit for bit: the host adds the same reduced chunks in the same order
    and runs the same kernel on the same fp32 numbers. Against ddp they keep the stages' own bound
    (tests/test_zero.py and tests/test_zero3.py: FP32_TOL = 1e-6 per-tensor relative L2, argued
    there)."""
    for suffix in ("", "_lamb"):
        w = {name: load_weights(runs / f"{name}{suffix}") for name in ("ddp", "z2", "z2o", "z3", "z3o")}
        assert bitwise(w["z2o"], w["z2"]), suffix
        assert bitwise(w["z3o"], w["z3"]), suffix
        for name in ("z2o", "z3o"):
            diff = rel_l2_diff(w[name], w["ddp"])
            assert diff < FP32_TOL, f"{name}{suffix} vs ddp: {diff:.3g}"
    assert bitwise(load_weights(runs / "z3a"), load_weights(runs / "z3"))


@pytest.mark.slow
def test_checkpoints_cross_offload_both_ways_bitwise(runs):
    """An offloaded run's checkpoint resumes into a run without offload, and back, and each ends
    where the run it continues ended (the pieces are the same fp32 master and state by name)."""
    assert bitwise(load_weights(runs / "z2_from_z2o"), load_weights(runs / "z2"))
    assert bitwise(load_weights(runs / "z3o_from_z3"), load_weights(runs / "z3o"))


@pytest.mark.slow
def test_the_record_holds_device_and_host_bytes_as_predicted(runs):
    """metrics.jsonl (every rank), summary.json and the wandb mirror carry each category's host
    part and the totals by place, and every measured figure equals the ledger's."""
    for name in ("z2o", "z3o"):
        # the predictions are recorded once, at the first real update; the bytes stay the same after it
        last = next(rec for rec in read_metrics(runs / name) if "rank0/mem_pred/total_bytes" in rec)
        for r in range(2):
            keys = [k for k in last if k.startswith(f"rank{r}/mem_pred/") and "peak" not in k
                    and "activations" not in k]
            assert {f"rank{r}/mem_pred/device_bytes", f"rank{r}/mem_pred/host/optim_state_bytes"} <= set(keys)
            for k in keys:
                assert last[k.replace("/mem_pred/", "/mem/")] == last[k], (name, k)
            assert last[f"rank{r}/mem/host_bytes"] > 0
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["memory_per_rank"][1]["mem/host_bytes"] == last["rank1/mem/host_bytes"]
        assert summary["memory_ledger"]["warnings"] == []
    assert last["rank0/mem/device_bytes"] == 0  # zero3 with both offloads: no persistent byte on the device
    wandb_keys = set().union(*(run["keys"] for run in wandb_offline_runs(runs / "z3o")))
    assert {"rank0/mem/host_bytes", "rank1/mem/device_bytes", "rank0/mem/host/params_bytes"} <= wandb_keys


@pytest.mark.slow
def test_a_dry_run_of_an_offloaded_job_equals_the_real_one_for_both_places(runs):
    real = read_metrics(runs / "z2o")[-1]
    r = rehearse([*RUN, f"data.path={fixed_corpus()}", "strategy=zero2", *OPT], world=2, rank=0)
    keys = [k for k in r.measured if k.endswith("_bytes") and "peak" not in k]
    assert {"mem/device_bytes", "mem/host_bytes", "mem/host/master_bytes"} <= set(keys)
    assert {k: r.measured[k] for k in keys} == {k: real[f"rank0/{k}"] for k in keys}


@pytest.mark.slow
def test_an_offloaded_checkpoint_reshards_from_two_ranks_to_one(runs, one_rank, tmp_path):
    """The 2-rank zero3 checkpoint with both offloads loads into 1 rank of zero3 with them: the
    masters it holds then are the checkpoint's, element for element."""
    step = runs / "z3o" / "checkpoints" / "step_00000002"
    cfg = validate(compose([*RUN, f"data.path={fixed_corpus()}", "strategy=zero3", *BOTH,
                            f"checkpoint.resume={step}", f"run.dir={tmp_path / 'run'}"]), 1)
    trainer = Trainer(cfg, one_rank)
    try:
        loaded = trainer.strategy.consolidated_state_dict()
    finally:
        trainer.close()
    read = PieceReader(str(step), json.loads((step / "meta.json").read_text()))
    saved = [name for name in loaded if f"master/{name}" in read.index]
    assert set(loaded) - set(saved) == {"lm_head.weight"}  # tied to wte.weight: saved once, under that name
    for name in saved:
        assert torch.equal(loaded[name].view(-1), read(f"master/{name}", 0, loaded[name].numel()).float()), name


@pytest.mark.slow
def test_memory_offload_shows_both_places_beside_deepspeeds_estimator():
    """DeepSpeed's estimator is the same arithmetic for ZeRO-Offload's stage 2: 2 bytes of 16-bit
    weights per parameter on the GPU; ours counts the same device bytes (bucket padding aside)."""
    shape = shape_from_model_config(load_model_config("gpt_small"))
    rows = {r["mode"]: r for r in offload_rows(shape, 1, "bf16", "adamw", 25.0)}
    z2o = rows["zero2 +opt"]
    assert z2o["reference"] == "deepspeed" and z2o["reference_device_bytes"] == 2 * shape.n_params
    assert z2o["device_bytes"] == 2 * shape.n_params  # padding to multiples of N = 1: none
    assert rows["zero3 +opt +params"]["device_bytes"] == 0 and "reference_host_per_node_bytes" in rows["zero3"]
    assert "reference_device_bytes" not in rows["zero1"]  # DeepSpeed has no stage-1 estimator
    assert "estimate_zero3_model_states_mem_needs_all_cold" in format_offload(shape, 1, "bf16", "adamw", 25.0)
