"""The reference strategies (DeepSpeed, torch's ZeroRedundancyOptimizer, FSDP2) on 2 real gloo
ranks, against DDP's parameters.

fp32 tolerance: 1e-5 relative (measured here: DeepSpeed 4e-7, FSDP2 2e-7, torch_zero 0). The GPT
runs with model.bias=false; tests/test_ddp.py says why. DeepSpeed's C++ ops are built by `make
install`; the `deepspeed_ops` fixture (conftest) skips with the reason when they are not.
"""
from pathlib import Path

import pytest
import torch

from conftest import load_weights, max_rel_diff, read_metrics, run_python, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

COMMON = ["model=gpt_tiny", "model.bias=false", "trainer.max_steps=10", "trainer.eval_every=0"]
TOL_FP32 = 1e-5


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    run = tmp_path_factory.mktemp("ddp")
    run_train(run, 2, *COMMON, "strategy=ddp", "data.micro_batch=4")
    return load_weights(run)


@pytest.mark.parametrize("stage,accum", [(1, 1), (2, 2)])
def test_deepspeed_fp32_matches_ddp(tmp_path, deepspeed_ops, ddp_weights, stage, accum):
    run = tmp_path / f"ds{stage}"
    run_train(run, 2, *COMMON, "strategy=deepspeed", f"strategy.stage={stage}",
              f"data.micro_batch={4 // accum}", f"trainer.grad_accum_steps={accum}")
    diff = max_rel_diff(load_weights(run), ddp_weights)
    assert diff < TOL_FP32, f"deepspeed stage {stage} vs ddp: max relative difference {diff:.3g}"
    last = read_metrics(run)[-1]
    # ZeRO-1/2 shard the fp32 master and the Adam state: each rank holds about half of each.
    full = last["rank0/mem/params_bytes"]  # fp32 model weights, whole
    for r in (0, 1):
        assert 0.4 * full < last[f"rank{r}/mem/master_bytes"] < 0.6 * full
        assert 0.8 * full < last[f"rank{r}/mem/optim_state_bytes"] < 1.2 * full
        assert last[f"rank{r}/comm_bytes"] > 0  # measured from DeepSpeed's own collectives


@pytest.mark.parametrize("strategy", ["torch_zero", "fsdp"])
def test_torch_reference_fp32_matches_ddp(tmp_path, ddp_weights, strategy):
    run = tmp_path / strategy
    run_train(run, 2, *COMMON, f"strategy={strategy}", "data.micro_batch=2", "trainer.grad_accum_steps=2")
    diff = max_rel_diff(load_weights(run), ddp_weights)
    assert diff < TOL_FP32, f"{strategy} vs ddp: max relative difference {diff:.3g}"
    last = read_metrics(run)[-1]
    opt = [last[f"rank{r}/mem/optim_state_bytes"] for r in (0, 1)]
    if strategy == "fsdp":  # everything sharded evenly
        assert opt[0] == opt[1] and last["rank0/mem/grads_bytes"] < 0.6 * 4 * 119104 + 1024
    assert all(o < 0.75 * 2 * 4 * 119104 for o in opt)  # each rank keeps ~half of Adam's m and v


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp"])
def test_bf16_reference_strategies_train(tmp_path, deepspeed_ops, strategy):
    run = tmp_path / strategy
    run_train(run, 2, "model=gpt_tiny", "precision=bf16", f"strategy={strategy}", "trainer.max_steps=20",
              "trainer.eval_every=0", "data.micro_batch=4")
    m = read_metrics(run)
    assert m[-1]["loss"] < m[0]["loss"] - 0.3
    for key in ("grad_norm", "grad_norm_clipped", "lr", "step_time_s", "rank1/mem/master_bytes", "rank1/comm_bytes"):
        assert key in m[-1], key
    assert m[-1]["rank0/mem/master_bytes"] > 0 and m[-1]["rank0/comm_bytes"] > 0
    assert (run / "model.safetensors").exists()


def test_broken_deepspeed_install_names_the_install_command(tmp_path):
    fake = tmp_path / "site" / "deepspeed"
    fake.mkdir(parents=True)
    # A real broken package on the path: importing it fails the way a half-built install does.
    (fake / "__init__.py").write_text("from deepspeed.ops import _not_built  # noqa\n")
    proc = run_python(str(Path(__file__).resolve().parents[1] / "train.py"), "strategy=deepspeed",
                      f"run.dir={tmp_path / 'run'}", "trainer.max_steps=1", "logging.wandb.mode=disabled",
                      check=False, env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode != 0
    assert "pip install deepspeed==0.19.8" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("override,message", [("optim.name=lamb", "strategy.client_optimizer=true"),
                                               pytest.param("precision=fp16", "use precision=bf16 or fp32",
                                                            marks=pytest.mark.skipif(
                                                                torch.cuda.is_available(),
                                                                reason="DeepSpeed supports fp16 on CUDA"))])
def test_deepspeed_settings_it_cannot_honour_are_config_errors(tmp_path, deepspeed_ops, override, message):
    proc = run_python(str(Path(__file__).resolve().parents[1] / "train.py"), "strategy=deepspeed", override,
                      f"run.dir={tmp_path / 'run'}", "trainer.max_steps=1", "logging.wandb.mode=disabled",
                      check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
