"""The step's peak per rank by zerolab's own CPU accounting (zerolab.memory.peak: model states
measured by the strategy + activations measured by the meter + transients) against the
planner's prediction of it, and the planner's largest micro-batch confirmed by real runs.

Fast tier: one in-process gloo rank (the one_rank fixture of conftest). ddp in fp32 has
no transient of its own, and the model states and activations are predicted to the byte, so the
accounting and the planner must agree exactly; bf16 adds the fp32 gradient copies of the
optimizer step, which ddp records as it makes them. Slow tier: two 2-rank torchrun runs.
"""
import dataclasses
import json

import pytest

from conftest import read_metrics, run_train
from zerolab.config import compose
from zerolab.memory import load_model_config
from zerolab.plan import Planner

PARTS = ("model_states", "activations", "transient")
RUN = ["data=synthetic", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=1",
       "logging.wandb.mode=disabled", "logging.progress=false", "dist.device=cpu", "run.save_model=false"]


def _train_one_rank(tmp_path, ctx, *overrides):
    from zerolab.trainer import Trainer

    cfg = compose([*RUN, *overrides, f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, ctx)
    trainer.fit()
    trainer.close()
    return trainer, [r for r in read_metrics(tmp_path) if "rank0/mem/peak_bytes" in r]


@pytest.mark.parametrize("model,precision", [("gpt_small", "fp32"), ("gpt_tiny", "bf16")])
def test_cpu_peak_equals_the_planners_for_ddp(tmp_path, one_rank, model, precision):
    b, seq = 2, 64
    trainer, records = _train_one_rank(tmp_path, one_rank, f"model={model}", f"model.block_size={seq}",
                                   f"data.micro_batch={b}", "trainer.max_steps=2", f"precision={precision}",
                                   "strategy=ddp")
    assert len(records) == 2
    peak, parts, phase = Planner(trainer.cfg.model, 1, seq, precision, device="cpu").peak("ddp", b, "none")
    predicted = {"model_states": sum(parts[k] for k in ("params", "grads", "master", "optim_state", "buffers")),
                 "activations": parts["activations"], "transient": parts["transient"]}
    last = records[-1]  # the first step's optimizer state is created inside it; from step 2 on it exists throughout
    assert last["rank0/mem/peak_phase"] == phase == "backward"
    assert {p: last[f"rank0/mem/peak_{p}_bytes"] for p in PARTS} == predicted
    assert last["rank0/mem/peak_bytes"] == peak
    # the ledger's rows are the planner's composition (zerolab.memory.peak), for this run
    assert last["rank0/mem_pred/peak_bytes"] == peak
    assert {p: last[f"rank0/mem_pred/peak_{p}_bytes"] for p in PARTS} == predicted
    check = json.loads((tmp_path / "summary.json").read_text())["memory_ledger"]["peak"]
    assert check["per_rank"][0]["peak_measured_over_predicted"] == 1.0 and not check["warnings"]


def test_ddp_records_its_step_transient_in_bf16(tmp_path, one_rank):
    """bf16: the optimizer step holds fp32 copies of every gradient (Ψ × 4 bytes), recorded by ddp
    as it makes them, as the ledger predicts (not the peak: backward holds more)."""
    trainer, _ = _train_one_rank(tmp_path, one_rank, "model=gpt_tiny", "model.block_size=32",
                                 "data.micro_batch=1", "trainer.max_steps=1", "precision=bf16", "strategy=ddp")
    predicted = [t.bytes for t in trainer.memory.predicted[0].terms if t.category == "transient" and t.when == "step"]
    assert trainer.strategy.transient.peak() == {"backward": 0, "step": 4 * trainer.n_params}
    assert predicted == [4 * trainer.n_params]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_transient_stays_within_its_prediction(tmp_path, one_rank, strategy):
    """zero2 records the gradient buckets it copies and their reduce-scatter outputs while they
    live; the ledger bounds them by the buckets that can be in flight at once (MAX_IN_FLIGHT + 1
    launched before backward waits, plus one filling). Small buckets, so there are 8 of them and
    the bound (not the number of buckets) decides. zero3 adds its gathered weights (at most
    MAX_LIVE_BUCKETS buckets). Model states and activations of its peak are the ledger's to the byte."""
    trainer, records = _train_one_rank(tmp_path, one_rank, "model=gpt_tiny", "model.block_size=32",
                                       "data.micro_batch=2", "trainer.max_steps=2", "precision=fp32",
                                       f"strategy={strategy}", "strategy.bucket_mb=0.05")
    last = records[-1]
    model_part = 8 * 2 * 32 * trainer.cfg.model.vocab_size  # the loss's logits buffers
    measured = trainer.strategy.transient.peak()["backward"]
    assert last["rank0/mem/peak_transient_bytes"] == model_part + measured
    predicted = last["rank0/mem_pred/peak_transient_bytes"] - model_part
    # A sharder that freed nothing until backward ended would hold every bucket's copy and output
    # at once, 2 × the padded gradient (948,224 bytes here): the bounds below tell the two apart.
    assert 0 < measured <= predicted
    if strategy == "zero2":
        assert measured < 2 * 4 * sum(b.size for b in trainer.strategy.buckets)
    assert last["rank0/mem/peak_model_states_bytes"] == last["rank0/mem_pred/peak_model_states_bytes"]
    assert last["rank0/mem/peak_activations_bytes"] == last["rank0/mem_pred/peak_activations_bytes"]


# ---- slow tier: the planner's answer, confirmed by two real 2-rank runs ---------------------------
@pytest.mark.slow
def test_planner_largest_micro_batch_is_confirmed_by_runs(tmp_path):
    seq, world = 64, 2
    mcfg = dataclasses.replace(load_model_config("gpt_small"), block_size=seq)
    planner = Planner(mcfg, world, seq, "fp32", device="cpu")
    # A limit halfway between the predicted peaks at micro-batch 3 and 4: the planner answers 3.
    limit = (planner.peak("ddp", 3, "none")[0] + planner.peak("ddp", 4, "none")[0]) // 2
    fit = planner.fit("ddp", limit, "none")
    assert fit.micro_batch == 3
    peaks = {}
    for b in (fit.micro_batch, fit.micro_batch + 1):
        run_train(tmp_path / f"mb{b}", world, "model=gpt_small", f"model.block_size={seq}", f"data.micro_batch={b}",
                  "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1",
                  "precision=fp32", "strategy=ddp", "run.save_model=false")
        last = [r for r in read_metrics(tmp_path / f"mb{b}") if "rank0/mem/peak_bytes" in r][-1]
        peaks[b] = [last[f"rank{r}/mem/peak_bytes"] for r in range(world)]
    assert all(p <= limit for p in peaks[fit.micro_batch]), (peaks, limit)
    assert all(p > limit for p in peaks[fit.micro_batch + 1]), (peaks, limit)


def test_compare_report_shows_the_peak_split_measured_against_predicted(tmp_path):
    from zerolab.report import Run, compute_stats, peak_table

    rec = {"step": 2}
    for r in range(2):
        for prefix, parts in (("mem", (100, 30, 10)), ("mem_pred", (100, 30, 20))):
            rec[f"rank{r}/{prefix}/peak_bytes"] = sum(parts) * 2 ** 20
            rec.update({f"rank{r}/{prefix}/peak_{p}_bytes": v * 2 ** 20 for p, v in zip(PARTS, parts)})
    run = Run(tmp_path, {"strategy": {"name": "ddp"}}, [rec], {"world_size": 2}, label="ddp")
    compute_stats(run)
    table = peak_table([run]).splitlines()
    assert len(table) == 4  # header, rule, one row per rank
    assert table[2].split("|")[1:-1] == [" ddp ", " 0 ", " 140.00 ", " 100.00 ", " 30.00 ", " 10.00 ",
                                         " 150.00 (100.00 / 30.00 / 20.00) ", " 0.933 "]
