"""zerolab.ds_ops finds DeepSpeed's prebuilt ops in either layout torch uses, and says what is missing."""
from zerolab import ds_ops


def test_built_ops_in_both_layouts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ds_ops.ops_dir() == str(tmp_path)
    assert set(ds_ops.built_ops().values()) == {False}
    reason = ds_ops.missing_reason()
    assert "deepspeed_shm_comm" in reason and "fused_adam" in reason and "make install" in reason
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").write_bytes(b"")  # TORCH_EXTENSIONS_DIR layout
    (tmp_path / "py311_cpu" / "deepspeed_shm_comm").mkdir(parents=True)  # torch's default cache layout
    (tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert ds_ops.built_ops() == {"deepspeed_shm_comm": True, "fused_adam": True}
    assert ds_ops.missing_reason() is None
