"""DeepSpeed checkpoints in zerolab's checkpoint directory: saved and loaded through DeepSpeed's
own API (bitwise exact resume, same world size and stage), exported and imported through
DeepSpeed's consolidation tool (zero_to_fp32), and refused with a clear error elsewhere."""
import json

import pytest
import torch

from conftest import load_weights, read_metrics, run_python, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

import deepspeed  # noqa: F401,E402  (pinned: a broken install fails, it does not skip)

K = 3
COMMON = ["model=gpt_tiny", "data=text", "trainer.eval_every=0", "data.micro_batch=4", "optim.warmup_steps=2",
          f"trainer.max_steps={2 * K}"]
DS = ["strategy=deepspeed", "strategy.stage=2"]


def test_deepspeed_resume_export_import(tmp_path, deepspeed_ops):
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, 2, *COMMON, *DS, f"checkpoint.every={K}")
    step_k = a / "checkpoints" / f"step_{K:08d}"
    meta = json.loads((step_k / "meta.json").read_text())
    assert meta["strategy"] == "deepspeed" and meta["checkpoint_format"] == "native" and meta["native"]["stage"] == 2
    assert any(f.startswith("deepspeed/") and f.endswith("optim_states.pt") for f in meta["files"])  # checksummed
    # DeepSpeed's recovery scripts are code, not data: removed by the rank that wrote them.
    assert not [p.name for c in (a / "checkpoints").iterdir() for p in c.rglob("*.py")]

    # 1. Exact resume through engine.load_checkpoint.
    proc = run_train(b, 2, *COMMON, *DS, f"checkpoint.resume={step_k}")
    assert f"resumed at step {K}" in proc.stdout + proc.stderr
    assert [r["loss"] for r in read_metrics(a)][K:] == [r["loss"] for r in read_metrics(b)]
    wa, wb = load_weights(a), load_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # 2. Export through zero_to_fp32 equals the live model's weights.
    out = tmp_path / "model.safetensors"
    run_python("-m", "zerolab", "export", str(a / "checkpoints"), "--out", str(out))
    from safetensors.torch import load_file
    got = load_file(str(out))
    assert set(got) == set(wa) - {"lm_head.weight"} and all(torch.equal(got[k], wa[k]) for k in got)

    # 3. Elsewhere (another strategy): a clear error that points at the import path.
    from zerolab.checkpoint import CheckpointError, _check_compatible, model_layout, verify
    from zerolab.config import compose
    from zerolab.models import build_model
    from zerolab.strategies.ddp import DDPStrategy

    cfg = compose(["model=gpt_tiny", "strategy=zero2"])
    strategy = DDPStrategy.__new__(DDPStrategy)
    strategy.ctx = type("Ctx", (), {"world_size": 3})()
    layout = model_layout(build_model(cfg.model, "meta"))
    with pytest.raises(CheckpointError, match=r"DeepSpeed stage-2 checkpoint of 2 ranks loads only into.*"
                                              r"--as-checkpoint") as refused:
        _check_compatible(verify(str(step_k)), str(step_k), cfg, strategy, layout)
    # the run named in the words that set it: strategy.stage belongs to strategy=deepspeed alone
    assert "(this run: strategy=zero2, 3 ranks)" in str(refused.value) and "stage 0" not in str(refused.value)

    # 3b. As format 2 wrote it (no checkpoint_format; DeepSpeed's record under "deepspeed"): still
    # the native format, refused elsewhere with the same advice, exported the same.
    import shutil

    from zerolab.checkpoint import export, meta_text

    v2 = tmp_path / "v2" / step_k.name
    shutil.copytree(step_k, v2)
    old = {k: v for k, v in meta.items() if k not in ("checkpoint_format", "native", "meta_sha256")}
    (v2 / "meta.json").write_text(meta_text({**old, "format_version": 2, "deepspeed": meta["native"]}))
    assert verify(str(v2))["checkpoint_format"] == "native"
    with pytest.raises(CheckpointError, match=r"DeepSpeed stage-2 checkpoint of 2 ranks loads only into"):
        _check_compatible(verify(str(v2)), str(v2), cfg, strategy, model_layout(build_model(cfg.model, "meta")))
    export(str(v2), str(tmp_path / "v2.safetensors"))
    export(str(step_k), str(tmp_path / "v3.safetensors"))
    w2, w3 = load_file(str(tmp_path / "v2.safetensors")), load_file(str(tmp_path / "v3.safetensors"))
    assert w2.keys() == w3.keys() and all(torch.equal(w2[k], w3[k]) for k in w3)

    # 4. Import its weights as a zerolab checkpoint; zero2 on 3 ranks continues from it.
    imported = tmp_path / "imported"
    run_python("-m", "zerolab", "export", str(a / "checkpoints"), "--as-checkpoint", "--out", str(imported))
    c = tmp_path / "c"
    proc = run_train(c, 3, *COMMON[:-1], f"trainer.max_steps={2 * K + 1}", "strategy=zero2",
                     f"checkpoint.resume={imported}")
    text = proc.stdout + proc.stderr
    assert f"resumed at step {2 * K}" in text and "the optimizer state starts fresh" in text
    assert [r["step"] for r in read_metrics(c)] == [2 * K + 1]
