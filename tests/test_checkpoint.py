"""Checkpoints: exact resume, atomicity and corruption fallback, bad input, safe loading, export.

Real gloo ranks (tests/ranks.py: train.py's job without torchrun; the one test of a message under
torchrun starts torchrun). Exact resume: run A trains 2k steps and saves at k and 2k; run B
starts a fresh job from A's step-k checkpoint and trains to 2k. B's losses (steps k+1..2k) and
final weights must equal A's bit for bit on CPU (same world size and strategy), which covers
data order, dropout RNG, the LR schedule, the optimizer step counter and the loss scale, with
accumulation, LAMB, and zero3 in 16-bit among the cases."""
import json
import os
import re
import shutil

import pytest
import torch

from conftest import load_weights, rank_log, read_metrics, run_python, run_ranks, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

K = 3
TINY = ["model=gpt_tiny", "data=text", "trainer.eval_every=0", "data.micro_batch=4"]



@pytest.mark.parametrize("strategy,precision,extra", [
    ("ddp", "fp32", ["model.dropout=0.1"]),
    ("zero2", "fp32", ["model.dropout=0.1", "trainer.grad_accum_steps=2"]),
    # LAMB's per-tensor trust ratios from the flat shard, with accumulation, in bf16
    ("zero2", "bf16", ["model.dropout=0.1", "optim=lamb", "trainer.grad_accum_steps=2"]),
    # zero3: the persistent bf16 chunks are rebuilt from the loaded fp32 master exactly as the step
    # wrote them, so the steps after the resume repeat bit for bit.
    ("zero3", "bf16", ["model.dropout=0.1", "trainer.grad_accum_steps=2"]),
    ("zero3", "fp32", ["optim=lamb"]),
    # fp16: the loss scale grows every 2 clean steps, so a resume that lost it would differ.
    ("zero1", "fp16", ["precision.growth_interval=2", "precision.initial_scale=1024"]),
])
def test_exact_resume_is_bitwise(tmp_path, strategy, precision, extra):
    common = [*TINY, f"strategy={strategy}", f"precision.name={precision}", f"trainer.max_steps={2 * K}",
              "optim.warmup_steps=2", *extra]
    a, b = tmp_path / "a", tmp_path / "b"
    run_ranks(a, 2, *common, f"checkpoint.every={K}")
    run_ranks(b, 2, *common, f"checkpoint.resume={a / 'checkpoints' / f'step_{K:08d}'}")
    assert f"resumed at step {K}" in rank_log(b)
    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in mb] == list(range(K + 1, 2 * K + 1))
    keys = ["loss", "lr", "grad_norm"] + (["loss_scale"] if precision == "fp16" else [])
    for ra, rb in zip(ma[K:], mb):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}, f"step {ra['step']}"
    if precision == "fp16":
        assert len({r["loss_scale"] for r in ma}) > 1  # the scale did change during the run
    wa, wb = load_weights(a), load_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """2 ranks of ddp, checkpoints at steps 2 and 4 (the final step)."""
    run = tmp_path_factory.mktemp("ddp") / "run"
    run_ranks(run, 2, *TINY, "trainer.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=3")
    return run


def _copy_ckpts(ddp_run, tmp_path):
    dst = tmp_path / "checkpoints"
    shutil.copytree(ddp_run / "checkpoints", dst)
    return dst


def test_layout_and_pruning(tmp_path):
    run = tmp_path / "run"
    run_ranks(run, 2, *TINY, "trainer.max_steps=5", "checkpoint.every=1", "checkpoint.keep_last=2")
    ck = run / "checkpoints"
    assert sorted(os.listdir(ck)) == ["latest", "step_00000004", "step_00000005"]
    assert (ck / "latest").read_text().strip() == "step_00000005"
    meta = json.loads((ck / "step_00000005" / "meta.json").read_text())
    assert meta["step"] == 5 and meta["world_size"] == 2 and meta["strategy"] == "ddp"
    assert set(meta["files"]) == {"rank0.safetensors", "rank1.safetensors"}
    assert {"master/wte.weight", "exp_avg/wte.weight", "exp_avg_sq/wte.weight"} <= set(meta["pieces"])
    assert meta["optimizer_scalars"]["step"]["value"] == 5.0 and meta["sampler"]["next_step"] == 5
    assert meta["aliases"] == {"lm_head.weight": "wte.weight"}
    for key in ("lr_schedule", "loss_scaler", "config", "versions"):
        assert meta[key]


