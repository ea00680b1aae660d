"""Activations: measured bytes saved for backward against the per-tensor prediction, activation
checkpointing (same weights, fewer bytes), and the config that selects it.

Fast tier, in-process, one rank: activations do not depend on the strategy (every strategy runs
the same forward with weights in the compute dtype; zerolab.activations says why), so a single
process measures what every rank of every strategy saves. The slow tier runs checkpointing under
zero2 and fsdp with 2 real ranks.
"""
import dataclasses
import functools
import json

import pytest
import torch

from conftest import assert_same_weights, load_weights, read_metrics, run_train
from zerolab.activations import ActivationMeter, checkpointed_blocks, predict_activations
from zerolab.config import ConfigError, compose
from zerolab.memory import load_model_config
from zerolab.models import build_model, lm_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.lru_cache(maxsize=None)
def _model(name: str, dropout: float, precision: str, block: int):
    cfg = dataclasses.replace(load_model_config(name), dropout=dropout, block_size=max(block, 64))
    torch.manual_seed(0)
    return build_model(cfg).to(DTYPES[precision]).train()


def measure(name, b, s, precision, dropout, checkpointing):
    """Bytes one forward saves, on batches laid out as the trainer's (x, y views of one window)."""
    model = _model(name, dropout, precision, s)
    model.cfg = dataclasses.replace(model.cfg, activation_checkpointing=checkpointing)
    window = torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(b))
    with ActivationMeter(model) as meter:
        loss = lm_loss(model(window[:, :-1]), window[:, 1:])
    del loss
    return meter.bytes, predict_activations(model.cfg, b, s, precision, "cpu").bytes


TINY = [(b, s, prec, p, ck) for b in (1, 4, 16) for s in (64, 128) for prec in ("fp32", "bf16")
        for p in (0.0, 0.1) for ck in ("none", "blocks")]
SMALL = [(16, 128, "fp32", 0.0, "none"), (1, 128, "bf16", 0.1, "blocks"), (1, 64, "fp32", 0.1, "none"),
         (2, 128, "bf16", 0.0, "every_k"), (4, 64, "fp32", 0.1, "every_k")]


@pytest.mark.parametrize("name,b,s,precision,dropout,checkpointing",
                         [("gpt_tiny", *c) for c in TINY] + [("gpt_small", *c) for c in SMALL])
def test_predicted_activations_equal_measured(name, b, s, precision, dropout, checkpointing):
    measured, predicted = measure(name, b, s, precision, dropout, checkpointing)
    # The prediction names every tensor autograd saves (zerolab/activations.py), so on CPU the two
    # are equal to the byte; the issue asks for 5%, which a missing or extra term of the per-layer
    # count (at least b·s·h·c per layer, >5% of a layer here) would break.
    assert predicted == measured, (measured, predicted, predicted / measured)


def test_mlp_prediction_equals_measured():
    cfg = load_model_config("mlp")
    model = build_model(cfg).train()
    window = torch.randint(0, 256, (8, cfg.block_size + 1))
    with ActivationMeter(model) as meter:
        lm_loss(model(window[:, :-1]), window[:, 1:])
    assert meter.bytes == predict_activations(cfg, 8, precision="fp32").bytes


def test_meter_counts_each_storage_once_and_no_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationMeter(lin) as meter:
        y = lin(x)  # saves x (for the weight's gradient) and weight.t() (for x's): a parameter view
        a, b = y.split(4, dim=1)
        (a * b).sum()  # saves a and b: two views of y's one storage
    assert meter.bytes == x.numel() * 4 + y.numel() * 4
    with ActivationMeter() as unlisted:  # no model given: the Parameter check alone leaves weight.t() out
        lin(x)
    assert unlisted.bytes == x.numel() * 4
    with ActivationMeter(lin, enabled=False) as off:
        lin(x)
    assert off.bytes == 0 and off.tensors == 0


def test_checkpointed_blocks_and_config_validation():
    assert checkpointed_blocks(4, "none") == [False] * 4
    assert checkpointed_blocks(4, "blocks") == [True] * 4
    assert checkpointed_blocks(5, "every_k", 2) == [True, False, True, False, True]
    with pytest.raises(ConfigError, match="model.activation_checkpointing='some'.*none, blocks, every_k"):
        compose(["model.activation_checkpointing=some"])
    with pytest.raises(ConfigError, match="model.checkpoint_every_k=0 must be > 0"):
        compose(["model.activation_checkpointing=every_k", "model.checkpoint_every_k=0"])
    with pytest.raises(ConfigError, match="GPT blocks only"):
        compose(["model=mlp", "model.activation_checkpointing=blocks"])
    assert compose(["model.activation_checkpointing=blocks"]).model.activation_checkpointing == "blocks"


