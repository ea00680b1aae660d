"""What a new user trips on, in one process (fast tier): a refusal names the fix that works under
model=hf (the transformers config's vocab_size), export reads a finished run's directory without
checkpoints and says what a path lacks, and a run says which modules it took as the repeated
blocks and how. The same from the command line, as the README writes it: tests/test_first_use_runs.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from zerolab.config import ConfigError, compose

import transformers  # noqa: F401  (pinned in pyproject.toml: a broken install fails, it does not skip)

TINY = dict(vocab_size=512, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (untied head, 2 layers) and GPT-2 (tied head), vocabulary 512."""
    from transformers import GPT2Config, LlamaConfig

    d = tmp_path_factory.mktemp("configs")
    made = {"llama": LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False, **TINY),
            "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128, bos_token_id=1,
                               eos_token_id=2)}
    for name, c in made.items():
        c.to_json_file(str(d / f"{name}.json"))
    return {name: d / f"{name}.json" for name in made}


@pytest.fixture
def single_process(monkeypatch):
    """No launcher in the environment: zerolab.job.run makes a one-process gloo group itself."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def token_file(path: Path, top: int) -> Path:
    """A headerless uint16 token file (no sidecar) whose largest token is `top`."""
    np.concatenate([np.arange(top + 1), np.zeros(4000)]).astype(np.uint16).tofile(path)
    return path


# ---- 1: the vocabulary refusal names the fix that works --------------------------------------------
def test_hf_vocabulary_refusal_names_the_configs_vocab_size(configs, tmp_path, single_process):
    """A Llama of 512 tokens on a file holding token 999: the job refuses it before the run
    directory is touched, naming the config's vocab_size, the only key that gives a model=hf model
    more rows (setting model.vocab_size under model=hf is itself refused)."""
    from zerolab.job import run

    tokens = token_file(tmp_path / "tokens.bin", 999)
    cfg = compose(["model=hf", f"model.config={configs['llama']}", f"data.path={tokens}", "strategy=ddp",
                   f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as err:
        run(cfg)
    said = str(err.value)
    assert "holds token 999" in said and f'"vocab_size": 1000 or more in {configs["llama"]}' in said, said
    assert "model.vocab_size=" not in said.replace("model.vocab_size cannot", ""), said
    assert not (tmp_path / "run").exists()
    # What it names works: a config with that vocabulary trains on the file (its check passes).
    bigger = json.loads(configs["llama"].read_text()) | {"vocab_size": 1000}
    (tmp_path / "bigger.json").write_text(json.dumps(bigger))
    from zerolab.data import check_data
    from zerolab.job import model_preflight

    ok = compose(["model=hf", f"model.config={tmp_path / 'bigger.json'}", f"data.path={tokens}"])
    model_preflight(ok)
    check_data(ok.data, ok.model.block_size, ok.model.vocab_size)
    # ... and what it does not name is refused, naming the config's key too.
    with pytest.raises(ConfigError, match=r'leave model.vocab_size unset .*set "vocab_size" in'):
        model_preflight(compose(["model=hf", f"model.config={configs['llama']}", "model.vocab_size=1000"]))


def test_vocab_fix_names_the_key_of_each_model_source(configs):
    from zerolab.job import model_preflight
    from zerolab.models.sources import vocab_fix

    for spec in (configs["gpt2"], configs["gpt2"].parent / "saved"):
        if spec.suffix != ".json":  # a saved model's directory: its config.json is the one to edit
            spec.mkdir(exist_ok=True)
            (spec / "config.json").write_text(configs["gpt2"].read_text())
        cfg = compose(["model=hf", f"model.config={spec}"])
        model_preflight(cfg)
        fix = vocab_fix(cfg.model)(600)
        path = spec if spec.suffix == ".json" else spec / "config.json"
        assert f'set "vocab_size": 600 or more in {path},' in fix and "at most 512" in fix, fix
    # zerolab's own models and model=custom: model.vocab_size is the key, the data check's own advice
    assert vocab_fix(compose([]).model) is None


# ---- 2: export a finished run without checkpoints ----------------------------------------------------
def finished_run(d: Path, config: Path) -> dict:
    """A model=hf run directory as a finished run leaves it: model.safetensors (every state-dict key,
    a tied head under both names), config.json, summary.json; no checkpoints."""
    from safetensors.torch import save_file

    from zerolab.job import model_preflight
    from zerolab.models import build_model
    from zerolab.models.sources import hf_config_json

    cfg = compose(["model=hf", f"model.config={config}"])
    model_preflight(cfg)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in build_model(cfg.model).state_dict().items()}
    d.mkdir(parents=True)
    save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(hf_config_json(cfg.model)))
    (d / "summary.json").write_text(json.dumps({"steps": 7}))
    return state


def test_a_run_directory_exports_for_from_pretrained_without_checkpoints(configs, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from zerolab.checkpoint.export import export_main

    run = tmp_path / "runs" / "default" / "RUN"
    state = finished_run(run, configs["gpt2"])
    out = tmp_path / "my_model"
    assert export_main([str(run), "--format", "hf", "--out", str(out)]) == 0
    assert "the final weights of" in capsys.readouterr().out
    written = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in written and "transformer.wte.weight" in written  # tied: once, as save_pretrained
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # bf16: config.json says so; the plain format keeps every key, as the run wrote them
    assert export_main([str(run), "--format", "hf", "--out", str(tmp_path / "b"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
    assert export_main([str(run / "model.safetensors"), "--out", str(tmp_path / "w.safetensors")]) == 0
    plain = load_file(str(tmp_path / "w.safetensors"))
    assert plain.keys() == state.keys() and all(torch.equal(plain[k], state[k]) for k in state)


def test_export_says_what_a_path_lacks_and_how_to_get_it(configs, tmp_path, capsys):
    from zerolab.checkpoint.export import export_main

    run = tmp_path / "RUN"
    finished_run(run, configs["gpt2"])
    cases = {  # path -> what the message must say
        run / "checkpoints": [f"{run / 'checkpoints'} does not exist", "checkpoint.every=N",
                              f"export the run directory instead (python -m zerolab export {run} "],
        tmp_path / "nowhere": ["no such file or directory", "a finished run's directory", "checkpoint.every=N"],
    }
    (tmp_path / "empty").mkdir()
    cases[tmp_path / "empty"] = ["holds no checkpoint", "no final weights (model.safetensors", "checkpoint.every=N"]
    (tmp_path / "bare" / "checkpoints").mkdir(parents=True)
    cases[tmp_path / "bare" / "checkpoints"] = ["holds no checkpoint", "wrote no checkpoints",
                                                "it has no final weights"]
    for path, said in cases.items():
        assert export_main([str(path), "--out", str(tmp_path / "x.safetensors")]) == 1
        err = capsys.readouterr().err
        assert all(s in err for s in said), (path, err)
    assert export_main([str(run), "--as-checkpoint", "--out", str(tmp_path / "ck")]) == 1
    assert "is a run's final weights" in capsys.readouterr().err


def test_hf_export_of_a_run_that_is_not_hf_says_so(tmp_path, capsys):
    from safetensors.torch import save_file

    from zerolab.checkpoint.export import export_main

    run = tmp_path / "gpt_run"
    run.mkdir()
    save_file({"w": torch.zeros(2)}, str(run / "model.safetensors"))
    assert export_main([str(run), "--format", "hf", "--out", str(tmp_path / "o")]) == 1
    assert "holds no config.json" in capsys.readouterr().err


# ---- 5: which modules are the repeated blocks, and how that was decided -------------------------------
def test_blocks_are_described_with_how_they_were_found(configs):
    from zerolab.job import model_preflight
    from zerolab.models import build_model
    from zerolab.models.blocks_report import blocks_line, describe_blocks

    def described(*overrides):
        cfg = compose(list(overrides))
        model_preflight(cfg)
        return describe_blocks(build_model(cfg.model, device="meta"), cfg.model.blocks)

    llama = described("model=hf", f"model.config={configs['llama']}")
    assert llama == {"path": "model.layers", "count": 2, "class": "LlamaDecoderLayer",
                     "found_by": "longest same-class nn.ModuleList"}
    assert blocks_line(llama).startswith("repeated blocks: model.layers, 2 × LlamaDecoderLayer (the longest")
    named = described("model=hf", f"model.config={configs['gpt2']}", "model.blocks=transformer.h")
    assert named["path"] == "transformer.h" and named["found_by"] == "model.blocks"
    assert "named by model.blocks" in blocks_line(named)
    assert described()["path"] == "blocks" and described()["class"] == "Block"  # zerolab's GPT
    none = described("model=mlp")
    assert none["found_by"] == "none" and none["count"] == 0 and "one unit" in blocks_line(none)


def test_blocks_keep_their_class_under_fsdp2(configs, one_rank):
    """fully_shard turns each block into an FSDP<class>; the report names the model's own class."""
    from torch.distributed.fsdp import fully_shard

    from zerolab.job import model_preflight
    from zerolab.models import build_model
    from zerolab.models.blocks_report import describe_blocks

    cfg = compose(["model=hf", f"model.config={configs['llama']}"])
    model_preflight(cfg)
    model = build_model(cfg.model)
    for layer in model.model.layers:
        fully_shard(layer)
    assert type(model.model.layers[0]).__name__ == "FSDPLlamaDecoderLayer"
    assert describe_blocks(model)["class"] == "LlamaDecoderLayer"


