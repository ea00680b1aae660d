"""Your data, end to end (real processes): a BPE tokenizer.json of vocabulary 1000 built here from
local text, `python -m zerolab data prepare --tokenizer` with it, a vocabulary-1000 model training
on the file under zero2 at 2 ranks, the same file refused for a vocabulary-512 model; a
nanoGPT-style directory (train.bin/val.bin, uint16, no header) training at 2 ranks, and refused,
naming train.bin, once one of its tokens is 600 for a vocabulary of 512. Refusals exit 2 with one
message and no traceback, before any rank trains."""
import json
import math
import shutil

import numpy as np
import pytest

from conftest import ROOT, generated_corpus_bytes, read_metrics, run_python, run_train

pytestmark = pytest.mark.slow

TINY = ("model=gpt_tiny", "trainer.max_steps=3", "trainer.eval_every=0", "data.micro_batch=4",
        "logging.wandb.mode=disabled", "logging.progress=false")


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    """zerolab's own docs and sources, tokenized by a byte-level BPE of 1000 trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("bpe")
    sources = [str(p) for p in sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "zerolab").rglob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(sources, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == 1000
    tok.save(str(tmp / "tokenizer.json"))
    out = tmp / "corpus.bin"
    proc = run_python("-m", "zerolab", "data", "prepare", "--src", str(ROOT / "docs"), str(ROOT / "zerolab"),
                      "--tokenizer", str(tmp / "tokenizer.json"), "--out", str(out), "--workers", "2")
    assert "vocabulary 1000" in proc.stdout, proc.stdout
    return out


def refusal(proc, *expected: str) -> str:
    """The exit code is 2, the message is said once, and no traceback is printed."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if expected[0] in ln]
    assert len(lines) == 1, out[-4000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_bpe_1000_trains_under_zero2_at_2_ranks(tmp_path, bpe_file):
    meta = json.loads((bpe_file.parent / "corpus.bin.json").read_text())
    assert (meta["dtype"], meta["vocab_size"]) == ("uint16", 1000)
    assert meta["max_token"] >= 512  # so that the vocabulary-512 refusal below is about real tokens
    run_train(tmp_path / "run", 2, *TINY, "model.vocab_size=1000", "strategy=zero2", f"data.path={bpe_file}")
    steps = [m for m in read_metrics(tmp_path / "run") if "loss" in m and "step" in m]
    assert [m["step"] for m in steps][-1] == 3 and all(math.isfinite(m["loss"]) for m in steps)
    assert steps[0]["global_batch"] == 8  # data.micro_batch=4 on each of 2 ranks


def test_bpe_file_with_a_vocab_512_model_exits_2(tmp_path, bpe_file):
    proc = run_python("train.py", f"run.dir={tmp_path / 'run'}", *TINY, "model.vocab_size=512",
                      f"data.path={bpe_file}", check=False)
    refusal(proc, "not below model.vocab_size=512", str(bpe_file), "its tokenizer's vocabulary is 1000",
            "model.vocab_size=1000 or more")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def nanogpt_dir(tmp_path_factory):
    """The tests' generated corpus, byte-level, as nanoGPT writes it: train.bin and val.bin of
    uint16 ids, no header, no sidecar (95 % / 5 %)."""
    d = tmp_path_factory.mktemp("nanogpt")
    tokens = np.frombuffer(generated_corpus_bytes(), dtype=np.uint8).astype(np.uint16)
    cut = len(tokens) * 95 // 100
    tokens[:cut].tofile(d / "train.bin")
    tokens[cut:].tofile(d / "val.bin")
    return d


def test_nanogpt_dir_trains_at_2_ranks(tmp_path, nanogpt_dir):
    run_train(tmp_path / "run", 2, *TINY, f"data.path={nanogpt_dir}")
    steps = [m for m in read_metrics(tmp_path / "run") if "loss" in m and "step" in m]
    assert [m["step"] for m in steps][-1] == 3 and all(math.isfinite(m["loss"]) for m in steps)
    assert steps[0]["global_batch"] == 8  # data.micro_batch=4 on each of 2 ranks


def test_token_600_in_train_bin_with_vocab_512_exits_2(tmp_path, nanogpt_dir):
    bad = tmp_path / "bad"
    shutil.copytree(nanogpt_dir, bad)
    tokens = np.memmap(bad / "train.bin", dtype=np.uint16, mode="r+")
    tokens[len(tokens) // 2] = 600
    tokens.flush()
    del tokens
    expected = (f"token file {bad}/train.bin holds token 600", "not below model.vocab_size=512",
                "model.vocab_size=601 or more")
    proc = run_python("train.py", f"run.dir={tmp_path / 'run'}", *TINY, "model.vocab_size=512",
                      f"data.path={bad}", check=False)
    refusal(proc, *expected)
    # The launch scripts' first step (launch/run_dir.py) refuses it too, before any rank starts.
    proc = run_python("launch/run_dir.py", f"run.dir={tmp_path / 'run'}", *TINY, "model.vocab_size=512",
                      f"data.path={bad}", check=False)
    refusal(proc, *expected)
    assert not (tmp_path / "run").exists()
