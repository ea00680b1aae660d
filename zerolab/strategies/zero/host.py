"""The host as a place of zerolab's ZeRO shard (storage.py): offload. strategy.offload_optimizer=true
keeps the shard the optimizer updates, its gradient shard and the optimizer state in host memory
and runs the step there (ZeRO-Offload, Ren et al., USENIX ATC 2021); strategy.offload_params=true
(zero3, with it) keeps zero3's persistent chunks there too (ZeRO-Infinity, Rajbhandari et al., SC
2021). Everything that crosses between the host and the device goes through this class, so the
copies (and a later prefetch of them) are tuned here.

Down: each bucket's reduced chunk goes to the host as it completes (on CUDA into a pinned buffer on
a side stream, overlapped with the rest of backward); the host adds it into the gradient shard once
the copy is done, in the order the chunks were reduced, and every copy has been added before the
step reads the shard (settle). Up: the updated weights are rounded to the compute dtype on the host
and copied into their place on the device (zero1/2: this rank's chunk of the bucket's flat weights,
then all-gathered in place; zero3 without offload_params: its persistent chunks); with
offload_params each all-gather copies this rank's chunk to the device first (a transient until the
gather is waited for). The step is decided on the host (a logged step's path, bitwise the device's:
zerolab/numerics.py): the host reads the norm anyway, it runs the update.

On CUDA every host tensor is pinned (page-locked: what the copies need to run asynchronously, and
memory the host cannot swap); without CUDA host and device are the same memory, and the host
tensors are still tensors of their own with explicit copies, so the arithmetic and the bytes are
what a GPU run has (its speed is not: docs/offload.md).
"""
from __future__ import annotations

from collections import deque

import torch

from zerolab.errors import ConfigError
from zerolab.master import derive_weight_, derived_weight


class Host:
    """Host memory: the optimizer's side of the shard under offload, and zero3's chunks with offload_params."""
    name = "host"
    device_step = False  # the step runs here: decided here, and its copies are not the device's transients

    def __init__(self, device_place):
        """`device_place`: the run's storage.Device, through which host tensors reach the collectives."""
        self.on_device, self.device, self.host = device_place, device_place.device, torch.device("cpu")
        self.pinned = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None
        self.arriving: deque = deque()  # (event or None, host copy of a reduced chunk, where it lands), in order
        self.land = None

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.host, pin_memory=self.pinned)

    def gradient(self, shape, dtype: torch.dtype, _whole) -> torch.Tensor:
        return self.zeros(shape, dtype)  # a buffer of its own: the whole gradients are the device's

    # ---- gradients down ---------------------------------------------------------------------
    def delivery(self, land):
        """`land(i, chunk)` adds bucket i's reduced chunk into the gradient shard; what the reduction
        calls instead copies the chunk here first."""
        self.land = land
        return self.arrived

    def arrived(self, i: int, out: torch.Tensor) -> None:
        """Bucket i's reduced chunk `out` (on the device) is complete: copy it here, then land it."""
        staged = torch.empty(out.shape, dtype=out.dtype, device=self.host, pin_memory=self.pinned)
        if self.stream is None:
            staged.copy_(out)
            self.arriving.append((None, staged, i))
        else:  # the side stream waits for the reduction, the host for the copy (_collect)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                staged.copy_(out, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            out.record_stream(self.stream)
            self.arriving.append((event, staged, i))
        self._collect(block=False)

    def settle(self) -> None:
        self._collect(block=True)

    def _collect(self, block: bool) -> None:
        """Land the chunks whose copy is done, in the order they were reduced (so the sums over
        micro-batches are the device's); `block`: wait for every one."""
        while self.arriving and (block or self.arriving[0][0] is None or self.arriving[0][0].query()):
            event, staged, i = self.arriving.popleft()
            if event is not None:
                event.synchronize()
            self.land(i, staged)

    # ---- weights up ---------------------------------------------------------------------------
    def gather_input(self, master: torch.Tensor, weights: torch.Tensor, rounding: str) -> tuple:
        """zero1/2: `master` rounded to the compute dtype here, copied into `weights` (this rank's
        chunk of the bucket on the device): the in-place all-gather's input."""
        weights.copy_(derived_weight(master, weights.dtype, rounding), non_blocking=self.pinned)
        return weights, 0

    def round_into(self, master: torch.Tensor, weights: torch.Tensor, rounding: str, weights_place) -> None:
        """zero3: the persistent chunks follow the updated `master`: in place where they live here
        (offload_params), else rounded here and copied to the device."""
        if weights_place is self:
            derive_weight_(master, weights, rounding)
        else:
            weights.copy_(derived_weight(master, weights.dtype, rounding), non_blocking=self.pinned)

    def take(self, t: torch.Tensor, _source) -> torch.Tensor:
        """zero3's persistent chunks `t`, made here, kept here (pinned on CUDA)."""
        return t.pin_memory() if self.pinned and not t.is_pinned() else t

    def for_gather(self, chunk: torch.Tensor) -> tuple:
        """zero3 with offload_params: this rank's chunk copied to the device for its all-gather, and
        the bytes of that copy (a transient until the gather is waited for)."""
        staged = torch.empty(chunk.shape, dtype=chunk.dtype, device=self.device)
        staged.copy_(chunk, non_blocking=self.pinned)
        return staged, staged.untyped_storage().nbytes()

    def all_reduce(self, t: torch.Tensor, collective):
        """A host tensor goes through a device copy (storage.Device.all_reduce)."""
        return self.on_device.all_reduce(t, collective)


def check_offload(cfg, stage: int) -> None:
    """Refuse, before any rank starts, an offload this sharder cannot run, naming the fix."""
    s, p = cfg.strategy, cfg.precision
    if not (s.offload_optimizer or s.offload_params):
        return
    if s.offload_params and stage < 3:
        raise ConfigError(f"strategy.offload_params=true with strategy={s.name}: zero1 and zero2 keep every weight "
                          "on every rank for the whole step, so there are no parameter shards to keep on the host "
                          "between uses. Use strategy=zero3 with strategy.offload_params=true, or "
                          "strategy.offload_optimizer=true alone")
    if s.offload_params and not s.offload_optimizer:
        raise ConfigError("strategy.offload_params=true without strategy.offload_optimizer=true: the parameter "
                          "shards are what the optimizer step updates, so they live where the step runs; put the "
                          "step on the host too (strategy.offload_optimizer=true), or keep offload_params=false")
    stored = [f"precision.{k}={v}" for k, v in (("master", p.master), ("grad_shard", p.grad_shard)) if v != "fp32"]
    if stored:
        raise ConfigError(f"{' and '.join(stored)} with offload: these store the master (or gradient shard) in "
                          "the device's bf16 weights to save device memory, which offload saves by moving them to "
                          "the host, where the pair would take as many bytes as the fp32 master it replaces. Use "
                          "precision.master=fp32 and precision.grad_shard=fp32 with offload, or turn offload off")
