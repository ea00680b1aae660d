"""Tokenized data, in-process: the sidecar, uint16 vs uint32, streaming and parallel prepare (the
same tokens as encoding each file whole, whatever the workers), the vocabulary check (from the
sidecar, or one scan), nanoGPT's train.bin/val.bin layout, and the sampler's exact-resume
guarantees on every layout. Every tokenizer here is built in the test from local text: nothing
is downloaded."""
import hashlib
import json

import numpy as np
import pytest

from conftest import ROOT, base_env, generated_corpus_bytes, run_process
from zerolab.config import ConfigError, DataConfig, compose
from zerolab.data import (TokenData, WindowSampler, check_data, check_token_file, dtype_for_vocab, prepare,
                          prepare_tokens, read_sidecar, scan_max, write_sidecar)
from zerolab.data.cli import cli_main

EOT = "<|endoftext|>"


def text_files(tmp_path, n_files=3, size=200_000):
    """Local text: slices of the tests' generated corpus (sentences, spaces, newlines)."""
    corpus = generated_corpus_bytes()
    files = []
    for i in range(n_files):
        path = tmp_path / "src" / f"part{i}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(corpus[i * size:(i + 1) * size])
        files.append(path)
    return files


def byte_level_bpe(path, vocab_size, files):
    """A byte-level BPE (GPT-2's pre-tokenizer) trained here with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    assert tok.get_vocab_size() == vocab_size  # the corpus has pairs enough to merge
    tok.save(str(path))
    return tok


def word_level(path, n_words):
    """A tokenizer with `n_words` ids, word i written `w{i}`: any vocabulary size, exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return tok


# ---- the sidecar --------------------------------------------------------------------------------
def test_prepare_writes_a_sidecar_that_describes_the_file(tmp_path):
    files = text_files(tmp_path, n_files=2, size=50_000)
    byte_level_bpe(tmp_path / "tok.json", 300, files)
    out = tmp_path / "out" / "corpus.bin"
    done = prepare_tokens([str(tmp_path / "src")], str(out), tokenizer=str(tmp_path / "tok.json"))
    tokens = np.fromfile(out, dtype=np.uint16)
    meta = json.loads((tmp_path / "out" / "corpus.bin.json").read_text())
    assert meta == read_sidecar(str(out))
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    assert meta["tokens"] == len(tokens) == done.tokens and meta["max_token"] == int(tokens.max())
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((tmp_path / "tok.json").read_bytes()).hexdigest()
    assert meta["tokenizer"]["eot"] == 0  # BpeTrainer puts the special tokens first
    assert meta["sources"] == [str(tmp_path / "src")] and meta["files"] == 2
    assert meta["bytes"] == 100_000


def test_byte_level_prepare_stays_byte_level_with_a_sidecar(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 3)
    out = tmp_path / "bytes.bin"
    assert prepare([str(tmp_path / "a.txt")], str(out), max_bytes=700) == 700
    assert np.fromfile(out, dtype=np.uint16).tolist() == (list(range(256)) * 3)[:700]  # token = byte
    meta = read_sidecar(str(out))
    assert (meta["dtype"], meta["vocab_size"], meta["max_token"], meta["tokenizer"]) == \
        ("uint16", 256, 255, {"kind": "bytes"})


