"""The dry run (zerolab.rehearsal, `python -m zerolab dry-run`): rank r of an N-rank job rehearsed
in one process on fake tensors and torch's fake process group, held against the ledger (in
process, fast tier) and against real runs of the same jobs (slow tier).

What the comparisons rest on: a dry run runs the job's own Trainer, strategy and memory
accounting, so its figures are the ones a real run's logged step counts, with nothing that
depends on data. The tolerance with real runs is the issue's 2%; measured on 2026-12-01 the
figures were equal to the byte (gpt_small under ddp, zero1, zero2, zero3, fsdp; a Llama under
zero3 with bf16 and checkpointing). The ledger is exact for the model states of zerolab's
sharders and FSDP2 (as in real runs, tests/test_memory_e2e.py).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import run_ranks
from zerolab.accounting import MODEL_STATES
from zerolab.rehearsal import cli_main, format_rehearsal, rehearse
from zerolab.rehearsal.fake import RehearsalMode

TINY = ["model=gpt_tiny", "data.micro_batch=2", "optim=adamw"]
SHARDERS = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
REAL_TOL = 0.02  # the bound (module docstring: measured equal)


def states(figures: dict) -> dict:
    return {c: figures[f"mem/{c}_bytes"] for c in (*MODEL_STATES, "buffers")}


# ---- in process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [*SHARDERS, "torch_zero"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_rehearsed_rank_holds_what_the_ledger_predicts(strategy, precision):
    """The last rank of 4 (FSDP2's holds fewer rows): every model-state category as the ledger
    predicts it, to the byte, and a peak that repeats (the rehearsal stops once it does)."""
    check_rehearsal([*TINY, f"strategy={strategy}", f"precision={precision}"], strategy)


@pytest.mark.parametrize("strategy", ["zero1", "zero3", "fsdp"])
@pytest.mark.parametrize("setting", ["precision=fp16", "precision=bf16_pure", "optim=lamb", "optim=sgd_momentum",
                                     "trainer.grad_accum_steps=2", "model.activation_checkpointing=blocks"])
def test_every_precision_optimizer_and_schedule_rehearses(strategy, setting):
    """fp16 (its loss scale and counters are read exactly: constants to fake tensors), bf16_pure,
    LAMB's and momentum's state, accumulation and checkpointing, under sharders of each stage."""
    check_rehearsal([*TINY, f"strategy={strategy}", setting], strategy)


def check_rehearsal(overrides: list[str], strategy: str) -> None:
    r = rehearse(overrides, world=4, rank=3)
    assert (r.world, r.rank, r.strategy, r.not_rehearsed) == (4, 3, strategy, "")
    predicted = {c: r.predicted[f"mem/{c}_bytes"] for c in (*MODEL_STATES, "buffers")}
    assert states(r.measured) == predicted
    assert 3 <= r.steps and r.peaks[-1] == r.peaks[-2]
    assert r.measured["mem/peak_bytes"] >= r.measured["mem/model_states_bytes"] + r.measured["mem/activations_bytes"]
    table = format_rehearsal(r)
    assert "dry run of rank 3 of 4" in table and "not counted here" in table


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpu_target_runs_cudas_kernels_and_equals_the_cuda_ledger(precision):
    """With dropout, a CPU target rehearses the CPU's kernels (the math attention keeping every b·a·s²
    matrix, dropout noise in the compute dtype) and equals the ledger's CPU prediction, as real CPU
    runs do; a CUDA target rehearses CUDA's (flash for bf16, memory-efficient for fp32, with their
    RNG state and logsumexp; bool dropout masks; fp32 layer-norm statistics) and equals the ledger's
    CUDA prediction, to the byte. A sequence of 50 tells flash's logsumexp from the memory-efficient
    kernel's (padded to 64 rows)."""
    job = [*TINY, f"precision={precision}", "model.dropout=0.1", "model.block_size=50", "strategy=ddp"]
    cpu, cuda = rehearse(job, world=2, target="cpu"), rehearse(job, world=2, target="cuda")
    for r in (cpu, cuda):
        for key in ("mem/activations_bytes", "mem/peak_bytes"):
            assert r.measured[key] == r.predicted[key], (r.kernels, key, r.measured[key], r.predicted[key])
    assert cuda.kernels == "cuda" and "CUDA's kernels" in format_rehearsal(cuda)
    assert cuda.measured["mem/activations_bytes"] < cpu.measured["mem/activations_bytes"]


