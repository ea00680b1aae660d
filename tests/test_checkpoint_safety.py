"""Checkpoints an attacker or a full disk got at, and DeepSpeed op builds a kill interrupted.

- DeepSpeed's .pt files (torch.save pickles) with a payload planted in them, meta.json rewritten
  to match: resume, export and import refuse, naming the file and the global; the payload never
  runs (its marker file stays absent).
- meta.json edited by one digit: its own digest catches it, resume=auto falls back.
- A disk that fills during a save (a real tmpfs): one CheckpointError naming the path, no temp
  directory left, the previous checkpoint resumes; its advice counts what the rest of the run
  writes (the end's files too), and following it literally the run finishes.
- A disk that fills while metrics.jsonl is appended: every rank stops after the same step, one
  paragraph, no torn line, no rank blamed.
- A stale op build lock: the DeepSpeed run fails naming it instead of waiting forever.
- The DeepSpeed strategy puts deepspeed.comm's backend back when the run ends.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import TORCHRUN, missing, read_metrics, run_process, run_python, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

TINY = ["model=gpt_tiny", "data=text", "trainer.eval_every=0", "data.micro_batch=4", "optim.warmup_steps=2"]
DS = ["strategy=deepspeed", "strategy.stage=2"]


class _Evil:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_meta(ckpt: Path) -> None:
    """Re-record every file's size and sha256 and re-digest meta.json: an attacker's full rewrite."""
    from zerolab.checkpoint import _meta_text

    meta = json.loads((ckpt / "meta.json").read_text())
    for fname, info in meta["files"].items():
        data = (ckpt / fname).read_bytes()
        info.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "meta.json").write_text(_meta_text(meta))


@pytest.fixture
def ds_native(tmp_path, deepspeed_ops):
    """A checkpoints directory holding a DeepSpeed checkpoint in DeepSpeed's own format, as zerolab
    wrote them before format version 5 (tests/data, from 7881427: test_resume_strategies.NATIVE):
    the only checkpoints with torch.save files zerolab still reads."""
    from test_resume_strategies import native_checkpoint

    return native_checkpoint(tmp_path).parent


def test_deepspeed_pickle_payload_never_runs(tmp_path, ds_native):
    from test_resume_strategies import NATIVE_RUN

    from zerolab.checkpoint import CheckpointError, safe_torch_load, verify

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"optimizer_state_dict": {}, "payload": _Evil(marker)}, evil)
    ck = ds_native
    steps = sorted(p for p in ck.iterdir() if p.name.startswith("step_"))
    assert len(steps) == 1

    # One file at a time: verify() names exactly that file and the global, before anything loads it.
    clean = tmp_path / "clean"
    shutil.copytree(steps[-1], clean)
    pts = sorted(f for f in json.loads((clean / "meta.json").read_text())["files"] if f.endswith(".pt"))
    assert len(pts) == 3  # model states + one optimizer partition per rank
    for fname in pts:
        victim = tmp_path / f"one-{Path(fname).name}"
        shutil.copytree(clean, victim)
        shutil.copy(evil, victim / fname)
        _rewrite_meta(victim)
        with pytest.raises(CheckpointError, match=rf"{victim / fname}: refused, its pickle names posix.system"):
            verify(str(victim))

    # Every torch.save file of the checkpoint planted: resume, export and import all refuse.
    for step in steps:
        for fname in json.loads((step / "meta.json").read_text())["files"]:
            if fname.endswith(".pt"):
                shutil.copy(evil, step / fname)
        _rewrite_meta(step)
    proc = run_train(tmp_path / "resumed", 2, *NATIVE_RUN, f"checkpoint.dir={ck}", "checkpoint.resume=auto",
                     check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]  # a CheckpointError: exit 1
    assert f"{steps[-1]}/deepspeed/mp_rank_00_model_states.pt: refused, its pickle names posix.system" in out
    assert f"no usable checkpoint in {ck}" in out
    for args in (["--out", str(tmp_path / "m.safetensors")], ["--as-checkpoint", "--out", str(tmp_path / "imp")]):
        proc = run_python("-m", "zerolab", "export", str(steps[-1]), *args, check=False)
        assert proc.returncode == 1 and "refused, its pickle names posix.system" in proc.stderr, proc.stderr
    assert not (tmp_path / "imp").exists() and not (tmp_path / "m.safetensors").exists()

    # The second line of defence: inside safe_torch_load even DeepSpeed's weights_only=False is refused.
    with safe_torch_load(), pytest.raises(CheckpointError, match=f"{evil}: refused while loading"):
        torch.load(evil, weights_only=False)
    assert not marker.exists(), "the payload ran"


def test_unrecorded_deepspeed_file_is_refused(ds_native):
    """DeepSpeed finds partitions by file-name pattern: a file meta.json does not list is refused."""
    from zerolab.checkpoint import CheckpointError, verify

    step = ds_native / "step_00000003"
    extra = step / "deepspeed" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copy(step / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", extra)
    with pytest.raises(CheckpointError, match=f"{extra} is not recorded in meta.json"):
        verify(str(step))


class _Tmpfs:
    """A real tmpfs of a given size, mounted for one test (needs root). Where it cannot be had the
    test skips, naming why; on CI (CI=true) it fails instead: a prerequisite CI must have."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        why = "mounting a small tmpfs needs root (this test fills a real filesystem)" if os.geteuid() != 0 else None
        if why is None:
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                     capture_output=True, text=True)
            why = None if mounted.returncode == 0 else f"cannot mount a tmpfs here: {mounted.stderr.strip()}"
        if why is not None:
            missing(why)  # conftest: fails on CI=true, skips with the reason elsewhere

    def __enter__(self):
        return self.path

    def __exit__(self, *exc):
        subprocess.run(["umount", str(self.path)], check=False)


