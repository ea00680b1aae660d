"""`python -m zerolab compare` on real run directories: tables, figures, and a parity check that
catches a deliberately altered weight."""
import shutil

import pytest

from conftest import run_python, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

COMMON = ["model=gpt_tiny", "model.bias=false", "trainer.max_steps=6", "trainer.eval_every=3", "data.micro_batch=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    run_train(base / "ddp", 2, *COMMON, "strategy=ddp")
    run_train(base / "torch_zero", 2, *COMMON, "strategy=torch_zero")
    return base


def test_report_tables_figures_and_parity(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    # A copy of a good run whose weights were altered after training: one element off by 1 %.
    tampered = tmp_path / "tampered"
    shutil.copytree(runs / "torch_zero", tampered)
    w = load_file(str(tampered / "model.safetensors"))
    w["blocks.0.attn.qkv.weight"][0, 0] *= 1.01
    save_file(w, str(tampered / "model.safetensors"))

    out = tmp_path / "report"
    proc = run_python("-m", "zerolab", "compare", str(runs / "ddp"), str(runs / "torch_zero"), str(tampered),
                      "--out", str(out), "--wandb", "disabled")
    md = (out / "report.md").read_text()
    for png in ("loss", "loss_diff", "memory", "step_time", "comm"):
        assert (out / f"{png}.png").stat().st_size > 1000, png
        assert f"{png}.png" in proc.stdout and f"({png}.png)" in md
    parity = md.split("## Parity")[1].split("## ")[0]
    # Two runs with the same settings are told apart by their directory names.
    rows = {line.split("|")[1].strip(): line for line in parity.splitlines() if line.startswith("| ")}
    assert "**match**" in rows["torch_zero (torch_zero)"]
    bad = rows["torch_zero (tampered)"]
    assert "**MISMATCH**" in bad and "blocks.0.attn.qkv.weight" in bad
    assert "MISMATCH" in proc.stderr
    # The comm column compares with 2Ψ(N−1)/N: ddp's all-reduce is exactly the theory.
    ddp_row = [line for line in proc.stdout.splitlines() if line.startswith("| ddp ")][0]
    measured, theory = ddp_row.split("|")[10].replace("(", "").replace(")", "").split()
    assert measured == theory

    strict = run_python("-m", "zerolab", "compare", str(runs / "ddp"), str(tampered), "--out", str(tmp_path / "r2"),
                        "--wandb", "disabled", "--fail-on-mismatch", check=False)
    assert strict.returncode == 1


def test_compare_without_runs_is_a_clear_error(tmp_path):
    proc = run_python("-m", "zerolab", "compare", str(tmp_path), "--out", str(tmp_path / "r"), check=False)
    assert proc.returncode == 2 and "no run directories" in proc.stderr