# ---- 3: what the pages promise about exit codes ----------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
EXIT_2 = re.compile(r"\bexit(?:s| code| with code)? 2\b|\bexits with code 2\b")
PAGES = ["docs/models.md", "docs/data.md", "docs/compare.md", "docs/launch.md"]


def test_every_page_that_promises_exit_2_says_what_bare_torchrun_shows():
    """Under bare torchrun (the README's first command) the command exits 1 with torchrun's block
    after zerolab's paragraph: a page that promises exit 2 says so, or links to where it is said."""
    launch = (ROOT / "docs" / "launch.md").read_text()
    assert "\n### Exit codes under torchrun\n" in launch and "ChildFailedError" in launch
    for page in PAGES:
        text = (ROOT / page).read_text()
        if EXIT_2.search(text) and page != "docs/launch.md":
            assert "launch.md#exit-codes-under-torchrun" in text, f"{page} promises exit 2 and says nothing of torchrun"


# ---- 6: the default job's tables show what the ledger predicts ------------------------------------------
def default_job_rows(page: Path) -> dict[str, float]:
    """strategy -> model states per rank (MiB, the last column) of the page's default-job table."""
    text = page.read_text()
    block = text[text.index("| strategy | run 1 | run 2 | verdict (both) | model states per rank"):]
    rows = {}
    for line in block.splitlines()[2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = float(cells[-1])
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/compare.md"])
def test_the_default_jobs_table_shows_the_ledgers_model_states(page):
    """The model states a page gives for each strategy of `make run` (gpt_mid, 2 ranks, fp32, AdamW)
    are the ledger's prediction, which every run measures to the byte."""
    from zerolab.memory.ledger import ledger_for_run

    rows = default_job_rows(ROOT / page)
    assert len(rows) == 7, rows
    for name, mib in rows.items():
        strategy, *stage = name.split(" stage ")
        cfg = compose(["model=gpt_mid", f"strategy={strategy}", *[f"strategy.stage={s}" for s in stage]])
        pred = ledger_for_run(cfg, 2)[0].bytes()
        states = sum(pred[c] for c in ("params", "grads", "master", "optim_state"))
        assert round(states / 2**20, 2) == mib, (page, name, states / 2**20, mib)


# ---- 5, said: a run and a dry run say which blocks they took ---------------------------------------------
def test_a_run_and_a_dry_run_say_which_blocks_they_took(configs, one_rank, tmp_path, caplog):
    """Once at the start on rank 0 and in summary.json's "blocks"; a dry run prints the same line."""
    import logging

    from conftest import fixed_corpus
    from zerolab.job import model_preflight
    from zerolab.models.blocks_report import blocks_line
    from zerolab.trainer import Trainer

    run = tmp_path / "run"
    cfg = compose(["model=hf", f"model.config={configs['llama']}", "trainer.max_steps=1", "trainer.eval_every=0",
                   "trainer.eval_batches=1", "data.micro_batch=1", "logging.progress=false",
                   f"data.path={fixed_corpus()}", f"run.dir={run}"])
    model_preflight(cfg)
    with caplog.at_level(logging.INFO, logger="zerolab"):
        trainer = Trainer(cfg, one_rank)
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
    said = {"path": "model.layers", "count": 2, "class": "LlamaDecoderLayer",
            "found_by": "longest same-class nn.ModuleList"}
    assert summary["blocks"] == said and json.loads((run / "summary.json").read_text())["blocks"] == said
    assert caplog.text.count(blocks_line(said)) == 1, caplog.text[-2000:]


def test_a_dry_run_says_which_blocks_it_took():
    from zerolab.rehearsal import format_rehearsal, rehearse

    for strategy in ("zero3", "deepspeed"):  # rehearsed, and predicted only (DeepSpeed runs on no fake tensors)
        shown = format_rehearsal(rehearse(["model=gpt_tiny", f"strategy={strategy}"], world=4))
        assert "repeated blocks: blocks, 2 × Block (the longest nn.ModuleList" in shown, shown