def test_corrupt_newest_falls_back_to_previous(tmp_path, ddp_run):
    ck = _copy_ckpts(ddp_run, tmp_path)
    victim = ck / "step_00000004" / "rank0.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of a tensor
    victim.write_bytes(bytes(data))
    # A save that a crash interrupted: a temp dir with half a file and no meta.json.
    (ck / ".tmp-step_00000006").mkdir()
    (ck / ".tmp-step_00000006" / "rank0.safetensors").write_bytes(b"\0" * 100)
    run = tmp_path / "resumed"
    run_ranks(run, 2, *TINY, "trainer.max_steps=4", f"checkpoint.dir={ck}", "checkpoint.resume=auto")
    out = rank_log(run)
    assert f"{victim}: sha256 does not match" in out
    assert "falling back to" in out and "resumed at step 2" in out
    assert [r["step"] for r in read_metrics(run)] == [3, 4]
    # The continued run reaches the same weights as the original one.
    wa, wb = load_weights(ddp_run), load_weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_flipped_digit_in_meta_falls_back(tmp_path, ddp_run):
    """meta.json's own digest: `"step": 4` -> `6` (a valid-looking value) is a corrupt checkpoint."""
    ck = _copy_ckpts(ddp_run, tmp_path)
    mpath = ck / "step_00000004" / "meta.json"
    text = mpath.read_text()
    assert text.count('"step": 4,') == 1
    mpath.write_text(text.replace('"step": 4,', '"step": 6,'))
    run = tmp_path / "resumed"
    run_ranks(run, 2, *TINY, "trainer.max_steps=4", f"checkpoint.dir={ck}", "checkpoint.resume=auto")
    out = rank_log(run)
    assert f"{mpath}: its content does not match its own sha256" in out
    assert f"falling back to {ck / 'step_00000002'}" in out and "resumed at step 2" in out
    assert [r["step"] for r in read_metrics(run)] == [3, 4]


def test_meta_fields_are_validated(tmp_path, ddp_run):
    """A meta.json rewritten with a matching digest still has to make sense field by field."""
    from zerolab.checkpoint import CheckpointError, verify

    ck = _copy_ckpts(ddp_run, tmp_path) / "step_00000004"
    for changes, match in [({"step": -4}, "field 'step' is -4, expected an integer >= 0"),
                           ({"step": 6}, "field 'step' is 6, but the directory is step_00000004"),
                           ({"world_size": 0}, "field 'world_size' is 0, expected an integer >= 1"),
                           ({"files": {"../../x": {"rank": 0, "bytes": 1, "sha256": "0" * 64}}},
                            "names '../../x', outside the checkpoint directory")]:
        saved = (ck / "meta.json").read_text()
        _meta_edit(ck, **changes)
        with pytest.raises(CheckpointError, match=match):
            verify(str(ck))
        (ck / "meta.json").write_text(saved)


def _meta_edit(ckpt, **changes):
    """Edits meta.json and rewrites its own digest to match (what a deliberate edit would do)."""
    from zerolab.checkpoint import _meta_text

    path = ckpt / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(_meta_text(meta))


def test_bad_input_errors_name_file_and_mismatch(tmp_path, ddp_run):
    from zerolab.checkpoint import CheckpointError, _check_compatible, resolve, verify
    from zerolab.config import compose
    from zerolab.strategies.ddp import DDPStrategy

    ck = _copy_ckpts(ddp_run, tmp_path)
    s4, s2 = ck / "step_00000004", ck / "step_00000002"
    # truncated shard
    f = s4 / "rank1.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=f"{f}.*truncated"):
        verify(str(s4))
    # missing shard
    f.unlink()
    with pytest.raises(CheckpointError, match=f"{f} is missing .shard of rank 1 of 2"):
        verify(str(s4))
    # no complete checkpoint left but step 2 -> resolve picks it
    assert resolve(str(ck)) == str(s2)
    # newer format version
    _meta_edit(s2, format_version=99)
    with pytest.raises(CheckpointError, match=f"{s2 / 'meta.json'}: format version 99 is newer"):
        verify(str(s2))
    _meta_edit(s2, format_version=1)
    meta = verify(str(s2))
    strategy = DDPStrategy.__new__(DDPStrategy)

    def check(overrides, meta=meta):
        cfg = compose(["model=gpt_tiny", *overrides])
        from zerolab.checkpoint import model_layout
        from zerolab.models import build_model
        _check_compatible(meta, str(s2), cfg, strategy, model_layout(build_model(cfg.model, device="meta")))

    check([])  # compatible as saved
    with pytest.raises(CheckpointError, match=r"another model.*blocks.0.attn.qkv.weight: shape \[192, 64\] in the "
                                              r"checkpoint, \[96, 32\] in this model"):
        check(["model.n_embd=32"])
    with pytest.raises(CheckpointError, match=r"blocks.2.ln_1.weight: missing from the checkpoint"):
        check(["model.n_layer=3"])
    with pytest.raises(CheckpointError, match=r"written by strategy 'zero9'"):
        check([], meta={**meta, "strategy": "zero9"})
    with pytest.raises(CheckpointError, match=r"optim=adamw, this run uses optim=sgd"):
        check(["optim.name=sgd"])