def test_gpt2_with_dropout_on_a_gpu_target_keeps_no_score_matrix(tmp_path):
    """A transformers GPT-2 config with dropout 0.1 (its default) beside the same with 0: on a CUDA
    target the attention runs the flash kernel either way, so the two differ by the bool masks of
    the embedding's and each block's two residual dropouts alone (1 byte per element); on the CPU
    target the math path keeps at least one b·a·s² matrix per layer more."""
    b, s, h, a, layers = 2, 256, 64, 4, 2

    def activations(dropout: float, target: str) -> int:
        path = tmp_path / f"gpt2-{dropout}.json"
        path.write_text(json.dumps({"model_type": "gpt2", "n_embd": h, "n_layer": layers, "n_head": a,
                                    "n_positions": s, "vocab_size": 256, "resid_pdrop": dropout,
                                    "embd_pdrop": dropout, "attn_pdrop": dropout}))
        r = rehearse(["model=hf", f"model.config={path}", f"model.block_size={s}", f"data.micro_batch={b}",
                      "precision=bf16", "strategy=ddp"], world=2, target=target)
        return r.measured["mem/activations_bytes"]

    masks = b * s * h * (1 + 2 * layers)
    assert activations(0.1, "cuda") - activations(0.0, "cuda") == masks
    assert activations(0.1, "cpu") - activations(0.0, "cpu") > layers * b * a * s * s


@pytest.mark.slow  # in-process, but several seconds: kept out of the 2-minute fast tier
def test_the_fp32_floor_of_zero1_and_zero2():
    """fp32 with AdamW (issue 27): zero1 holds (4 + 4 + 8/N) bytes per parameter, zero2
    (4 + (4 + 8)/N), zero3 16/N, plus each bucket's padding to a multiple of N; ddp 16. Rehearsed
    at N = 8, where the ratios to ddp are 8.5/16, 5.5/16 and 2/16."""
    got = {s: rehearse(["model=gpt_mid", f"strategy={s}", "precision=fp32", "data.micro_batch=1"], world=8)
           for s in ("ddp", "zero1", "zero2", "zero3")}
    psi = got["ddp"].n_params
    assert got["ddp"].measured["mem/model_states_bytes"] == 16 * psi
    for strategy, per_param in (("zero1", 4 + 4 + 8 / 8), ("zero2", 4 + 12 / 8), ("zero3", 16 / 8)):
        m = got[strategy].measured
        excess = m["mem/model_states_bytes"] - per_param * psi
        # fewer than N padding elements in each of fewer than 64 buckets, at most 16 bytes each
        assert 0 <= excess <= 16 * 7 * 64, (strategy, m)
        assert m["mem/master_bytes"] == 0, strategy  # no fp32 copy of fp32 weights


def test_deepspeed_is_not_rehearsed_and_the_ledger_is_shown(capsys):
    r = rehearse([*TINY, "strategy=deepspeed", "strategy.stage=2"], world=8)
    assert "fake tensors" in r.not_rehearsed and not r.measured
    assert r.predicted["mem/model_states_bytes"] > 0
    text = format_rehearsal(r)
    assert text.splitlines()[1].startswith("not rehearsed: DeepSpeed's engine") and "model states" in text


def test_host_reads_have_one_answer_each():
    """False for a flag, 1 for an integer, 1.0 for a float (the module docstring says why none of
    them changes what is allocated)."""
    with RehearsalMode():
        t = torch.ones(3)
        assert t.sum().item() == 1.0 and isinstance(t.sum().item(), float)
        assert bool((t > 5).any()) is False
        assert int(torch.zeros((), dtype=torch.long) + 7) == 1


