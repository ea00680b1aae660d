"""The strategies that wrote no zerolab checkpoint before format version 5: fsdp, torch_zero and
DeepSpeed, each stopped and resumed at its own world size, exactly; DeepSpeed's native checkpoints
of before still resume; a fresh optimizer is told apart from a resumed one.

tests/test_resume_matrix.py resumes every strategy's checkpoint under every other at another world
size; this file is about what is exact: the same strategy and world size continue bitwise as
if never stopped (the same arithmetic in the same order, per-rank RNG restored), with and without
offload.
"""
import json
import shutil
import signal
import tarfile

import pytest
import torch

from conftest import ROOT, assert_stopped_in_time, load_weights, read_metrics, rel_l2_diff, run_train
from test_preempt import COMMON as PREEMPT_COMMON, finish, start

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

import deepspeed  # noqa: F401,E402  (pinned: a broken install fails, it does not skip)

K = 3
COMMON = ["model=gpt_tiny", "model.bias=false", "data=text", "trainer.eval_every=0", "optim.warmup_steps=2",
          "data.micro_batch=4"]


@pytest.mark.parametrize("strategy", ["fsdp", "torch_zero"])
def test_sigterm_through_the_launch_script_then_resume_is_bitwise(tmp_path, strategy):
    """Stopped by SIGTERM to launch/torchrun.sh (exit 75, status preempted) after some step k, resumed
    with checkpoint.resume=auto at the same world size: the weights at the end equal, bitwise, those
    of a run that never stopped (dropout on: each rank's RNG comes back too)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_train(ref, 2, *PREEMPT_COMMON, f"strategy={strategy}", "trainer.max_steps=10")
    proc, out = start([str(ROOT / "launch" / "torchrun.sh")], run, f"strategy={strategy}", "trainer.max_steps=10")
    out.until("step 3/10 |")
    proc.send_signal(signal.SIGTERM)
    text = finish(proc, out, timeout=120)
    assert_stopped_in_time(text)
    assert proc.returncode == 75 and (run / "status").read_text().strip() == "preempted", text[-6000:]
    step = json.loads((run / "preempted.json").read_text())["step"]
    assert 3 <= step < 10 and (run / "checkpoints" / f"step_{step:08d}" / "meta.json").exists(), text[-6000:]
    resumed = run_train(run, 2, *PREEMPT_COMMON, f"strategy={strategy}", "trainer.max_steps=10",
                        "checkpoint.resume=auto")
    assert f"resumed at step {step}" in resumed.stdout
    wr, wi = load_weights(ref), load_weights(run)
    assert all(torch.equal(wr[k], wi[k]) for k in wr), f"{strategy}: resumed weights differ from the uninterrupted run"


# (label, overrides): DeepSpeed on both its load paths (the full API at stages 1-2, the local one at 3), with
# its optimizer offload and at stage 3 its parameter offload; FSDP2 with CPUOffloadPolicy.
EXACT = [("ds2", ["strategy=deepspeed", "strategy.stage=2"]),
         ("ds2-offload", ["strategy=deepspeed", "strategy.stage=2", "strategy.offload_optimizer=true"]),
         ("ds3", ["strategy=deepspeed", "strategy.stage=3"]),
         ("ds3-offload", ["strategy=deepspeed", "strategy.stage=3", "strategy.offload_optimizer=true",
                          "strategy.offload_params=true"]),
         ("fsdp-offload", ["strategy=fsdp", "strategy.offload_optimizer=true", "strategy.offload_params=true"])]


@pytest.mark.parametrize("label,overrides", EXACT, ids=[e[0] for e in EXACT])
def test_resume_at_the_same_world_size_is_bitwise(tmp_path, label, overrides):
    """Saved at step K of 2K, resumed from it: the losses after K and the final weights are the
    uninterrupted run's, bitwise; the checkpoint is zerolab's pieces, with no file of the library's
    own (nothing to unpickle)."""
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, 2, *COMMON, *overrides, f"trainer.max_steps={2 * K}", f"checkpoint.every={K}")
    step_k = a / "checkpoints" / f"step_{K:08d}"
    meta = json.loads((step_k / "meta.json").read_text())
    assert meta["checkpoint_format"] == "pieces" and meta["format_version"] == 5
    assert sorted(p.name for p in step_k.iterdir()) == ["meta.json", "rank0.safetensors", "rank1.safetensors"]
    resumed = run_train(b, 2, *COMMON, *overrides, f"trainer.max_steps={2 * K}", f"checkpoint.resume={step_k}")
    assert f"resumed at step {K}" in resumed.stdout
    assert [r["loss"] for r in read_metrics(a)][K:] == [r["loss"] for r in read_metrics(b)]
    wa, wb = load_weights(a), load_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{label}: resumed weights differ"


# A DeepSpeed stage-2 checkpoint in DeepSpeed's own format, written by zerolab 7881427 (before
# format version 5) from `ZEROLAB_CACHE=<the tests' cache> torchrun --nproc_per_node=2 train.py
# model=gpt_tiny model.n_embd=32 model.n_layer=1 data=text trainer.eval_every=0 data.micro_batch=4
# optim.warmup_steps=2 trainer.max_steps=6 strategy=deepspeed strategy.stage=2 checkpoint.every=3`
# (the tests' fixed corpus, conftest.fixed_corpus): its step_00000003.
NATIVE = ROOT / "tests" / "data" / "deepspeed-stage2-native-7881427.tar.gz"
NATIVE_RUN = ["model=gpt_tiny", "model.n_embd=32", "model.n_layer=1", "data=text", "trainer.eval_every=0",
              "data.micro_batch=4", "optim.warmup_steps=2", "trainer.max_steps=6", "strategy=deepspeed",
              "strategy.stage=2"]
# The same run started here and the resumed one share every step but the machine's: 7881427's run
# and this one agree bitwise where the CPU's kernels are the same, and within fp32 rounding of
# reordered sums where they are not: the reference strategies' bound (tests/test_reference_strategies.py).
TOL_FP32 = 1e-6


def native_checkpoint(tmp_path):
    """The stored checkpoint, unpacked into a checkpoints directory of its own."""
    root = tmp_path / "native"
    with tarfile.open(NATIVE) as tar:
        tar.extractall(root, filter="data")
    return root / "step_00000003"


def test_a_native_deepspeed_checkpoint_of_before_still_resumes(tmp_path):
    """Under strategy=deepspeed at its stage and world size, through DeepSpeed's own load (its
    pickles scanned and loaded weights_only with the allow-list): the run continues from it as the
    same run continues here from its own start; under any other strategy it is refused, saying how
    to go on. Its export still reads it through DeepSpeed's consolidation."""
    path = native_checkpoint(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format_version"] == 3 and meta["checkpoint_format"] == "native"
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    run_train(fresh, 2, *NATIVE_RUN)
    out = run_train(resumed, 2, *NATIVE_RUN, f"checkpoint.resume={path}").stdout
    assert "resumed at step 3" in out
    assert rel_l2_diff(load_weights(resumed), load_weights(fresh)) < TOL_FP32

    refused = run_train(tmp_path / "elsewhere", 3, *NATIVE_RUN, "strategy=zero2", f"checkpoint.resume={path}",
                        check=False)
    assert refused.returncode != 0
    assert ("a DeepSpeed stage-2 checkpoint of 2 ranks in DeepSpeed's own format (written by zerolab before format "
            "version 5) loads only into strategy=deepspeed strategy.stage=2 with 2 ranks (this run: strategy=zero2, "
            "3 ranks). Resume it there once and let that run save again") in refused.stdout, refused.stdout[-3000:]

    from safetensors.torch import load_file

    from zerolab.checkpoint import export

    export(str(path), str(tmp_path / "model.safetensors"))
    assert set(load_file(str(tmp_path / "model.safetensors"))) >= {"wte.weight", "blocks.0.attn.qkv.weight"}


def test_a_fresh_optimizer_fails_the_continuation(tmp_path):
    """The matrix's continuation check tells a resumed optimizer from a fresh one: DeepSpeed stage 2's
    checkpoint resumed under zero2 on 3 ranks continues within the matrix's fp32 bound of DeepSpeed
    continuing itself; its weights alone (export --as-checkpoint: a fresh Adam) continue orders of
    magnitude beyond it."""
    from test_resume_matrix import BOUND, STRATEGIES, batch, continuation_share

    from zerolab.checkpoint import import_weights

    k_plus = ["trainer.max_steps=5"]
    writer = tmp_path / "writer" / "run"
    run_train(writer, 2, *COMMON[:-1], batch(2), *STRATEGIES["ds2"], *k_plus, f"checkpoint.every={K}")
    step_k = writer / "checkpoints" / f"step_{K:08d}"
    weights_only = import_weights(str(step_k), str(tmp_path / "imported"))
    shares = {}
    for name, ckpt in (("resumed", step_k), ("fresh", weights_only)):
        run = tmp_path / name
        run_train(run, 3, *COMMON[:-1], batch(3), "strategy=zero2", *k_plus, f"checkpoint.resume={ckpt}")
        shares[name] = continuation_share(writer, run, tmp_path)[0]
    assert shares["resumed"] <= BOUND["fp32"] < shares["fresh"] / 100, shares
    shutil.rmtree(tmp_path / "imported")