def test_wrong_model_stops_before_training(tmp_path, ddp_run):
    run = tmp_path / "run"
    codes = run_ranks(run, 2, *TINY, "model.n_embd=32", "trainer.max_steps=4",
                     f"checkpoint.resume={ddp_run / 'checkpoints'}", check=False)
    assert codes == [1, 1], codes  # a CheckpointError: exit 1 on every rank
    # An explained failure: one paragraph, said by rank 0 alone, no Python traceback (zerolab.errors).
    out = rank_log(run)
    assert "zerolab: error:" in out and "step_00000004/meta.json: the checkpoint is for another model" in out
    assert 'zerolab/checkpoint/' not in out and "zerolab: error:" not in rank_log(run, 1)
    assert not (run / "metrics.jsonl").exists() or read_metrics(run) == []


class _Evil:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_callable_is_refused(tmp_path, ddp_run):
    from zerolab.checkpoint import CheckpointError, export, load_torch_file, newest_good, verify

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "payload": _Evil(marker)}, evil)
    with pytest.raises(CheckpointError, match="refused"):
        load_torch_file(str(evil))
    assert not marker.exists()
    # A rank file swapped for that pickle, with its checksum updated so verification passes:
    ck = _copy_ckpts(ddp_run, tmp_path) / "step_00000004"
    shutil.copy(evil, ck / "rank0.safetensors")
    import hashlib
    files = json.loads((ck / "meta.json").read_text())["files"]
    files["rank0.safetensors"].update(bytes=evil.stat().st_size, sha256=hashlib.sha256(evil.read_bytes()).hexdigest())
    _meta_edit(ck, files=files)
    # Checksums match, but the file is no safetensors file: refused, so resume=auto falls back.
    with pytest.raises(CheckpointError, match="rank0.safetensors: not a readable safetensors file"):
        verify(str(ck))
    assert newest_good(str(ck.parent), say=lambda _: None) == str(ck.parent / "step_00000002")
    with pytest.raises(CheckpointError, match="rank0.safetensors: not a readable safetensors file"):
        export(str(ck), str(tmp_path / "out.safetensors"))
    assert not marker.exists()


def _next_lr(meta: dict, step: int) -> float:
    """What the checkpoint's own LR schedule gives at `step` (a forger can compute it too)."""
    from dataclasses import fields

    from zerolab.optim.schedule import LRSchedule

    sched = meta["lr_schedule"]
    return LRSchedule(**{f.name: sched[f.name] for f in fields(LRSchedule)})(step)


def test_consistent_meta_forgery_is_refused_and_falls_back(tmp_path, ddp_run):
    """meta.json of step 4 rewritten to step 6 with everything it says about the step (the data
    position, the optimizer's count of updates, the LR schedule's position) and its digest
    recomputed, the directory renamed: the rank files still say they were written at step 4."""
    from zerolab.checkpoint import CheckpointError, newest_good, verify

    ck = _copy_ckpts(ddp_run, tmp_path)
    forged = ck / "step_00000006"
    (ck / "step_00000004").rename(forged)
    meta = json.loads((forged / "meta.json").read_text())
    scalars = {"step": {**meta["optimizer_scalars"]["step"], "value": 6.0}}
    _meta_edit(forged, step=6, sampler={**meta["sampler"], "next_step": 6}, optimizer_scalars=scalars,
               lr_schedule={**meta["lr_schedule"], "next_lr": _next_lr(meta, 6)})
    with pytest.raises(CheckpointError, match=r"rank0.safetensors was written at step 4, but meta.json says step 6"):
        verify(str(forged))
    said = []
    assert newest_good(str(ck), say=said.append) == str(ck / "step_00000002")
    assert "falling back to" in said[0] and "[step_00000006]" in said[0]
    _meta_edit(forged, step=6, sampler=meta["sampler"])  # only the step: the data position disagrees
    with pytest.raises(CheckpointError, match="says the data continues at step 4, but the checkpoint is of step 6"):
        verify(str(forged))


