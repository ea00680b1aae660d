"""Offload in zerolab's own ZeRO: the optimizer's side on the host (ZeRO-Offload, Ren et al.,
USENIX ATC 2021) and, for zero3, the parameter shards on the host between uses (ZeRO-Infinity,
Rajbhandari et al., SC 2021). Mixed into ZeroBase (base.py); stage3.py asks it for its persistent
chunks and their refresh.

strategy.offload_optimizer=true: the shard the optimizer updates (the fp32 master, or the 16-bit
weights' own copy in fp32 training and bf16_pure: on the host it is a copy of its own), its
gradient shard and the optimizer state live in host memory, and the optimizer step runs there
(zerolab's optimizers: torch's fused CPU Adam/AdamW kernel where it applies, LAMB and the others
with their own update). Each bucket's reduce-scattered chunk goes to the host as it completes
(_arrived: on CUDA into a pinned buffer on a side stream, overlapped with the rest of backward;
the host adds it into the gradient shard once the copy is done). After the step the updated
weights, rounded to the compute dtype on the host, go back into this rank's chunk on the device
(zero1/2: the chunk of the bucket's flat weights, then all-gathered in place; zero3: the
persistent chunks). The step is decided on the host (a logged step's path, bitwise the device's:
zerolab/numerics.py): the host reads the norm anyway, it runs the update.

strategy.offload_params=true (zero3, with offload_optimizer): the persistent chunks themselves
live on the host (in fp32 training they are the host's shard, as they are the shard on the device
without offload); each all-gather first copies this rank's chunk to the device (a transient until
the gather is waited for), unit by unit, with the prefetch as without offload.

On CUDA every host tensor is pinned (page-locked: what the copies need to run asynchronously, and
memory the host cannot swap); without CUDA host and device are the same memory, and the host
tensors are still tensors of their own with explicit copies, so the arithmetic and the bytes
are what a GPU run has (its speed is not: docs/offload.md).
"""
from __future__ import annotations

from collections import deque

import torch

from zerolab.errors import ConfigError
from zerolab.master import derived_weight


class Offload:
    """What offload adds to ZeroBase; everything here is a no-op without it."""

    def _offload_setup(self) -> None:
        self.offload_optimizer = bool(getattr(self.settings, "offload_optimizer", False))
        self.offload_params = bool(getattr(self.settings, "offload_params", False))
        self.host = torch.device("cpu")
        self.pinned = self.offload_optimizer and self.ctx.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.ctx.device) if self.pinned else None
        self.to_host: deque = deque()  # (event or None, host copy of a reduced chunk, bucket), in order

    @property
    def shard_device(self) -> torch.device:
        """Where the optimizer's shard, its gradient and its state live."""
        return self.host if self.offload_optimizer else self.ctx.device

    def _shard_zeros(self, n, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.shard_device, pin_memory=self.pinned)

    # ---- gradients down ---------------------------------------------------------------------
    def _arrived(self, b, out: torch.Tensor) -> None:
        """Bucket b's reduced chunk `out` is complete: into the gradient shard (_collect), on the
        host under offload, after an explicit copy there."""
        if not self.offload_optimizer:
            return self._collect(b, out)
        staged = torch.empty(out.shape, dtype=out.dtype, device=self.host, pin_memory=self.pinned)
        if self.copy_stream is None:
            staged.copy_(out)
            self.to_host.append((None, staged, b))
        else:  # the side stream waits for the reduction, the host for the copy (_host_collect)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.ctx.device))
            with torch.cuda.stream(self.copy_stream):
                staged.copy_(out, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            out.record_stream(self.copy_stream)
            self.to_host.append((event, staged, b))
        self._host_collect(block=False)

    def _host_collect(self, block: bool) -> None:
        """Add the chunks that reached the host into the gradient shard, in the order they were
        reduced (so the sums over micro-batches are the device's); `block`: wait for all."""
        while self.to_host and (block or self.to_host[0][0] is None or self.to_host[0][0].query()):
            event, staged, b = self.to_host.popleft()
            if event is not None:
                event.synchronize()
            self._collect(b, staged)

    # ---- the step on the host ---------------------------------------------------------------
    def _decides_on_device(self, grads) -> bool:
        return False if self.offload_optimizer else super()._decides_on_device(grads)

    def _note_working_copies(self) -> None:
        if not self.offload_optimizer:  # on the host they are not the device's transients
            super()._note_working_copies()

    def _on_device(self, t: torch.Tensor, collective) -> None:
        """Run an in-place collective on `t`; a host tensor goes through a device copy (NCCL
        reduces device memory only; gloo, on this CPU, takes the host tensor itself)."""
        if t.device == self.ctx.device:
            return collective(t)
        d = t.to(self.ctx.device)
        collective(d)
        t.copy_(d)

    # ---- weights up ---------------------------------------------------------------------------
    @torch.no_grad()
    def _weights_to_device(self, b) -> torch.Tensor:
        """zero1/2: this rank's updated chunk of bucket b, rounded to the compute dtype on the host,
        copied into its place in the device's flat weights: the in-place all-gather's input."""
        lo = self.shard_rank * b.chunk
        chunk = b.flat_params[lo:lo + b.chunk]
        chunk.copy_(derived_weight(self._shard_chunk(b), chunk.dtype, self.precision.weight_rounding),
                    non_blocking=self.pinned)
        return chunk

    def _make_local(self, written: list[torch.Tensor]) -> list[torch.Tensor]:
        """zero3's persistent chunks: `written` (what the step writes, or its compute-dtype twin)
        where they live; with the optimizer alone on the host, a device copy of each."""
        if not self.offload_optimizer:
            return written
        if self.offload_params:
            return [w.pin_memory() if self.pinned and not w.is_pinned() else w for w in written]
        return [w.to(self.ctx.device, copy=True) for w in written]

    @torch.no_grad()
    def _local_to_device(self) -> bool:
        """zero3 with the optimizer alone on the host: the device's chunks follow the host's
        updated shards (rounded on the host). False where the chunks are the host's own."""
        if not self.offload_optimizer or self.offload_params:
            return False
        for g, local in zip(self.groups, self.local):
            local.copy_(derived_weight(g.master.data, local.dtype, self.precision.weight_rounding),
                        non_blocking=self.pinned)
        return True

    def _staged_chunk(self, i: int, chunk: torch.Tensor) -> torch.Tensor:
        """zero3 with its chunks on the host: chunk i copied to the device for its all-gather,
        alive (a transient of the backward moment) until the gather is waited for."""
        if chunk.device == self.ctx.device and not self.offload_params:
            return chunk
        staged = torch.empty(chunk.shape, dtype=chunk.dtype, device=self.ctx.device)
        staged.copy_(chunk, non_blocking=self.pinned)
        self._gather_input_bytes[i] = staged.untyped_storage().nbytes()
        self.transient.alloc(self._gather_input_bytes[i], "backward")
        return staged

    @property
    def shard_place(self) -> str:
        """Where memory() counts the optimizer's shard, its gradient and its state."""
        return "host" if self.offload_optimizer else "device"


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