def _grow(mounted: Path, by: int) -> None:
    """`by` more bytes of room on a _Tmpfs, as freeing that much would (a remount keeps the files)."""
    fs = os.statvfs(mounted)
    subprocess.run(["mount", "-o", f"remount,size={fs.f_blocks * fs.f_frsize + by}", str(mounted)], check=True)


def _checkpoint_bytes() -> int:
    from zerolab.config import compose
    from zerolab.models import build_model

    n = sum(p.numel() for p in build_model(compose(["model=gpt_tiny"]).model, device="meta").parameters())
    return 12 * n + 64 * 1024  # fp32 master + Adam's two moments, plus RNG, headers and meta.json (< 64 KiB)


def test_disk_full_during_save_gives_advice_that_works(tmp_path):
    """A tmpfs that holds one checkpoint of gpt_tiny under ddp but not two: the second save fails,
    its message says how much room a save needs, and a run given that room (as the message says:
    checkpoint.dir on a filesystem that size) resumes and keeps saving to the end."""
    one = _checkpoint_bytes()
    with _Tmpfs(tmp_path / "small", int(1.6 * one)) as small:  # the first save fits, the second cannot
        ck = small / "checkpoints"
        proc = run_train(tmp_path / "run", 2, *TINY, "trainer.max_steps=3", "checkpoint.every=1",
                         f"checkpoint.dir={ck}", check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]  # a CheckpointError: exit 1
        message = [line for line in out.splitlines() if line.startswith("zerolab: error:")]
        assert len(message) == 1, out[-6000:]  # said once, by rank 0
        assert (f"saving the checkpoint of step 2 failed writing {ck / '.tmp-step_00000002'}" in message[0]
                and "no space left on the device; a checkpoint of this run takes" in message[0]
                and f"The previous checkpoint {ck / 'step_00000001'} is intact" in message[0]), message[0]
        assert sorted(os.listdir(ck)) == ["latest", "step_00000001"]  # no .tmp-step_* left behind
        rooms, need = map(int, re.search(r"a filesystem with room for (\d+) checkpoints \((\d+) bytes\)",
                                         message[0]).groups())
        assert rooms == 2 and need > 1.6 * one  # honest: this filesystem could never hold a save beside one
        with _Tmpfs(tmp_path / "large", need) as large:  # the advice, as written
            run = tmp_path / "resumed"
            proc = run_train(run, 2, *TINY, "trainer.max_steps=4", "checkpoint.every=1",
                             f"checkpoint.resume={ck / 'step_00000001'}", f"checkpoint.dir={large / 'ck'}")
            assert "resumed at step 1" in proc.stdout + proc.stderr
            assert [r["step"] for r in read_metrics(run)] == [2, 3, 4]
            assert sorted(os.listdir(large / "ck")) == ["latest", "step_00000003", "step_00000004"]


