"""The planner (`python -m zerolab plan`): its arithmetic and its arguments, in-process."""
import json

import pytest

from zerolab.activations import predict_activations
from zerolab.memory import load_model_config, predict, shape_from_model_config
from zerolab.plan import Planner, cli_main, derived_gpt, parse_bytes


def test_parse_bytes_units_and_errors():
    assert parse_bytes("80GB") == 80 * 10 ** 9
    assert parse_bytes("24 GiB") == 24 * 2 ** 30
    assert parse_bytes("40960MiB") == 40 * 2 ** 30
    assert parse_bytes("1.5TB") == 1.5e12
    for bad in ("80", "eighty GB", "80XB", "0GB", ""):
        with pytest.raises(ValueError, match="e.g. 80GB|more than zero"):
            parse_bytes(bad)


def test_bad_gpu_mem_is_a_clear_error(capsys):
    assert cli_main(["--model", "gpt_small", "--gpu-mem", "80G", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-mem='80G' is not a memory size" in err and "80GB" in err
    assert cli_main(["--model", "gpt_small", "--gpu-mem", "8GB", "--seq", "4096"]) == 2
    assert "--seq=4096 must be in [1, the model's block_size=128]" in capsys.readouterr().err
    assert cli_main(["--model", "gpt_small", "--gpu-mem", "8GB", "--margin", "1.5"]) == 2
    assert "--margin=1.5" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small():
    return Planner(load_model_config("gpt_small"), world=2, seq=128, precision="fp32", device="cpu")


def test_peak_is_states_plus_activations_plus_logits_buffers(small):
    cfg, b = small.mcfg, 8
    # ddp in fp32 has no transient term of its own: the peak is the sum of the three parts.
    states = predict(shape_from_model_config(cfg), "ddp", 2, "fp32", "adamw").bytes()["total"]
    acts = predict_activations(cfg, b, 128, "fp32", "cpu").bytes
    peak, parts, phase = small.peak("ddp", b, "none")
    assert phase == "backward" and parts["activations"] == acts
    assert peak == states + acts + 8 * b * 128 * cfg.vocab_size
    # with checkpointing, one block is recomputed on top of what the forward kept
    acts_ck = predict_activations(cfg, b, 128, "fp32", "cpu", checkpointing="blocks")
    peak_ck, parts_ck, _ = small.peak("ddp", b, "blocks")
    assert parts_ck["transient"] == 8 * b * 128 * cfg.vocab_size + acts_ck.layer_bytes - b * 128 * cfg.n_embd * 4
    assert peak_ck < peak


def test_largest_micro_batch_is_the_boundary(small):
    budget = 2 * 10 ** 9
    for label in small.states:
        for ck in ("none", "blocks"):
            fit = small.fit(label, budget, ck)
            assert fit.micro_batch >= 1
            assert small.peak(label, fit.micro_batch, ck)[0] <= budget < small.peak(label, fit.micro_batch + 1, ck)[0]
        assert small.fit(label, budget, "blocks").micro_batch > small.fit(label, budget, "none").micro_batch
    nothing = small.fit("ddp", 10 ** 6, "none")  # less than the model states
    assert nothing.micro_batch == 0 and nothing.peak > 10 ** 6


def test_step_only_transients_are_told_apart():
    shape = shape_from_model_config(load_model_config("gpt_small"))
    kinds = lambda p: sorted(t.when == "step" for t in p.terms if t.category == "transient")
    assert kinds(predict(shape, "ddp", 2, "bf16", "adamw")) == [True]  # fp32 gradient copies in step()
    assert any(kinds(predict(shape, "deepspeed", 2, "bf16", "adamw", stage=2)))  # its fp32 partition in step()
    # zero2: bucket copies and reduce-scatter outputs during backward; the 16-bit all-gather
    # inputs from step() on (in fp32 the shard itself is the input: nothing in step)
    assert kinds(predict(shape, "zero2", 2, "bf16", "adamw")) == [False, False, True]
    assert not any(kinds(predict(shape, "zero2", 2, "fp32", "adamw")))


def test_derived_shape_from_a_parameter_count():
    cfg = derived_gpt(7e9, 2048)
    n = shape_from_model_config(cfg).n_params
    assert abs(n - 7e9) / 7e9 < 0.05  # width is rounded to a multiple of 128: a few % at 7B
    assert cfg.n_embd % 128 == 0 and cfg.n_embd // cfg.n_head == 128 and cfg.block_size == 2048


def test_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert cli_main(["--model", "gpt_small", "--gpu-mem", "4GiB", "--world", "2", "--precision", "fp32",
                     "--device", "cpu", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    # 8 strategies x 3 checkpointing settings, less deepspeed-3 with selective (refused)
    assert len(out["rows"]) == 23 and out["budget_bytes"] == int(4 * 2 ** 30 * 0.9)
    assert {r["strategy"] for r in out["rows"]} >= {"ddp", "zero1", "zero2", "zero3", "fsdp", "deepspeed-3"}
    assert all(r["peak_bytes"] <= out["budget_bytes"] for r in out["rows"] if r["max_micro_batch"])
    assert png.stat().st_size > 10_000
    assert cli_main(["--params", "7e9", "--gpu-mem", "80GB", "--world", "8", "--seq", "2048"]) == 0
    table = capsys.readouterr().out
    assert "deepspeed-3" in table and "budget per rank: 72.00 GB" in table


@pytest.mark.slow
def test_gpu_check_script_syntax_and_arguments():
    """bench/gpu_check.sh needs a GPU to run; here only its syntax and argument handling (--dry-run
    prints the 14 training commands: 7 strategies, checkpointing off and on, then the sync check)."""
    import subprocess

    from conftest import ROOT, base_env

    script = str(ROOT / "bench" / "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    dry = subprocess.run(["bash", script, "--dry-run", "--micro-batch", "4"], capture_output=True, text=True,
                         env=base_env(), cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    *lines, sync = dry.stdout.splitlines()
    assert len(lines) >= 14 and all("data.micro_batch=4" in line and "precision=bf16" in line for line in lines)
    assert sync.endswith("bench/sync_check.py --device cuda --out bench/RESULTS.md"), sync
    bad = subprocess.run(["bash", script, "--steps", "x"], capture_output=True, text=True, env=base_env(), cwd=ROOT)
    assert bad.returncode == 2 and "'x' is not a positive integer" in bad.stderr


def test_a_users_model_is_planned_from_its_own_activations(tmp_path, capsys):
    """model=hf overrides, as for train.py: its activations are measured on fake tensors
    (zerolab.rehearsal.activation_model), so each row's activations are what a dry run of that
    row counts, to the byte."""
    from test_models import write_configs
    from zerolab.rehearsal import rehearse

    config = write_configs(tmp_path)["llama"]
    model = ["model=hf", f"model.config={config}"]
    assert cli_main(["--gpu-mem", "30MB", "--world", "2", "--seq", "64", "--precision", "fp32", "--json", *model]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu (rehearsed)" and out["shape"]["vocab_size"] == 512
    for ck in ("none", "selective"):  # selective: the policy on the Llama's own modules (mm, CPU flash SDPA)
        row = next(r for r in out["rows"] if r["strategy"] == "zero3" and r["checkpointing"] == ck)
        assert row["max_micro_batch"] >= 1
        r = rehearse([*model, "model.block_size=64", "strategy=zero3", "precision=fp32",
                      f"data.micro_batch={row['max_micro_batch']}", f"model.activation_checkpointing={ck}"], world=2)
        assert row["bytes"]["activations"] == r.measured["mem/activations_bytes"], ck


@pytest.mark.slow  # in process, but fourteen rehearsals (10 s): the slow tier's
def test_exact_rehearses_every_row_within_the_budget(capsys):
    """--exact: every row a rehearsal can run is rehearsed at its micro-batch; the micro-batch it
    confirms (the plan's, or the largest below whose rehearsed peak fits) is within the budget."""
    assert cli_main(["--model", "gpt_tiny", "--gpu-mem", "40MB", "--world", "2", "--precision", "fp32", "--device",
                     "cpu", "--exact", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rehearsed = [r for r in out["rows"] if not r["not_rehearsed"]]
    assert {r["strategy"] for r in rehearsed} >= {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    assert all("DeepSpeed" in r["not_rehearsed"] for r in out["rows"] if r["strategy"].startswith("deepspeed"))
    for r in rehearsed:
        assert r["rehearsed_micro_batch"] <= r["max_micro_batch"], r
        assert r["rehearsed_peak_bytes"] <= out["budget_bytes"], r


def test_the_model_must_be_named(capsys):
    assert cli_main(["--gpu-mem", "8GB", "strategy=zero2"]) == 2
    assert "name the model" in capsys.readouterr().err
