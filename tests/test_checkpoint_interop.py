"""What lets one library's checkpoint resume under another, in process: the step counter restored
in the reader's own type, and the refusal of optimizer state a reader cannot hold."""
import pytest
import torch

from zerolab.checkpoint import CheckpointError, optimizer_scalars, restore_optimizer_scalars
from zerolab.strategies.base import kinds_to_load


def test_a_counter_is_restored_in_the_readers_own_type():
    """DeepSpeed's Adam counts in a Python int, torch's and zerolab's in a 0-dim tensor: a counter
    written by either is restored as the reader keeps it, so the reader's own `step += 1` goes on
    counting (an int put where a tensor was would no longer be advanced in place)."""
    written_by_deepspeed = optimizer_scalars([{"step": 7, "exp_avg": torch.zeros(3)}])
    written_by_torch = optimizer_scalars([{"step": torch.tensor(7.0)}])
    assert written_by_deepspeed["step"]["value"] == written_by_torch["step"]["value"] == 7.0
    for written in (written_by_deepspeed, written_by_torch):
        torch_state = {"step": torch.tensor(1.0, dtype=torch.float32)}
        deepspeed_state = {"step": 1}
        restore_optimizer_scalars([torch_state, deepspeed_state], written)
        assert torch_state["step"].dtype == torch.float32 and torch_state["step"].item() == 7.0
        assert type(deepspeed_state["step"]) is int and deepspeed_state["step"] == 7


def test_counters_that_differ_between_parameters_are_refused():
    with pytest.raises(CheckpointError, match="'step' differs between parameters"):
        optimizer_scalars([{"step": 3}, {"step": 4}])


class _Saved:
    """The part of zerolab.checkpoint.PieceReader that kinds_to_load reads: what a checkpoint saved."""
    path, weights_only = "/ck/step_00000003", False

    def __init__(self, kinds):
        self._kinds = kinds

    def kinds(self, name):
        return list(self._kinds)


def test_optimizer_state_a_reader_cannot_hold_is_refused_in_one_paragraph():
    held = ["exp_avg", "exp_avg_sq"]
    assert kinds_to_load(_Saved(["exp_avg_sq", "exp_avg"]), "w", held, "r") == ["exp_avg", "exp_avg_sq"]
    assert kinds_to_load(_Saved([]), "w", held, "r") == []  # nothing saved: the reader's fresh zeros are that state
    with pytest.raises(CheckpointError) as refused:
        kinds_to_load(_Saved(["momentum_buffer"]), "blocks.0.w", held, "optim=adamw under strategy=fsdp")
    said = str(refused.value)
    assert "\n" not in said and said.startswith("/ck/step_00000003: the checkpoint holds optimizer state "
                                                "['momentum_buffer'] for blocks.0.w, and optim=adamw under "
                                                "strategy=fsdp keeps ['exp_avg', 'exp_avg_sq']")
    assert "Resume with the optimizer that wrote it" in said and "--as-checkpoint" in said
