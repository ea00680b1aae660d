"""What a new user runs first, as real processes: the README's "Your model" commands in order,
exactly as written there (train under bare torchrun, train a module of one's own, export the
run, load it with from_pretrained), and a refusal under bare torchrun, whose exit code torchrun
replaces with its own: zerolab's paragraph still reaches the foot of torchrun's failure block.
The same logic in one process: tests/test_first_use.py."""
from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TORCHRUN, base_env, run_process

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

# The README's placeholders, made real at the paths it names (relative to a working directory that
# holds the repository's .venv, train.py and conf/ as links): a transformers config, a module of
# one's own under ~/my_code, and RUN, the directory the first command's run chose.
MY_LM = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

        def forward(self, x):
            return x + torch.tanh(self.mlp(self.norm(x)))


    class TinyLM(nn.Module):
        def __init__(self, vocab=512, dim=32, layers=2):
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


def readme_commands(section: str) -> list[str]:
    """The shell lines of the first bash block under the README heading `section`, comments cut."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.fixture
def workdir(tmp_path) -> Path:
    from transformers import GPT2Config

    for name in (".venv", "train.py", "conf"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "path" / "to").mkdir(parents=True)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128, bos_token_id=1, eos_token_id=2)
    config.to_json_file(str(tmp_path / "path" / "to" / "config.json"))  # tied head: export writes it once
    (tmp_path / "home" / "my_code").mkdir(parents=True)
    (tmp_path / "home" / "my_code" / "my_lm.py").write_text(MY_LM)
    return tmp_path


def test_the_readme_your_model_commands_work_as_written(workdir):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    commands = readme_commands("Your model")
    assert [c.split()[0] for c in commands] == [".venv/bin/torchrun", "PYTHONPATH=~/my_code", ".venv/bin/python"], \
        commands  # what this test makes real; a new command needs its placeholders here
    env = base_env(HOME=str(workdir / "home"))
    runs = workdir / "runs" / "default"
    made: list[Path] = []
    for command in commands:
        before = set(runs.iterdir()) if runs.exists() else set()
        if "runs/default/RUN" in command:  # RUN: the directory the first command's run chose
            command = command.replace("runs/default/RUN", str(made[0].relative_to(workdir)))
        proc = run_process(["bash", "-c", command], timeout=400, env=env, cwd=workdir)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        made += sorted(set(runs.iterdir()) - before) if runs.exists() else []
    hf_run, custom_run = made
    assert (hf_run / "config.json").exists() and (custom_run / "model.safetensors").exists()
    assert not (hf_run / "checkpoints").exists()  # the export needed none
    model, info = AutoModelForCausalLM.from_pretrained(workdir / "my_model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained = load_file(str(hf_run / "model.safetensors"))
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.transformer.wte.weight


def torchrun_refusal(tmp_path: Path, *overrides: str) -> tuple[str, str]:
    """A refusal under bare torchrun (the README's first command's launcher): torchrun's exit code
    (1 for any failed worker) and what it printed; returns (zerolab's lines, torchrun's root cause)."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), f"run.dir={tmp_path / 'run'}",
           *overrides]
    proc = run_process(cmd, timeout=300)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-4000:])  # torchrun's, whatever the workers said
    said = [line for line in proc.stderr.splitlines() if line.startswith("zerolab: configuration error:")]
    root = proc.stderr.split("Root Cause (first observed failure):", 1)[-1]
    return "\n".join(said), root


def test_a_refusal_reaches_the_foot_of_torchruns_block(tmp_path):
    """Before the ranks meet (an unknown key) and after (a token the model's vocabulary lacks, found
    by the data check on every rank): rank 0 prints the paragraph once, exits 2, and torchrun's
    Root Cause shows that code and that paragraph instead of "To enable traceback see ..."."""
    said, root = torchrun_refusal(tmp_path, "model.vocab_sise=3")
    assert said.count("\n") == 0 and "did you mean model.vocab_size?" in said, said
    body = said.removeprefix("zerolab: configuration error: ")
    assert re.search(r"exitcode\s*: 2 ", root) and f"traceback : zerolab exited 2: {body}" in root, root
    tokens = tmp_path / "tokens.bin"
    np.concatenate([np.arange(301), np.zeros(4000)]).astype(np.uint16).tofile(tokens)
    said, root = torchrun_refusal(tmp_path, "model=gpt_tiny", f"data.path={tokens}")
    assert said.count("\n") == 0 and "holds token 300" in said, said
    assert re.search(r"exitcode\s*: 2 ", root) and "traceback : zerolab exited 2: token file" in root, root
    assert not os.path.exists(tmp_path / "run")


def test_what_the_report_directory_holds_is_what_docs_compare_lists(tmp_path):
    """The report's directory with wandb on (offline, as `logging.wandb.mode=auto` is without an API
    key): every entry is one docs/compare.md names in its row for the report directory."""
    import sys

    from test_report_reading import write_sweep

    sweep = write_sweep(tmp_path / "sweep", {"ddp": [100, 100], "zero3": [130, 130]}, {})
    out = tmp_path / "report"
    proc = run_process([sys.executable, "-m", "zerolab", "compare", str(sweep), "--out", str(out),
                        "--wandb", "offline"], timeout=300, env=base_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    docs = (ROOT / "docs" / "compare.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `.../report/` |"))
    listed = set(re.findall(r"`([\w.-]+/?)`", row)) | {"report.md", "report.json"}
    found = {p.name + ("/" if p.is_dir() else "") for p in out.iterdir()}
    pngs = {n for n in found if n.endswith(".png")}
    assert "wandb/" in found and pngs  # what the test is about: wandb wrote here
    assert all(f"`{n}`" in docs for n in pngs), pngs  # every figure is described on the page
    assert found - pngs <= listed, (found - pngs - listed, row)
