"""A model with persistent buffers: BatchNorm's running mean, variance and batch count, and a
running scale kept with register_buffer and updated by every training forward. Buffers are model
state that each rank updates from its own batches, so they differ between ranks; every rank saves
its own (zerolab/checkpoint/reshard.py).

- Exact resume (2 ranks; ddp, zero1, zero2, zero3): the losses after the resume read the running
  scale in every forward, the final eval reads every rank's BatchNorm statistics (eval mode), and
  the final weights carry rank 0's buffers: all bitwise equal to the run that never stopped.
- Resharding: at another world size (2 -> 3, 2 -> 1) every rank loads rank 0's buffers; at the same
  world size under another strategy each rank its own. Read back on each rank right after the
  resume (tests/workers/buffers_after_resume.py).
"""
import json
import textwrap

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT, TORCHRUN, load_weights, rank_log, read_metrics, run_process, run_ranks, base_env
from zerolab.checkpoint.format import FORMAT_VERSION

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

MODULE = "zerolab_buffer_lm"
SOURCE = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, dim)
            self.norm = nn.BatchNorm1d(dim)  # running_mean, running_var, num_batches_tracked
            self.register_buffer("scale", torch.ones(dim))  # a running scale of the activations

        def forward(self, x):
            h = self.norm(self.fc(x).transpose(1, 2)).transpose(1, 2)
            if self.training:
                with torch.no_grad():
                    self.scale.mul_(0.9).add_(0.1 * h.abs().mean(dim=(0, 1)))
            return x + torch.tanh(h) * self.scale


    class BufferLM(nn.Module):
        def __init__(self, vocab=256, dim=32, layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
            self.head = nn.Linear(dim, vocab)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)
''')
K = 3
COMMON = ["model=custom", f"model.target={MODULE}:BufferLM", "model.vocab_size=256", "data=text",
          "trainer.eval_every=0", "optim.warmup_steps=2", "model.block_size=32"]
BUFFERS = {f"blocks.{i}.{n}" for i in range(2) for n in ("norm.running_mean", "norm.running_var",
                                                          "norm.num_batches_tracked", "scale")}


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / f"{MODULE}.py").write_text(SOURCE)
    return d


def saved_buffers(ckpt, rank: int) -> dict:
    with safe_open(str(ckpt / f"rank{rank}.safetensors"), framework="pt") as fh:
        return {k.removeprefix("buffer/"): fh.get_tensor(k) for k in fh.keys() if k.startswith("buffer/")}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_buffers_resume_bitwise(tmp_path, module_dir, strategy):
    env = {"PYTHONPATH": str(module_dir)}
    common = [*COMMON, f"strategy={strategy}", f"trainer.max_steps={2 * K}", "data.micro_batch=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    run_ranks(a, 2, *common, f"checkpoint.every={K}", env=env)
    ckpt = a / "checkpoints" / f"step_{K:08d}"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION and set(meta["buffers"]) == BUFFERS == set(meta["buffer_shapes"])
    r0, r1 = saved_buffers(ckpt, 0), saved_buffers(ckpt, 1)
    assert set(r0) == set(r1) == BUFFERS
    assert int(r0["blocks.0.norm.num_batches_tracked"]) == K  # one forward per step (no accumulation)
    if strategy != "ddp":  # DDP broadcasts rank 0's buffers at every forward; the sharders keep each rank's
        assert not torch.equal(r0["blocks.0.norm.running_mean"], r1["blocks.0.norm.running_mean"])
    run_ranks(b, 2, *common, f"checkpoint.resume={ckpt}", env=env)
    assert f"resumed at step {K}" in rank_log(b)
    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["loss"] for r in ma[K:]] == [r["loss"] for r in mb], "losses after the resume differ"
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["eval_loss"] == sb["eval_loss"]  # eval mode reads every rank's running statistics
    wa, wb = load_weights(a), load_weights(b)
    assert BUFFERS <= set(wa) and all(torch.equal(wa[k], wb[k]) for k in wa), "final weights or buffers differ"


def after_resume(tmp_path, ckpt, nproc: int, strategy: str, module_dir) -> list[dict]:
    out = tmp_path / f"{strategy}-{nproc}"
    out.mkdir()
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "tests" / "workers" /
           "buffers_after_resume.py"), str(out), *COMMON, f"strategy={strategy}", f"trainer.max_steps={K + 1}",
           f"data.micro_batch={12 // nproc}", f"checkpoint.resume={ckpt}", f"run.dir={out / 'run'}",
           "logging.wandb.mode=disabled", "logging.progress=false"]
    proc = run_process(cmd, timeout=300, env=base_env(PYTHONPATH=str(module_dir)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def test_buffers_reshard_by_the_documented_rule(tmp_path, module_dir):
    src = tmp_path / "src"
    run_ranks(src, 2, *COMMON, "strategy=zero2", f"trainer.max_steps={K}", f"checkpoint.every={K}",
              "data.micro_batch=6", env={"PYTHONPATH": str(module_dir)})
    ckpt = src / "checkpoints" / f"step_{K:08d}"
    saved = [saved_buffers(ckpt, r) for r in (0, 1)]
    assert not torch.equal(saved[0]["blocks.1.scale"], saved[1]["blocks.1.scale"])  # each rank its own
    for strategy, nproc in (("zero3", 2), ("ddp", 3), ("zero1", 1)):
        got = after_resume(tmp_path, ckpt, nproc, strategy, module_dir)
        for rank, buffers in enumerate(got):
            want = saved[rank] if nproc == 2 else saved[0]  # same world size: its own; else rank 0's
            assert set(buffers) == BUFFERS, (strategy, nproc, rank)
            assert all(torch.equal(buffers[k], want[k]) for k in BUFFERS), (strategy, nproc, rank)