def test_disk_full_advice_counts_the_end_of_the_run_and_following_it_finishes(tmp_path):
    """The run directory and its checkpoints on one small tmpfs: the second save does not fit. The
    advice names that filesystem and a byte count that covers the rest of the run after a resume:
    the checkpoints it still saves, its final weights, eval files, summary and metrics. Followed
    literally (exactly that many more bytes of room, then checkpoint.resume=auto), the run finishes,
    every final file written."""
    one = _checkpoint_bytes()
    with _Tmpfs(tmp_path / "small", int(1.6 * one)) as small:  # the first save fits, the second cannot
        run = small / "run"
        common = [*TINY, "trainer.max_steps=4", "checkpoint.every=1", f"run.dir={run}"]
        proc = run_train(run, 2, *common, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]  # a CheckpointError: exit 1
        message = [line for line in out.splitlines() if line.startswith("zerolab: error:")]
        assert len(message) == 1, out[-6000:]
        found = re.search(r"free at least (\d+) bytes on the filesystem mounted at (\S+) \(the rest of the run writes "
                          r"up to (\d+) bytes there: ([^;]*);", message[0])
        assert found and found.group(2) == str(small), message[0]
        parts = found.group(4)
        for name in ("1 checkpoint(s) beyond those kept", "model.safetensors", "eval_logits.safetensors",
                     "grad_noise.safetensors", "summary.json", "metrics.jsonl"):
            assert name in parts, parts
        assert f"the run directory {run} is on the same filesystem" in message[0]
        _grow(small, int(found.group(1)))  # the advice, as written
        proc = run_train(run, 2, *common, "checkpoint.resume=auto")
        assert "resumed at step 1" in proc.stdout + proc.stderr
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
        for name in ("model.safetensors", "eval_logits.safetensors", "grad_noise.safetensors", "summary.json"):
            assert (run / name).exists(), name
        assert "final_write_error" not in json.loads((run / "summary.json").read_text())


def test_first_save_on_a_full_disk_counts_the_checkpoints_a_fresh_run_keeps(tmp_path):
    """No checkpoint exists yet when the first save (step 5) does not fit: the run must start again,
    and a fresh run keeps checkpoints as it goes (with checkpoint.keep_last=2, one beside the one it
    writes), not just the one it writes. The paragraph says to start again with run.overwrite=true
    (the same command, or checkpoint.resume=auto, is refused on the run directory it left), and
    counts room for both; followed literally, the run trains all its steps and writes every final
    file."""
    with _Tmpfs(tmp_path / "small", 700 * 1024) as small:  # metrics fit, one checkpoint (~1.5 MB) does not
        run = small / "run"
        common = [*TINY, "trainer.max_steps=20", "checkpoint.every=5", f"run.dir={run}"]
        proc = run_train(run, 2, *common, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]
        message = [line for line in out.splitlines() if line.startswith("zerolab: error:")]
        assert len(message) == 1 and "saving the checkpoint of step 5 failed" in message[0], out[-6000:]
        assert f"No earlier checkpoint exists: start again with run.overwrite=true run.dir={run}" in message[0]
        found = re.search(r"free at least (\d+) bytes on the filesystem mounted at (\S+) \(the rest of the run writes "
                          r"up to (\d+) bytes there: ([^;]*);", message[0])
        assert found and "2 checkpoint(s) beyond those kept" in found.group(4), message[0]
        _grow(small, int(found.group(1)))  # the advice, as written
        run_train(run, 2, *common, "run.overwrite=true")
        assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 21))
        for name in ("model.safetensors", "eval_logits.safetensors", "grad_noise.safetensors", "summary.json"):
            assert (run / name).exists(), name
        assert "final_write_error" not in json.loads((run / "summary.json").read_text())


def test_metrics_on_a_full_disk_stop_every_rank_in_one_paragraph(tmp_path):
    """The run directory on a 100 kB tmpfs, no checkpoints: the first write that does not fit is a
    metrics.jsonl append. Under torchrun: exit 1, one paragraph said once (what was written, what
    not, what to do), no traceback, no torn line, no rank blamed for stopping, nothing promised
    that does not come."""
    with _Tmpfs(tmp_path / "x", 100 * 1024) as small:
        run = small / "run"
        proc = run_train(run, 2, *TINY, "trainer.max_steps=200", torchrun=True, check=False, timeout=400)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-6000:]
        message = [line for line in out.splitlines() if line.startswith("zerolab: error:")]
        assert len(message) == 1, out[-6000:]
        text = (run / "metrics.jsonl").read_text()
        assert text.endswith("\n")
        steps = [json.loads(line)["step"] for line in text.splitlines()]  # every line whole
        last = steps[-1]
        assert steps == list(range(1, last + 1)) and last < 200, steps
        assert (f"every rank stopped after step {last + 1} of 200: the disk is full: the record of step {last + 1} "
                f"did not fit in {run / 'metrics.jsonl'} (No space left on device); the records up to step {last} "
                "are there, whole" in message[0]), message[0]
        assert "no checkpoint of step" in message[0] and "run.overwrite=true" in message[0], message[0]
        assert re.search(rf"free at least \d+ bytes on the filesystem mounted at {small} ", message[0]), message[0]
        # no Python traceback from a rank (torchrun's agent prints its own ChildFailedError one)
        assert not re.search(r'File "[^"]*(/zerolab/[^"]*|train\.py)"', out) and "RankStopped" not in out, out[-6000:]
        assert "with a checkpoint" not in out and "stopping after this step" not in out, out[-6000:]
        assert not list(run.glob("*.tmp.*"))