def test_the_cli_prints_the_runs_keys_as_json(capsys):
    assert cli_main(["--world", "2", "--rank", "1", "--json", *TINY, "strategy=zero2"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("mem/peak_bytes", "mem/peak_phase", "mem/peak_model_states_bytes", "mem/peak_activations_bytes",
                "mem/peak_transient_bytes", "mem/params_bytes", "mem/grads_bytes", "mem/master_bytes",
                "mem/optim_state_bytes"):
        assert key in out["measured"] and key in out["predicted"], key
    assert out["world"] == 2 and out["rank"] == 1 and out["not_counted"]


@pytest.mark.parametrize("argv, message", [(["--world", "2", "--rank", "2"], "--rank 2 is not a rank of a 2-rank job"),
                                           (["--world", "2", "strategy=zero9"], "strategy")])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert cli_main([*argv, *TINY]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---- against real runs ---------------------------------------------------------------------------
COMPARED = ("mem/peak_bytes", "mem/peak_model_states_bytes", "mem/peak_activations_bytes")
GPT_SMALL = ["model=gpt_small", "precision=fp32", "data.micro_batch=4", "trainer.max_steps=3", "trainer.log_every=1",
             "trainer.eval_every=0", "run.save_model=false"]


def real_rank(run, rank: int) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    return summary["peak_memory_per_rank"][rank]


def assert_close(rehearsed: dict, real: dict, what: str) -> None:
    for key in COMPARED:
        assert math.isclose(rehearsed[key], real[key], rel_tol=REAL_TOL), (what, key, rehearsed[key], real[key])
    assert rehearsed["mem/peak_phase"] == real["mem/peak_phase"], what


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SHARDERS)
def test_rank0_of_a_gpt_small_job_as_its_real_run(tmp_path, strategy):
    """gpt_small, 2 ranks, fp32, micro-batch 4: the dry run of rank 0 against the real job's rank 0."""
    run = tmp_path / "run"
    run_ranks(run, 2, *GPT_SMALL, f"strategy={strategy}")
    assert_close(rehearse([*GPT_SMALL, f"strategy={strategy}"], world=2, rank=0).measured, real_rank(run, 0), strategy)


@pytest.mark.slow
def test_the_last_rank_of_a_llama_job_with_checkpointing_as_its_real_run(tmp_path):
    """A tiny Llama (tests/test_models.py) under zero3, bf16, activation checkpointing, 3 ranks:
    the dry run of rank 2 against the real job's rank 2."""
    from test_models import write_configs

    config = write_configs(tmp_path / "configs")["llama"]
    job = ["model=hf", f"model.config={config}", "model.block_size=64", "strategy=zero3", "precision=bf16",
           "model.activation_checkpointing=blocks", "data.micro_batch=2", "trainer.max_steps=3", "trainer.log_every=1",
           "trainer.eval_every=0", "run.save_model=false"]
    run = tmp_path / "run"
    run_ranks(run, 3, *job)
    assert_close(rehearse(job, world=3, rank=2).measured, real_rank(run, 2), "llama zero3 bf16 blocks")


@pytest.mark.slow
def test_fp32_model_states_in_real_runs_are_the_papers(tmp_path):
    """fp32, gpt_mid, AdamW, 2 ranks, measured in real runs: model states per rank are 12/16 of
    ddp's for zero1, 10/16 for zero2 and 8/16 for zero3, plus each bucket's padding (fewer than N
    elements in each of fewer than 64 buckets, 16 bytes each)."""
    figures = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        run = tmp_path / strategy
        run_ranks(run, 2, "model=gpt_mid", "precision=fp32", "optim=adamw", f"strategy={strategy}",
                  "data.micro_batch=2", "trainer.max_steps=2", "trainer.eval_every=0", "run.save_model=false")
        figures[strategy] = json.loads((run / "summary.json").read_text())["memory_per_rank"]
    ddp = figures["ddp"][0]["mem/model_states_bytes"]
    for strategy, sixteenths in (("zero1", 12), ("zero2", 10), ("zero3", 8)):
        for rank in figures[strategy]:
            excess = rank["mem/model_states_bytes"] - ddp * sixteenths / 16
            assert 0 <= excess <= 16 * 1 * 64, (strategy, rank["mem/model_states_bytes"], ddp)
            assert rank["mem/master_bytes"] == 0, strategy


# Llama 2 7B at 64 ranks (model states 16Ψ/64 plus padding, RSS under 2 GB) is checked by
# tests/test_readme_runs.py, which runs README's dry run of the shipped llama2-7b shape as written.