# ---- a training run: checkpointing on vs off --------------------------------------------------

RUN = ["model=gpt_tiny", "model.dropout=0.1", "data=synthetic", "data.micro_batch=4", "trainer.max_steps=20",
       "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=10", "precision=fp32",
       "strategy=ddp", "logging.wandb.mode=disabled", "logging.progress=false", "dist.device=cpu"]


@pytest.mark.slow  # in-process, but several seconds: kept out of the 2-minute fast tier
def test_checkpointing_keeps_the_weights_and_saves_the_predicted_bytes(tmp_path, one_rank):
    from zerolab.trainer import Trainer

    weights, measured = {}, {}
    for mode in ("none", "blocks", "every_k"):
        cfg = compose([*RUN, f"model.activation_checkpointing={mode}", f"run.dir={tmp_path / mode}"])
        trainer = Trainer(cfg, one_rank)
        trainer.fit()
        trainer.close()
        weights[mode] = load_weights(tmp_path / mode)
        records = [r for r in read_metrics(tmp_path / mode) if "rank0/mem/activations_bytes" in r]
        assert len(records) >= 2  # every logged step measures
        measured[mode] = {r["rank0/mem/activations_bytes"] for r in records}
        assert measured[mode] == {predict_activations(cfg.model, 4, precision="fp32").bytes}, mode
        assert all(r["rank0/mem_pred/activations_bytes"] == r["rank0/mem/activations_bytes"] for r in records)
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert summary["memory_ledger"]["activations_predicted_bytes"] in measured[mode]
    # Recomputation runs the same kernels on the same inputs with the RNG state restored, so the
    # forward, the dropout masks and every gradient are the same numbers: bitwise the same weights.
    for m in ("blocks", "every_k"):
        assert_same_weights(weights[m], weights["none"], f"activation checkpointing={m} vs none")
    (none,), (blocks,), (every_k,) = measured["none"], measured["blocks"], measured["every_k"]
    assert blocks < every_k < none


# ---- slow tier: 2 ranks, strategies that hook into the blocks ----------------------------------
@pytest.mark.slow
# zero3 frees a block's weights in its forward post-hook: the recomputation in backward must not
# run that hook (torch's non-reentrant checkpoint stops recomputing once the saved tensors it
# needs exist, before the block returns), or backward would read freed weights.
# DeepSpeed stage 3 gathers parameters in its own module hooks, which recomputation runs again.
@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp", "deepspeed strategy.stage=3"])
def test_checkpointing_under_sharded_strategies(tmp_path, strategy, request):
    if strategy.startswith("deepspeed"):
        request.getfixturevalue("deepspeed_ops")  # skips, with the reason, where the ops are not built
    name, *extra = strategy.split()
    common = ["model=gpt_tiny", "model.dropout=0.1", "data.micro_batch=2", "trainer.max_steps=4",
              "trainer.eval_every=0", "trainer.eval_batches=1", f"strategy={name}", *extra, "precision=fp32"]
    run_train(tmp_path / "none", 2, *common)
    run_train(tmp_path / "blocks", 2, *common, "model.activation_checkpointing=blocks")
    # As in the one-rank test: the same numbers, recomputed, whatever the strategy does around the block.
    assert_same_weights(load_weights(tmp_path / "blocks"), load_weights(tmp_path / "none"),
                        f"{strategy}: activation checkpointing vs none")
    cfg = load_model_config("gpt_tiny")
    for mode in ("none", "blocks"):
        last = read_metrics(tmp_path / mode)[-1]
        want = predict_activations(dataclasses.replace(cfg, dropout=0.1, activation_checkpointing=mode), 2,
                                   precision="fp32").bytes
        assert last["rank0/mem/activations_bytes"] == last["rank1/mem/activations_bytes"] == want, (mode, last)
    summary = json.loads((tmp_path / "blocks" / "summary.json").read_text())
    assert summary["memory_per_rank"][0]["mem/activations_bytes"] > 0
