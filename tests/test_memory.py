"""The memory ledger's formulas against hand-computed values, the meta-device parameter count
against an independent count, and the `python -m zerolab memory` CLI."""
import json
import logging
import math

import pytest
import torch

from conftest import run_python
from zerolab.buckets import zero_buckets
from zerolab.memory import (ModelShape, check_against, load_model_config, predict, shape_from_model_config,
                            shape_from_params)

BIG = 1e6  # bucket_mb large enough for one bucket per group


def by_hand(params, grads, master, optim_state, buffers=0):
    out = {"params": params, "grads": grads, "master": master, "optim_state": optim_state, "buffers": buffers}
    out["model_states"] = params + grads + master + optim_state
    out["total"] = out["model_states"] + buffers
    return out


@pytest.mark.parametrize("precision,c,master,s", [("fp32", 4, 0, 4), ("bf16", 2, 4, 4), ("fp16", 2, 4, 4),
                                                  ("bf16_pure", 2, 0, 2)])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ddp_by_hand(precision, c, master, s, world):
    n = 1001
    got = predict(shape_from_params(n), "ddp", world, precision, state_elements=2).bytes()
    assert got == by_hand(c * n, c * n, master * n, 2 * s * n)  # nothing depends on N


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("precision,c", [("fp32", 4), ("bf16", 2)])
def test_zero1_zero2_by_hand(world, precision, c):
    n = 1001  # prime to 2, 4, 8, 64; divisible by 7
    shard = math.ceil(n / world)
    padded = shard * world
    z1 = predict(shape_from_params(n), "zero1", world, precision, bucket_mb=BIG, state_elements=2).bytes()
    z2 = predict(shape_from_params(n), "zero2", world, precision, bucket_mb=BIG, state_elements=2).bytes()
    if precision == "fp32":
        # the paper's floor: the shard the optimizer updates is a view of the owned weights (no
        # master copy), zero1's gradient shard a view of the owned chunk of the whole gradients
        assert z1 == by_hand(4 * padded, 4 * padded, 0, 8 * shard)  # (4 + 4 + 8/N) per parameter
        assert z2 == by_hand(4 * padded, 4 * shard, 0, 8 * shard)  # (4 + (4 + 8)/N)
    else:
        # weights (with the bucket's padding), whole grads + fp32 grad shard, fp32 master shard, 2 × fp32 state
        assert z1 == by_hand(c * padded, c * padded + 4 * shard, 4 * shard, 8 * shard)
        assert z2 == by_hand(c * padded, 4 * shard, 4 * shard, 8 * shard)


def test_zero_buckets_follow_the_sharder_packing():
    # registration order: g0 60, g1 30, g0 50, g1 7. Reverse order, one open bucket per group,
    # a bucket closes at >= 100 elements (bf16: 200 bytes): g0 closes at 50 + 60 = 110, g1 holds 37.
    shape = ModelShape("t", ((0, (6, 10)), (1, (30,)), (0, (50,)), (1, (7,))))
    assert sorted(zero_buckets(shape, 4, 2, 200 / 2 ** 20)) == [40, 112]
    assert sorted(zero_buckets(shape, 1, 2, BIG)) == [37, 110]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_zero3_by_hand(world):
    n = 1001
    shard = math.ceil(n / world)
    assert predict(shape_from_params(n), "zero3", world, "bf16", state_elements=2).bytes() == \
        by_hand(2 * shard, 2 * shard, 4 * shard, 8 * shard)  # the gradient shard in the reduce dtype: bf16
    assert predict(shape_from_params(n), "zero3", world, "bf16", state_elements=2, reduce_dtype="fp32").bytes() == \
        by_hand(2 * shard, 4 * shard, 4 * shard, 8 * shard)  # reduced and summed in fp32: an fp32 shard
    assert predict(shape_from_params(n), "zero3", world, "fp32", state_elements=2).bytes() == \
        by_hand(4 * shard, 4 * shard, 0, 8 * shard)  # fp32: the chunk the optimizer updates is the weights


