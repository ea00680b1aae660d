"""Activations measured: the bytes a forward leaves behind for its backward (zerolab.activations
says how they are counted and predicts them). Below the models, which report what activation
checkpointing keeps (keep_for_backward), and the trainer, which measures (ActivationMeter)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from zerolab.accounting.storage import storage_key

_ACTIVE: list["ActivationMeter"] = []  # meters entered and not yet left, innermost last


def _is_parameter(t: torch.Tensor) -> bool:
    """An nn.Parameter or a view of one (a Linear saves weight.t()). Autograd hands the hook the
    Parameter object itself, so this also catches parameters the meter could not list when it
    started: FSDP2's unsharded parameters, DeepSpeed stage 3's gathered ones."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationMeter:
    """`with ActivationMeter(model) as m: loss = ...` -> `m.bytes`: bytes saved for backward by
    that forward, each storage once, parameters and buffers excluded (see the module docstring).
    With enabled=False it installs nothing and reports 0."""

    def __init__(self, model: Optional[nn.Module] = None, enabled: bool = True):
        self.model, self.enabled = model, enabled
        self.bytes = 0
        self.tensors = 0  # saved tensors seen (a storage seen twice counts twice here, once in bytes)
        self._seen: set[int] = set()
        self._hooks = None

    def __enter__(self) -> "ActivationMeter":
        self.bytes, self.tensors, self._seen = 0, 0, set()
        if not self.enabled:
            return self
        if self.model is not None:
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: the rank's shard
                if local.device.type != "meta" and local.untyped_storage().nbytes():
                    self._seen.add(storage_key(local))  # "seen" already: never counted
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            _ACTIVE.remove(self)
            self._hooks.__exit__(*exc)
            self._hooks = None

    def add(self, t: torch.Tensor) -> None:
        """Count `t`'s storage once, unless it is a parameter's or was counted before."""
        self.tensors += 1
        if t.device.type == "meta" or _is_parameter(t):
            return
        key = storage_key(t)
        if key in self._seen:
            return
        self._seen.add(key)
        self.bytes += t.untyped_storage().nbytes()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t`'s storage was counted (or is a parameter's or buffer's)."""
        return t.device.type != "meta" and storage_key(t) in self._seen

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t  # saved as usual: the meter only looks


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def keep_for_backward(*tensors: torch.Tensor) -> None:
    """Tell the active meters (if any) that these tensors stay alive until backward outside
    autograd's saved tensors: activation checkpointing keeps each checkpointed block's input to
    recompute it, and selective checkpointing the op outputs it caches. Free when no meter is
    active."""
    for meter in _ACTIVE:
        for t in tensors:
            meter.add(t)