def test_a_minimal_or_broken_sidecar(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint32).tofile(path)
    write_sidecar(str(path), {"dtype": "uint32"})  # what a user writes by hand for a uint32 file
    data = TokenData(str(path), 15, 0.1)
    assert data.tokens.dtype == np.uint32 and data.tokens[-1] == 999
    (tmp_path / "t.bin.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"sidecar .*t.bin.json of token file .* is not readable JSON"):
        TokenData(str(path), 15, 0.1)
    (tmp_path / "t.bin.json").write_text('{"dtype": "int8"}')
    with pytest.raises(ConfigError, match="says dtype 'int8'; token files are uint16 or uint32"):
        TokenData(str(path), 15, 0.1)
    write_sidecar(str(path), {"dtype": "uint32", "tokens": 999})  # a sidecar left beside another file
    with pytest.raises(ConfigError, match=r"holds 1000 uint32 tokens \(4000 bytes\) but its sidecar .* says 999"):
        TokenData(str(path), 15, 0.1)


# ---- uint16 or uint32 ---------------------------------------------------------------------------
def test_dtype_for_vocab_at_the_16_bit_edge():
    # ids run 0 .. vocab-1: uint16 holds ids up to 65535, so a vocabulary of 65536 still fits
    assert [dtype_for_vocab(v) for v in (256, 50257, 65536, 65537, 128256)] == \
        ["uint16", "uint16", "uint16", "uint32", "uint32"]


@pytest.mark.parametrize("n_words, dtype", [(65536, np.uint16), (70000, np.uint32)])
def test_a_vocabulary_past_65536_writes_uint32(tmp_path, n_words, dtype):
    word_level(tmp_path / "tok.json", n_words)
    ids = [0, 1, 65535, n_words - 1, 12345] * 40
    (tmp_path / "a.txt").write_text(" ".join(f"w{i}" for i in ids))
    out = tmp_path / "c.bin"
    prepare_tokens([str(tmp_path / "a.txt")], str(out), tokenizer=str(tmp_path / "tok.json"))
    assert read_sidecar(str(out))["dtype"] == np.dtype(dtype).name
    assert out.stat().st_size == len(ids) * np.dtype(dtype).itemsize  # no end-of-text token: it has none
    data = TokenData(str(out), 4, 0.05)
    assert data.tokens.dtype == dtype and data.tokens.tolist() == ids  # 69999 read back whole
    check_token_file(str(out), 4, 0.05, vocab_size=n_words)
    with pytest.raises(ConfigError, match=f"holds token {n_words - 1} .* model.vocab_size={n_words - 1}"):
        check_token_file(str(out), 4, 0.05, vocab_size=n_words - 1)


def test_preparing_again_replaces_file_and_sidecar_together(tmp_path):
    word_level(tmp_path / "wide.json", 70000)
    (tmp_path / "a.txt").write_text("w69999 w1 " * 100)
    out = tmp_path / "c.bin"
    prepare_tokens([str(tmp_path / "a.txt")], str(out), tokenizer=str(tmp_path / "wide.json"))
    assert read_sidecar(str(out))["dtype"] == "uint32"
    prepare([str(tmp_path / "a.txt")], str(out))  # byte-level over it: uint16 now
    assert read_sidecar(str(out))["dtype"] == "uint16"
    assert TokenData(str(out), 4, 0.05).tokens.tolist() == list((tmp_path / "a.txt").read_bytes())


# ---- streaming and parallel ---------------------------------------------------------------------
def test_chunked_parallel_prepare_equals_encoding_each_file_whole(tmp_path):
    """Files cut into 4 KiB pieces, encoded by 1 or 3 threads: the tokens of encoding each file
    whole, then end-of-text; and the text in flight stays a few pieces, not the corpus."""
    files = text_files(tmp_path, n_files=3, size=200_000)
    tok = byte_level_bpe(tmp_path / "tok.json", 400, files)
    expect = []
    for f in files:
        expect += tok.encode(f.read_text(), add_special_tokens=False).ids + [tok.token_to_id(EOT)]
    chunk = 4096
    outs = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}.bin"
        done = prepare_tokens([str(f) for f in files], str(out), tokenizer=str(tmp_path / "tok.json"),
                              workers=workers, chunk_bytes=chunk)
        outs[workers] = out.read_bytes()
        assert np.fromfile(out, dtype=np.uint16).tolist() == expect
        # At most 2·workers tasks are in flight, each under 3 pieces' worth (a task closes once it
        # reaches a piece, and a piece of these short lines is under 2 chunks): by construction.
        bound = 2 * workers * 3 * chunk
        assert done.max_pending_bytes <= bound < sum(f.stat().st_size for f in files) / 5
    assert outs[1] == outs[3]