@pytest.mark.parametrize("world", [1, 4, 8, 64])
def test_paper_table(world):
    """Mixed-precision AdamW (K = 12) with Ψ divisible by N: the ZeRO paper's per-rank bytes; zero3
    equals it, zero1/zero2 are above it by exactly their fp32 gradient shard (documented in the ledger)."""
    n = 64 * 10 ** 6
    ms = lambda s: predict(shape_from_params(n), s, world, "bf16", "adamw", bucket_mb=BIG).bytes()["model_states"]
    assert ms("ddp") == (2 + 2 + 12) * n
    assert ms("zero3") == (2 + 2 + 12) * n // world  # the paper's (2 + 2 + K)Ψ/N: a 16-bit gradient shard
    assert ms("zero1") - (4 * n + 12 * n // world) == 4 * n // world  # paper: no separate gradient shard
    assert ms("zero2") - (2 * n + 14 * n // world) == 2 * n // world  # paper: a 16-bit gradient shard


def test_deepspeed_and_fsdp_terms():
    n, N = 1000, 3
    # DeepSpeed 1/2: flat buffer padded to a multiple of 2N = 6 -> 1002, partitions of 334; the
    # 16-bit gradients of this partition stay, the fp32 gradient partition lives inside step()
    for stage in (1, 2):
        ds = predict(shape_from_params(n), "deepspeed", N, "bf16", stage=stage, bucket_mb=BIG, state_elements=2)
        assert ds.bytes() == by_hand(2 * 1002, 2 * 334, 4 * 334, 8 * 334)
        assert 4 * 334 in [t.bytes for t in ds.terms if t.category == "transient"]
    # with real tensors, every tensor overlapping the partition keeps its whole gradient
    shape = ModelShape("t", ((0, (500,)), (0, (300,)), (0, (200,))))  # partitions [0,334) [334,668) [668,1002)
    assert [predict(shape, "deepspeed", N, "bf16", stage=2, state_elements=2, rank=r).bytes()["grads"]
            for r in range(N)] == [2 * 500, 2 * 800, 2 * 500]
    # in fp32 DeepSpeed still keeps a separate fp32 weight partition
    assert predict(shape_from_params(n), "deepspeed", N, "fp32", stage=2, state_elements=2).bytes()["master"] == 4 * 334
    # FSDP2 shards dim 0 of every tensor, padded: a (10, 7) tensor over 3 ranks -> 4 rows x 7
    shape = ModelShape("t", ((0, (10, 7)),))
    f = predict(shape, "fsdp", 3, "bf16", state_elements=2).bytes()
    assert f == by_hand(0, 4 * 28, 4 * 28, 8 * 28)
    with pytest.raises(ValueError, match="--stage"):
        predict(shape_from_params(n), "deepspeed", N, "bf16", state_elements=2)


def gpt_count_by_hand(V, T, C, L, bias):
    """wte + wpe + L blocks + final norm; the head is tied to wte (counted once)."""
    block = 12 * C * C + (13 * C if bias else 2 * C)  # qkv 3C², proj C², fc 4C², proj 4C²; biases/norms
    return V * C + T * C + L * block + (2 * C if bias else C)


@pytest.mark.parametrize("name", ["gpt_tiny", "gpt_small", "gpt2_124m"])
@pytest.mark.parametrize("bias", [True, False])
def test_meta_gpt_param_count(name, bias):
    from zerolab.models import build_model, count_params

    mcfg = load_model_config(name)
    mcfg.bias = bias
    shape = shape_from_model_config(mcfg)
    expect = gpt_count_by_hand(mcfg.vocab_size, mcfg.block_size, mcfg.n_embd, mcfg.n_layer, bias)
    assert shape.n_params == expect == count_params(build_model(mcfg, device="meta"))
    if name == "gpt2_124m" and bias:
        assert expect == 124_475_904


def test_optimizer_state_is_measured_and_matches_a_real_optimizer():
    from zerolab.config import OptimConfig
    from zerolab.memory import StorageCounter
    from zerolab.optim import build_optimizer

    shape = ModelShape("t", ((0, (16, 8)),))
    for optim in ("adamw", "adam", "lamb", "lars", "sgd", "sgd_momentum"):
        for precision, dtype in (("fp32", torch.float32), ("bf16_pure", torch.bfloat16)):
            p = torch.nn.Parameter(torch.randn(16, 8, dtype=dtype))
            opt = build_optimizer(OptimConfig(name=optim), [{"params": [p], "weight_decay": 0.0}])
            p.grad = torch.randn_like(p)
            opt.step()
            real = StorageCounter().add_optimizer(opt).bytes["optim_state"]
            assert predict(shape, "ddp", 1, precision, optim).bytes()["optim_state"] == real, (optim, precision)


def test_check_against_warns_naming_the_category(caplog):
    pred = predict(shape_from_params(1000), "ddp", 2, "fp32", state_elements=2)
    want = pred.bytes()
    fine = {f"mem/{k}_bytes": v for k, v in want.items()}
    over = dict(fine, **{"mem/grads_bytes": int(want["grads"] * 1.2)})
    with caplog.at_level(logging.WARNING, logger="zerolab.memory"):
        keys, summary = check_against([pred, pred], [fine, over])
    assert keys["rank1/mem_pred/grads_bytes"] == want["grads"]
    assert summary["measured_over_predicted"][0]["model_states"] == 1.0
    assert summary["measured_over_predicted"][1]["grads"] == pytest.approx(1.2)
    assert len(summary["warnings"]) == 1 and "grads" in summary["warnings"][0] and "rank 1" in summary["warnings"][0]
    assert "grads" in caplog.text


@pytest.mark.slow
def test_cli_7b_worked_example():
    out = run_python("-m", "zerolab", "memory", "--params", "7e9", "--world", "1", "--strategy", "ddp",
                     "--precision", "bf16", "--optim", "adamw").stdout
    assert "16.000 bytes/param = 112.00 GB" in out
    assert "= 75.0% of model states" in out
    data = json.loads(run_python("-m", "zerolab", "memory", "--params", "7e9", "--json").stdout)
    assert data["bytes"]["model_states"] == 112 * 10 ** 9 and data["state_elements_per_param"] == 2


@pytest.mark.slow
def test_cli_sweep_writes_plot(tmp_path):
    png = tmp_path / "sweep.png"
    proc = run_python("-m", "zerolab", "memory", "--model", "gpt_tiny", "--sweep-world", "1,2,4,8",
                      "--plot", str(png), "--json")
    data = json.loads(proc.stdout)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    for label in ("ddp", "zero1", "zero2", "zero3", "deepspeed-2", "fsdp"):
        values = data["total_bytes"][label]
        assert len(values) == 4
        assert all(a >= b for a, b in zip(values, values[1:])), label  # per-rank bytes never grow with N


@pytest.mark.slow
def test_cli_errors_are_clear():
    proc = run_python("-m", "zerolab", "memory", "--params", "7e9", "--strategy", "deepspeed", check=False)
    assert proc.returncode == 2 and "--stage 1, 2 or 3" in proc.stderr
    proc = run_python("-m", "zerolab", "memory", "--model", "nope", check=False)
    assert proc.returncode == 2 and "known models" in proc.stderr


PAPER_FIG1 = ["--params", "7.5e9", "--world", "64", "--precision", "fp16", "--optim", "adam"]


def test_paper_column_reproduces_figure_1(tmp_path, monkeypatch, capsys):
    """The ZeRO paper's Figure 1 (Ψ = 7.5B, N = 64, K = 12): 120 / 31.4 / 16.6 / 1.9 GB, beside the
    ledger's own figures and a reason for each difference. In-process, in an empty directory:
    without --plot no file may appear."""
    from zerolab.memory import cli_main

    monkeypatch.chdir(tmp_path)
    assert cli_main([*PAPER_FIG1, "--sweep-world", "64"]) == 0
    out = capsys.readouterr().out
    assert "K = 12 (fp32 master 4 + 2 state elements × 4)" in out
    table = out.split("why ledger and paper differ")[0]
    rows = {line.split()[0]: line.split()[-2:] for line in table.splitlines()
            if line.split() and line.split()[0] in ("ddp", "zero1", "zero2", "zero3")}
    assert rows == {"ddp": ["120.0", "120.0"], "zero1": ["31.4", "31.9"], "zero2": ["16.6", "16.9"],
                    "zero3": ["1.9", "1.9"]}  # paper, ledger
    assert "zero2        grads +234.38 MB (+2Ψ/N): zerolab's gradient shard is fp32 (4Ψ/N)" in out
    assert "zero1        grads +468.75 MB (+4Ψ/N)" in out and "ddp          same as the paper" in out
    assert list(tmp_path.iterdir()) == []  # memory_sweep.png only with --plot

    assert cli_main([*PAPER_FIG1, "--sweep-world", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {s: data["paper_bytes"][s] for s in ("ddp", "zero1", "zero2", "zero3")} == {
        "ddp": [120_000_000_000], "zero1": [31_406_250_000], "zero2": [16_640_625_000], "zero3": [1_875_000_000]}
    assert data["paper_K"] == 12 and data["paper_formula"]["zero2"] == "2Ψ+(2+K)Ψ/N"


@pytest.mark.parametrize("strategy,paper_gb,ledger_gb,deepspeed", [
    ("ddp", "120.0 GB", "120.0 GB", None), ("zero1", "31.4 GB", "31.9 GB", "16.6 GB"),
    ("zero2", "16.6 GB", "16.9 GB", "16.6 GB"), ("zero3", "1.9 GB", "1.9 GB", "1.9 GB")])
def test_paper_beside_each_strategy(capsys, strategy, paper_gb, ledger_gb, deepspeed):
    """--strategy: the paper's formula and figure, zerolab's, and DeepSpeed's at the same stage."""
    from zerolab.memory import cli_main

    assert cli_main([*PAPER_FIG1, "--strategy", strategy]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("vs the ZeRO paper"))
    assert lines[start + 1].split()[0] == "paper" and lines[start + 1].split()[-2:] == paper_gb.split()
    assert lines[start + 2].split()[:4] == [strategy, "(ledger)", *ledger_gb.split()]
    if deepspeed:
        assert lines[start + 3].split()[:4] == [f"deepspeed-{strategy[-1]}", "(ledger)", *deepspeed.split()]
    else:
        assert not lines[start + 3].strip()
    assert cli_main([*PAPER_FIG1, "--strategy", strategy, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["paper_bytes"] == {"ddp": 120 * 10 ** 9, "zero1": 31_406_250_000, "zero2": 16_640_625_000,
                                   "zero3": 1_875_000_000}[strategy]
    assert data["vs_paper"].startswith("same as the paper") == (strategy in ("ddp", "zero3"))


@pytest.mark.parametrize("precision,k_bytes", [("fp32", 8), ("bf16", 12), ("bf16_pure", 4)])
def test_paper_formula_generalised_by_precision(precision, k_bytes):
    """K = master bytes + state elements × their bytes; c = compute bytes in place of the paper's 2."""
    from zerolab.memory import paper_bytes, paper_k

    n, N = 64 * 10 ** 6, 8
    c = {"fp32": 4, "bf16": 2, "bf16_pure": 2}[precision]
    p = lambda s: predict(shape_from_params(n), s, N, precision, "adamw", bucket_mb=BIG)
    assert paper_k(p("ddp")) == k_bytes
    assert [paper_bytes(p(s)) for s in ("ddp", "zero1", "zero2", "zero3")] == [
        (2 * c + k_bytes) * n, 2 * c * n + k_bytes * n // N, c * n + (c + k_bytes) * n // N, (2 * c + k_bytes) * n // N]