def test_disk_full_at_the_end_keeps_the_weights_and_says_so(tmp_path):
    """The run directory on a tmpfs too small for the final weights: the run still trains to its end,
    says in one paragraph (no traceback) what was and was not written and where the weights are (the
    last step's checkpoint, on another disk), and exporting that checkpoint gives them."""
    with _Tmpfs(tmp_path / "small", 256 * 1024) as small:  # metrics fit; 480 KB of fp32 weights do not
        run, ck = small / "run", tmp_path / "checkpoints"
        proc = run_train(run, 2, *TINY, "trainer.max_steps=3", "checkpoint.every=2", f"checkpoint.dir={ck}",
                         check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]  # zerolab.run.results.ResultsNotWritten: exit 1, rank 0
        message = [line for line in out.splitlines() if line.startswith("zerolab: error:")]
        assert len(message) == 1, out[-6000:]
        assert "the run trained all 3 steps, but the disk filled" in message[0]
        assert "not written: " in message[0] and "model.safetensors" in message[0].split("not written: ")[1]
        assert f"The final weights are in the checkpoint of step 3, {ck / 'step_00000003'}" in message[0]
        assert not re.search(r'File "[^"]*(/zerolab/[^"]*|train\.py)"', out), out[-6000:]
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
        assert not (run / "model.safetensors").exists() and not list(run.glob("*.tmp.*"))
    proc = run_python("-m", "zerolab", "export", str(ck / "step_00000003"), "--out", str(tmp_path / "w.safetensors"))
    assert (tmp_path / "w.safetensors").stat().st_size > 400_000


def test_stale_op_build_lock_fails_fast(tmp_path, deepspeed_ops):
    """A copy of the extensions cache with a `lock` left by a build that was killed: the run names
    the lock (without zerolab's check it waits on it until the subprocess timeout)."""
    from zerolab.ds_ops import extensions_root, op_names

    src, ext = extensions_root(), tmp_path / "torch_extensions"
    ext.mkdir()
    for name in op_names():
        if os.path.isdir(os.path.join(src, name)):
            shutil.copytree(os.path.join(src, name), ext / name, ignore=shutil.ignore_patterns("lock"))
    (ext / "fused_adam").mkdir(exist_ok=True)
    lock = ext / "fused_adam" / "lock"
    lock.touch()
    os.utime(lock, (1_000_000_000, 1_000_000_000))  # created long ago (2001), by a builder long gone
    proc = run_train(tmp_path / "run", 2, *TINY, *DS, "trainer.max_steps=1", check=False,
                     env={"TORCH_EXTENSIONS_DIR": str(ext)}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]  # a ZerolabError: exit 1
    assert f"DeepSpeed op build lock {lock} is stale" in out and f"rm {lock}" in out, out[-3000:]


def test_deepspeed_restores_comm_backend(tmp_path, deepspeed_ops):
    """deepspeed.comm's backend carries zerolab's counting wrappers only while the run lasts."""
    script = (
        "import os, sys; from zerolab.config import compose; from zerolab.job import run\n"
        "import deepspeed.comm.comm as c\n"
        "run(compose(sys.argv[1:]))\n"
        "b = c.cdb\n"
        "left = [m for m in ('all_reduce', 'broadcast', 'reduce_scatter_tensor') if m in vars(b)]\n"
        "state = 'patched' if left or hasattr(b, '_zerolab_counting') else 'restored'\n"
        # one write() per rank: two ranks' print() pieces could interleave on the shared pipe
        "os.write(1, f'cdb {state} {left}\\n'.encode())\n")
    worker = tmp_path / "worker.py"
    worker.write_text(script)
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(worker), *TINY, *DS, "trainer.max_steps=1",
           f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", "logging.progress=false"]
    proc = run_process(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cdb restored []") == 2, proc.stdout[-2000:]
