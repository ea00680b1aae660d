"""Activations: measured bytes saved for backward against the per-tensor prediction, activation
checkpointing (same weights, fewer bytes), and the config that selects it.

Fast tier, in-process, one rank: activations do not depend on the strategy (every strategy runs
the same forward with weights in the compute dtype; zerolab.activations says why), so a single
process measures what every rank of every strategy saves. The slow tier runs checkpointing (blocks
and selective) under ddp, zero2, zero3, fsdp and DeepSpeed stage 3 with 2 real ranks: bitwise the
weights of the run without, the bytes the prediction says, and for selective the dry run's peak.
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
        for p in (0.0, 0.1) for ck in ("none", "blocks", "selective") if ck != "selective" or s == 64]
SMALL = [(16, 128, "fp32", 0.0, "none"), (1, 128, "bf16", 0.1, "blocks"), (1, 64, "fp32", 0.1, "none"),
         (2, 128, "bf16", 0.0, "every_k"), (4, 64, "fp32", 0.1, "every_k"), (3, 128, "bf16", 0.0, "selective"),
         (2, 64, "fp32", 0.1, "selective")]


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
    assert checkpointed_blocks(3, "selective") == [True] * 3
    assert compose(["model.activation_checkpointing=selective"]).model.activation_checkpointing == "selective"
    # DeepSpeed stage 3's Linear adds the bias in place into the matmul output the selective cache
    # holds (zerolab/config.py): measured here before the refusal, the weights differed after 4 steps
    with pytest.raises(ConfigError, match="selective under strategy=deepspeed strategy.stage=3"):
        compose(["model.activation_checkpointing=selective", "strategy=deepspeed", "strategy.stage=3"])
    compose(["model.activation_checkpointing=selective", "strategy=deepspeed", "strategy.stage=2"])


def test_selective_keeps_torchtitans_ops_every_second_matmul_and_attention():
    """The policy keeps the outputs of every second matmul and of attention, counting from each
    block's forward: zerolab's GPT block (Linears with bias: addmm) keeps qkv and fc and SDPA's CPU
    flash kernel; the same block without biases (mm, torchtitan's matmul) keeps the same ones; with
    attention dropout the CPU runs SDPA as separate ops, none of them kept."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from zerolab.models.recompute import selective_policy

    aten = torch.ops.aten
    for bias, dropout, want in ((True, 0.0, [aten.addmm, aten._scaled_dot_product_flash_attention_for_cpu, aten.addmm]),
                                (False, 0.0, [aten.mm, aten._scaled_dot_product_flash_attention_for_cpu, aten.mm]),
                                (True, 0.1, [aten.addmm, aten.addmm])):
        cfg = dataclasses.replace(load_model_config("gpt_tiny"), bias=bias, dropout=dropout)
        block = build_model(cfg).blocks[0].train()
        x = torch.randn(2, 8, cfg.n_embd, requires_grad=True)
        for _ in range(2):  # a fresh policy per block forward: the same ops each time
            seen = []
            policy = selective_policy()

            def spy(ctx, func, *args, **kwargs):
                decision = policy(ctx, func, *args, **kwargs)
                if decision.name == "MUST_SAVE":
                    seen.append(func.overloadpacket)
                return decision
            caching, _ = create_selective_checkpoint_contexts(spy)
            with caching:
                block(x)
            assert seen == want, (bias, dropout, seen)


def test_the_rehearsed_activation_model_equals_the_formula_recomputed_block_included():
    """The planner's model of a user's model (zerolab.rehearsal.activation_model: measured on fake
    tensors) and zerolab's per-tensor formula, on zerolab's GPT, agree to the byte in every mode,
    and so does the peak's recomputed block (zerolab.memory.recompute_bytes): for selective the
    rehearsal measures which kept outputs the plain forward also saves (each block under the
    policy's caching mode alone), the formula names them (zerolab/activations.py)."""
    from zerolab.memory import recompute_bytes
    from zerolab.rehearsal import activation_model

    for dropout, precision in ((0.0, "bf16"), (0.1, "fp32")):
        cfg = dataclasses.replace(load_model_config("gpt_tiny"), dropout=dropout)
        model = activation_model(cfg, 64, precision)
        for b in (1, 3, 5):
            by_mode = {}
            for mode in ("none", "blocks", "selective"):
                rehearsed = model(b, mode)
                formula = predict_activations(cfg, b, 64, precision, "cpu", checkpointing=mode)
                assert (rehearsed.bytes, recompute_bytes(rehearsed)) == (formula.bytes, recompute_bytes(formula)), \
                    (dropout, precision, b, mode)
                by_mode[mode] = formula
            assert by_mode["blocks"].bytes < by_mode["selective"].bytes < by_mode["none"].bytes
            assert 0 < recompute_bytes(by_mode["selective"]) < recompute_bytes(by_mode["blocks"])


# ---- a training run: checkpointing on vs off --------------------------------------------------

RUN = ["model=gpt_tiny", "model.dropout=0.1", "data=synthetic", "data.micro_batch=4", "trainer.max_steps=20",
       "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=10", "precision=fp32",
       "strategy=ddp", "logging.wandb.mode=disabled", "logging.progress=false", "dist.device=cpu"]


@pytest.mark.slow  # in-process, but several seconds: kept out of the 2-minute fast tier
def test_checkpointing_keeps_the_weights_and_saves_the_predicted_bytes(tmp_path, one_rank):
    from zerolab.trainer import Trainer

    weights, measured = {}, {}
    for mode in ("none", "blocks", "every_k", "selective"):
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
    for m in ("blocks", "every_k", "selective"):
        assert_same_weights(weights[m], weights["none"], f"activation checkpointing={m} vs none")
    (none,), (blocks,), (every_k,), (selective,) = (measured[m] for m in ("none", "blocks", "every_k", "selective"))
    assert blocks < every_k < none and blocks < selective < none


# ---- slow tier: 2 ranks, strategies that hook into the blocks ----------------------------------
@pytest.mark.slow
# zero3 frees a block's weights in its forward post-hook: the recomputation in backward must not
# run that hook (torch's non-reentrant checkpoint stops recomputing once the saved tensors it
# needs exist, before the block returns), or backward would read freed weights.
# DeepSpeed stage 3 gathers parameters in its own module hooks, which recomputation runs again.
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp", "deepspeed strategy.stage=3"])
def test_checkpointing_under_sharded_strategies(tmp_path, strategy, request):
    if strategy.startswith("deepspeed"):
        request.getfixturevalue("deepspeed_ops")  # skips, with the reason, where the ops are not built
    from zerolab.rehearsal import rehearse

    name, *extra = strategy.split()
    common = ["model=gpt_tiny", "model.dropout=0.1", "data.micro_batch=2", "trainer.max_steps=4",
              "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=1", f"strategy={name}", *extra,
              "precision=fp32"]
    # ddp: none and selective (blocks: the one-rank test above); DeepSpeed stage 3: none and blocks
    # (selective is refused there: tests/test_activations.py's config test says why)
    modes = {"ddp": ("none", "selective"), "deepspeed": ("none", "blocks")}.get(name, ("none", "blocks", "selective"))
    for mode in modes:
        run_train(tmp_path / mode, 2, *common, f"model.activation_checkpointing={mode}")
    # As in the one-rank test: the same numbers, recomputed, whatever the strategy does around the block.
    for mode in modes[1:]:
        assert_same_weights(load_weights(tmp_path / mode), load_weights(tmp_path / "none"),
                            f"{strategy}: activation checkpointing={mode} vs none")
    cfg = load_model_config("gpt_tiny")
    measured = {}
    for mode in modes:
        last = read_metrics(tmp_path / mode)[-1]
        want = predict_activations(dataclasses.replace(cfg, dropout=0.1, activation_checkpointing=mode), 2,
                                   precision="fp32").bytes
        assert last["rank0/mem/activations_bytes"] == last["rank1/mem/activations_bytes"] == want, (mode, last)
        measured[mode] = want
    if len(measured) == 3:
        assert measured["blocks"] < measured["selective"] < measured["none"]
    summary = json.loads((tmp_path / modes[-1] / "summary.json").read_text())
    assert summary["memory_per_rank"][0]["mem/activations_bytes"] > 0
    if "selective" in modes:
        # the dry run of rank 0 with selective checkpointing counts what the real rank 0 counted,
        # to the byte: the same forward on fake tensors, the same meter, the same peak composition
        real = summary["peak_memory_per_rank"][0]
        dry = rehearse([*common, "model.activation_checkpointing=selective"],
                       world=2, rank=0).measured
        for key in ("mem/peak_bytes", "mem/peak_activations_bytes", "mem/peak_transient_bytes",
                    "mem/peak_model_states_bytes"):
            assert dry[key] == real[key], (strategy, key, dry[key], real[key])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_selective_on_a_gpu_target_equals_the_cuda_ledger(precision):
    """A CUDA target's dry run (zerolab.rehearsal: CUDA's attention kernels, memory-efficient for
    fp32, flash for bf16, with dropout) keeps the kernel's outputs under selective checkpointing, its
    RNG state and padded or unpadded logsumexp included: the meter equals the ledger's CUDA terms to
    the byte, as the CPU target equals the CPU's. A sequence of 50 tells the two logsumexps apart."""
    from zerolab.rehearsal import rehearse

    job = ["model=gpt_tiny", "data.micro_batch=2", f"precision={precision}", "model.dropout=0.1",
           "model.block_size=50", "strategy=ddp", "model.activation_checkpointing=selective"]
    for target in ("cpu", "cuda"):
        r = rehearse(job, world=2, target=target)
        assert r.measured["mem/activations_bytes"] == r.predicted["mem/activations_bytes"], (target, r.measured)