def test_prepare_cli_refuses_in_zerolab_words(tmp_path, capsys):
    assert cli_main(["prepare", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o.bin")]) == 2
    assert "data source" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("some text " * 50)
    assert cli_main(["prepare", "--src", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o.bin"),
                     "--tokenizer", str(tmp_path / "missing.json")]) == 2
    assert "tokenizer" in capsys.readouterr().err and not (tmp_path / "o.bin").exists()


def test_a_killed_prepares_temporary_files_are_removed_by_the_next_and_said(tmp_path, capsys):
    """Temporary files of the token file, its sidecar and a trained tokenizer, named for a pid no
    process can have (above Linux's pid_max, 2^22): the next prepare of that output removes each and
    says so. A live process's (pid 1's), one whose lock a live writer holds (a prepare on another
    machine of a shared filesystem), and another output's are left alone."""
    import fcntl
    import os

    (tmp_path / "a.txt").write_text("some text " * 50)
    dead = 2**22 + 1
    stale = [tmp_path / f"o.bin.tmp.{dead}", tmp_path / f"o.bin.json.tmp.{dead}",
             tmp_path / f"o.tokenizer.json.tmp.{dead}"]
    kept = [tmp_path / "o.bin.tmp.1", tmp_path / f"o.bin.tmp.{dead + 1}", tmp_path / f"p.bin.tmp.{dead}"]
    for path in stale + kept:
        path.write_bytes(b"\0" * 300_000)
    with open(kept[1]) as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a live writer holds its file (zerolab.data.stale.hold)
        assert cli_main(["prepare", "--src", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o.bin")]) == 0
    said = capsys.readouterr().out
    for path in stale:
        assert not path.exists()
        assert (f"removed {path} (0.3 MB), the temporary file of an earlier prepare (pid {dead}) that was killed "
                "before it finished") in said, said
    assert all(path.exists() for path in kept) and said.count("removed ") == 3, said
    assert sorted(os.listdir(tmp_path)) == sorted(["a.txt", "o.bin", "o.bin.json", *(p.name for p in kept)])


@pytest.mark.slow
def test_a_prepare_killed_while_it_writes_leaves_nothing_after_the_next(tmp_path):
    """A real prepare, SIGKILLed while its token file is being written (it reads a FIFO source: once
    the test's open of the FIFO for writing returns, the prepare has opened it, after its temporary
    file): the file it left is removed by the next prepare of the same output, which says so."""
    import os
    import signal
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    fifo = src / "stream.txt"
    os.mkfifo(fifo)
    out = tmp_path / "o.bin"
    cmd = [sys.executable, "-m", "zerolab", "data", "prepare", "--src", str(src), "--out", str(out), "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with open(fifo, "wb") as writer:  # returns once the prepare opened the FIFO to read it
            writer.write(b"some text " * 1000)
            writer.flush()
            left = sorted(p.name for p in tmp_path.glob("o.bin.tmp.*"))
            assert left == [f"o.bin.tmp.{proc.pid}"], left
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    fifo.unlink()
    (src / "a.txt").write_text("other text " * 50)
    rerun = run_process(cmd, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert f"removed {tmp_path / left[0]} (" in rerun.stdout and f"(pid {proc.pid}) that was killed" in rerun.stdout
    assert not list(tmp_path.glob("o.bin.tmp.*")) and out.exists()


def test_train_tokenizer_gives_gpt2s_shape_beside_the_output(tmp_path):
    text_files(tmp_path, n_files=2, size=100_000)
    out = tmp_path / "data" / "corpus.bin"
    assert cli_main(["prepare", "--src", str(tmp_path / "src"), "--out", str(out), "--train-tokenizer", "300",
                     "--workers", "2", "--no-progress"]) == 0
    from tokenizers import Tokenizer

    saved = tmp_path / "data" / "corpus.tokenizer.json"
    tok = Tokenizer.from_file(str(saved))
    assert tok.get_vocab_size() == 300 and tok.token_to_id(EOT) == 299  # 256 bytes + 43 merges + EOT last
    meta = read_sidecar(str(out))
    assert meta["vocab_size"] == 300 and meta["tokenizer"]["sha256"] == hashlib.sha256(saved.read_bytes()).hexdigest()
    tokens = np.fromfile(out, dtype=np.uint16)
    assert (tokens == 299).sum() == 2 and tokens[-1] == 299  # one end-of-text after each of the 2 files


# ---- the vocabulary check -----------------------------------------------------------------------
def test_vocab_check_scans_a_file_without_sidecar(tmp_path):
    path = tmp_path / "plain.bin"
    tokens = (np.arange(100_000) % 300).astype(np.uint16)
    tokens[77_777] = 600
    tokens.tofile(path)
    assert scan_max(str(path), np.uint16, chunk_tokens=1000) == 600  # found in the 78th of 100 windows
    with pytest.raises(ConfigError, match=rf"token file {path} holds token 600 \(found by scanning the file\), "
                                          r"which is not below model.vocab_size=512.*model.vocab_size=601 or more"):
        check_token_file(str(path), 15, 0.05, vocab_size=512)
    check_token_file(str(path), 15, 0.05, vocab_size=601)
    with pytest.raises(ConfigError, match="holds token 600"):
        check_data(DataConfig(path=str(path)), 15, 600)
    check_data(DataConfig(kind="synthetic", path=str(path)), 15, 2)  # synthetic data reads no file


def test_vocab_check_reads_the_sidecar_when_there_is_one(tmp_path):
    """The sidecar's largest token is used as it stands (no scan): here it says 700 over a file
    whose tokens are all below 10, and the check believes it."""
    path = tmp_path / "c.bin"
    (np.arange(2000) % 10).astype(np.uint16).tofile(path)
    write_sidecar(str(path), {"dtype": "uint16", "tokens": 2000, "max_token": 700, "vocab_size": 1000})
    with pytest.raises(ConfigError, match=r"holds token 700 \(from its sidecar c.bin.json; its tokenizer's "
                                          r"vocabulary is 1000\), which is not below model.vocab_size=512.*"
                                          r"model.vocab_size=1000 or more"):
        check_token_file(str(path), 15, 0.05, vocab_size=512)
    check_token_file(str(path), 15, 0.05, vocab_size=701)


def test_a_small_vocabulary_is_no_config_error_any_more():
    """The data check compares the file's largest token with the vocabulary; validate no longer
    asks byte-level's 256 of every text run."""
    assert compose(["model=gpt_tiny", "model.vocab_size=100"]).model.vocab_size == 100


# ---- nanoGPT's layout ---------------------------------------------------------------------------
def nanogpt_dir(tmp_path, train, val, name="ng"):
    d = tmp_path / name
    d.mkdir()
    np.asarray(train, dtype=np.uint16).tofile(d / "train.bin")
    np.asarray(val, dtype=np.uint16).tofile(d / "val.bin")
    return d


def test_nanogpt_layout_reads_each_split_from_its_file(tmp_path):
    d = nanogpt_dir(tmp_path, np.arange(1000) % 250, 250 + np.arange(160) % 5)
    for val_fraction in (0.05, 0.4):  # not used: the directory says which tokens validate
        data = TokenData(str(d), 15, val_fraction)
        assert (data.n_windows("train"), data.n_windows("val")) == (1000 // 16, 160 // 16)
        b = data.val_batch(0, 0, 1, 3, "cpu")
        assert b.x.min() >= 250  # validation windows come from val.bin only
        assert np.array_equal(b.x[0].numpy(), 250 + np.arange(15) % 5)
        s = WindowSampler(data.n_windows("train"), 0, 4, 1, 1)
        assert data.train_batch(s, 0, 0, 0, "cpu").x.max() < 250
    check_token_file(str(d), 15, 0.05, vocab_size=255)


def test_nanogpt_layout_refusals_name_the_file(tmp_path):
    train = np.arange(1000) % 300
    train[123] = 600
    d = nanogpt_dir(tmp_path, train, np.arange(100) % 300)
    with pytest.raises(ConfigError, match=rf"token file {d}/train.bin holds token 600 .*model.vocab_size=512"):
        check_token_file(str(d), 15, 0.05, vocab_size=512)
    short = nanogpt_dir(tmp_path, np.arange(1000) % 300, np.arange(10), name="short")
    with pytest.raises(ConfigError, match=rf"{short}/val.bin \(the validation split, nanoGPT's layout\) holds 10 "
                                          r"tokens.*model.block_size=9 or smaller"):
        check_token_file(str(short), 15, 0.05)
    (short / "val.bin").unlink()
    with pytest.raises(ConfigError, match=rf"data.path={short} is a directory without val.bin"):
        check_token_file(str(short), 15, 0.05)
    wide = nanogpt_dir(tmp_path, [], [], name="wide")
    np.arange(1000, dtype=np.uint32).tofile(wide / "train.bin")
    np.arange(100, dtype=np.uint32).tofile(wide / "val.bin")
    write_sidecar(str(wide / "train.bin"), {"dtype": "uint32", "tokenizer": {"sha256": "a" * 64}})
    write_sidecar(str(wide / "val.bin"), {"dtype": "uint32", "tokenizer": {"sha256": "b" * 64}})
    with pytest.raises(ConfigError, match="train.bin and val.bin of .* were made with different tokenizers"):
        check_token_file(str(wide), 15, 0.05)
    write_sidecar(str(wide / "val.bin"), {"dtype": "uint32", "tokenizer": {"sha256": "a" * 64}})
    data = TokenData(str(wide), 15, 0.05)
    assert data.splits["train"].dtype == np.uint32 and data.splits["val"][-1] == 99


# ---- exact resume on every layout ---------------------------------------------------------------
def layout(tmp_path, kind):
    """A data.path of each layout whose windows are all distinct (tokens count up)."""
    if kind == "file-uint16":
        path = tmp_path / "c.bin"
        (np.arange(3000) % 60_000).astype(np.uint16).tofile(path)
        return path
    if kind == "file-uint32":
        path = tmp_path / "c32.bin"
        (70_000 + np.arange(3000)).astype(np.uint32).tofile(path)
        write_sidecar(str(path), {"dtype": "uint32", "tokens": 3000})
        return path
    return nanogpt_dir(tmp_path, np.arange(2900), 5000 + np.arange(200))


@pytest.mark.parametrize("kind", ["file-uint16", "file-uint32", "nanogpt"])
def test_every_window_once_per_epoch_and_any_step_resumes(tmp_path, kind):
    path = str(layout(tmp_path, kind))
    data = TokenData(path, 15, 0.05)
    n = data.n_windows("train")
    world, micro = 2, 3
    s = WindowSampler(n, 5, micro, 1, world)
    steps = -(-n // s.global_batch)  # enough steps to cover one epoch's n samples
    # Rows in global sample order (step, then rank, then row): the first n are epoch 0.
    rows = [tuple(row) for step in range(steps) for r in range(world)
            for row in data.train_batch(s, step, r, 0, "cpu").x.tolist()]
    split = data.splits["train"]
    windows = [tuple(int(t) for t in split[w * 16: w * 16 + 15]) for w in range(n)]
    assert len(set(windows)) == n  # distinct windows: seeing each once is seeing every window
    assert sorted(rows[:n]) == sorted(windows)
    full = [data.train_batch(s, step, r, 0, "cpu").x for step in range(2 * steps + 3) for r in range(world)]
    again = TokenData(path, 15, 0.05)  # a restarted job: new objects, no state carried over
    resumed = WindowSampler(again.n_windows("train"), 5, micro, 1, world)
    k = steps - 1  # resume just before an epoch boundary and run across it
    for step in range(k, 2 * steps + 3):
        for r in range(world):
            assert np.array_equal(again.train_batch(resumed, step, r, 0, "cpu").x, full[step * world + r])