def _resign_rank_file(path, step: int) -> None:
    """Rewrite the step in a safetensors file's own metadata (its JSON header, padded to 8 bytes)."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["step"] = str(step)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def _resign(ckpt, step: int, **changes) -> None:
    """A checkpoint copied to another step and re-signed throughout: meta's step and the sampler's,
    each rank file's own metadata, every file's size and sha256, meta.json's digest."""
    import hashlib

    from zerolab.checkpoint import _meta_text

    meta = json.loads((ckpt / "meta.json").read_text())
    for fname, info in meta["files"].items():
        _resign_rank_file(ckpt / fname, step)
        data = (ckpt / fname).read_bytes()
        info.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    meta.update(step=step, sampler={**meta["sampler"], "next_step": step}, **changes)
    (ckpt / "meta.json").write_text(_meta_text(meta))


def test_resigned_copy_is_refused_by_its_counters_and_resume_falls_back(tmp_path, ddp_run):
    """step 4 copied to step 6 and re-signed everywhere a step is written (meta, the sampler, the
    rank files' own metadata, every digest): the optimizer's count of updates (4, none skipped) and
    the LR schedule's position (its next lr is step 4's) still say step 4, and each is checked
    against the step claimed. resume=auto falls back to the real step 4."""
    from zerolab.checkpoint import CheckpointError, verify

    ck = _copy_ckpts(ddp_run, tmp_path)
    real, copy = ck / "step_00000004", ck / "step_00000006"
    meta = verify(str(real))
    assert meta["optimizer_scalars"]["step"]["value"] == 4.0 and meta["skipped_updates"] == 0
    shutil.copytree(real, copy)
    _resign(copy, 6)
    with pytest.raises(CheckpointError, match=r"count 4 optimizer updates, and 0 were skipped: 4 steps, but the "
                                              r"checkpoint claims step 6"):
        verify(str(copy))
    # The count re-signed too (4 updates and 2 "skipped"): the LR schedule still stands at step 4.
    shutil.rmtree(copy)
    shutil.copytree(real, copy)
    _resign(copy, 6, skipped_updates=2)
    with pytest.raises(CheckpointError, match=r"field 'lr_schedule' gives lr .* at step 6, but records next_lr "
                                              r".*: the schedule is at another step"):
        verify(str(copy))
    assert _next_lr(meta, 6) != meta["lr_schedule"]["next_lr"]  # cosine decay: the two steps' lr differ
    # Every counter made to agree, the LR schedule's next value recomputed too: but the run that wrote
    # it (fp32, trainer.nonfinite=stop) stops at a non-finite gradient, it never skips an update.
    forged_lr = {**meta["lr_schedule"], "next_lr": _next_lr(meta, 6)}
    assert meta["config"]["precision"]["name"] == "fp32" and meta["config"]["trainer"]["nonfinite"] == "stop"
    shutil.rmtree(copy)
    shutil.copytree(real, copy)
    _resign(copy, 6, skipped_updates=2, lr_schedule=forged_lr)
    with pytest.raises(CheckpointError, match=r"field 'skipped_updates' is 2, but the run that wrote it "
                                              r"\(precision=fp32, trainer.nonfinite=stop\) cannot skip an update"):
        verify(str(copy))
    # What such a run can hold: updates skipped before it resumed (under settings that skip), or any
    # under trainer.nonfinite=skip. The rule reads the run's own settings, nothing else.
    skipping = {**meta["config"], "trainer": {**meta["config"]["trainer"], "nonfinite": "skip"}}
    for edit in ({"skipped_updates_before": 2}, {"config": skipping}):
        shutil.rmtree(copy)
        shutil.copytree(real, copy)
        _resign(copy, 6, skipped_updates=2, lr_schedule=forged_lr, **edit)
        assert verify(str(copy))["skipped_updates"] == 2
    _resign(copy, 6, skipped_updates=2, skipped_updates_before=3, lr_schedule=forged_lr)
    with pytest.raises(CheckpointError, match=r"field 'skipped_updates_before' is 3, expected an integer from 0 to "
                                              r"skipped_updates \(2\)"):
        verify(str(copy))
    run = tmp_path / "resumed"
    run_ranks(run, 2, *TINY, "trainer.max_steps=4", f"checkpoint.dir={ck}", "checkpoint.resume=auto")
    out = rank_log(run)
    assert "[step_00000006]" in out and f"falling back to {real}" in out and "resumed at step 4" in out, out[-3000:]


def test_skips_before_a_resume_carry_over_to_a_run_that_cannot_skip(tmp_path):
    """An update skipped under trainer.nonfinite=skip (an inf gradient at step 2), then the run resumed
    with the default trainer.nonfinite=stop: its later checkpoint counts that skip as one from before
    it started (skipped_updates_before), so the check that a stopping run skips nothing accepts it."""
    from zerolab.checkpoint import verify

    run = tmp_path / "run"
    run_ranks(run, 2, *TINY, "trainer.max_steps=2", "checkpoint.every=2", "trainer.nonfinite=skip",
              "trainer.max_skipped_share=1", "fault.inf_grad_step=2")
    first = verify(str(run / "checkpoints" / "step_00000002"))
    assert (first["skipped_updates"], first["skipped_updates_before"]) == (1, 0), first
    run_ranks(run, 2, *TINY, "trainer.max_steps=4", "checkpoint.every=2", "checkpoint.resume=auto")
    last = verify(str(run / "checkpoints" / "step_00000004"))
    assert last["config"]["trainer"]["nonfinite"] == "stop"
    assert (last["skipped_updates"], last["skipped_updates_before"]) == (1, 1), last


def test_every_checkpoint_corrupt_is_one_paragraph_with_a_way_on(tmp_path, ddp_run):
    ck = _copy_ckpts(ddp_run, tmp_path)
    for step in sorted(ck.glob("step_*")):
        victim = step / "rank1.safetensors"
        victim.write_bytes(victim.read_bytes()[:-5])
    run = tmp_path / "resumed"
    proc = run_train(run, 2, *TINY, "trainer.max_steps=4", f"checkpoint.dir={ck}", "checkpoint.resume=auto",
                     torchrun=True, check=False)
    out = proc.stdout + proc.stderr
    # a CheckpointError on every rank: each worker exits 1 (rank 1 once torchrun stops it), torchrun 1
    assert proc.returncode == 1 and len(re.findall(r"exitcode\s*:\s*1 ", out)) == 2, out[-6000:]
    message = [line for line in out.splitlines() if line.startswith("zerolab: error:")]
    # said once (torchrun's failure block may quote it again, from the error file train.py writes for it)
    said = [line for line in out.splitlines() if "failed verification" in line and "traceback :" not in line]
    assert len(message) == 1 and len(said) == 1, out[-6000:]
    for step in ("step_00000004", "step_00000002"):
        assert f"[{step}] {ck / step / 'rank1.safetensors'} has" in message[0]
    assert "checkpoint.resume=PATH" in message[0] and "another run.dir" in message[0]
    assert not re.search(r'File "[^"]*(/zerolab/[^"]*|train\.py)"', out), out[-6000:]  # torchrun's traceback only


@pytest.mark.parametrize("strategy,ranks", [("ddp", 2), ("zero2", 3)])
def test_export_matches_live_model_and_is_smaller(tmp_path, strategy, ranks):
    run = tmp_path / "run"
    run_ranks(run, ranks, *TINY, f"strategy={strategy}", "trainer.max_steps=3", "checkpoint.every=3")
    live = load_weights(run)  # the trainer's consolidated weights at the same step
    from safetensors import safe_open
    from safetensors.torch import load_file

    for dtype, torch_dtype, min_ratio in (("fp32", torch.float32, 2.9), ("bf16", torch.bfloat16, 5.8)):
        out = tmp_path / f"model-{dtype}.safetensors"
        proc = run_python("-m", "zerolab", "export", str(run / "checkpoints"), "--out", str(out), "--dtype", dtype)
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        got = load_file(str(out))
        assert set(got) == set(live) - {"lm_head.weight"}  # the tied head is written once
        for k, v in got.items():
            assert v.dtype == torch_dtype and torch.equal(v, live[k].to(torch_dtype)), k
        with safe_open(str(out), framework="pt") as fh:
            assert json.loads(fh.metadata()["tied"]) == {"lm_head.weight": "wte.weight"}
        # AdamW checkpoints carry master + m + v: the export drops two thirds of it (more in bf16).
        assert report["checkpoint_bytes"] / report["export_bytes"] > min_ratio
        # Streaming: at most one assembled fp32 tensor (+ its cast) held at a time.
        assert report["peak_tensor_bytes"] <= 1.5 * report["largest_fp32_tensor_bytes"]
    # An exported file loads into a fresh model (tied head re-tied by strict=False).
    from zerolab.config import compose
    from zerolab.models import build_model
    model = build_model(compose(["model=gpt_tiny"]).model)
    missing, unexpected = model.load_state_dict(load_file(str(tmp_path / "model-fp32.safetensors")), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    assert torch.equal(model.lm_head.weight, live["lm_head.weight"])
