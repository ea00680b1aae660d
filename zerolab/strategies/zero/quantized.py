"""ZeRO++'s quantized collectives (Wang et al. 2023, sections 4.1 and 4.3) for zerolab's zero3
(stage3.py): the collective choices of ZeRO++, beside the layout choices of layout.py.

Block quantization. A tensor is cut into blocks of B = strategy.quant_block elements (the last
one zero-padded); each block gets one fp32 scale s = max|x| / L, and each element the integer
q = round(x / s) in [-L, L]: L = 127 for int8 (qwZ, the weights' all-gather), L = 7 for int4
(qgZ, the gradients' reduce-scatter; two elements per byte, stored as q + 8). Dequantizing
gives q·s, so per element (round to nearest)

    |x̂ − x| <= s / 2 = max|x_block| / (2L):  1/254 of the block's largest magnitude for int8,
                                              1/14 for int4, per quantization

(plus fp32's rounding of the division and the product, 2^-24 relative). A block of zeros stays
exactly zero. The arithmetic after dequantizing is fp32 (then the compute or reduce dtype).

On the wire a quantized part of n elements is [nb fp32 scales | nb·B·bits/8 payload bytes],
nb = ceil(n / B): wire_bytes(n, B, bits) bytes, one uint8 tensor per part, so a collective
moves exactly what it would move between GPUs.

qwZ: each rank quantizes its own chunk, one uint8 all-gather moves every rank's part, and every
rank dequantizes every part (its own too, so all ranks compute with the same weights).

qgZ: ZeRO++'s hierarchical all-to-all replaces the reduce-scatter (its "tensor slice reordering"):
  1. inside the node: the bucket (already divided by N) is reordered so that what local rank l'
     will own across nodes (chunks m·n + l' for every node m) is contiguous, quantized per peer,
     and exchanged by one all-to-all over the node; each rank dequantizes the n parts it got and
     sums them: its node's partial sums of the chunks owned by the ranks with its local index.
  2. across nodes: those M partial chunks are quantized again, one all-to-all over the ranks
     sharing this local index, and the M parts received are dequantized and summed: this
     rank's fully reduced chunk.
So a gradient element is quantized twice: each of the N contributions once in the first hop (n
per node, on M nodes), each of the M node partial sums once in the second; its error is at most
Σ_j s_j / 2 over those N first-hop parts plus Σ_m s'_m / 2 over the M second-hop parts, each
s the scale of the block holding the element in that part (tests/test_nodes.py checks it).
A hop over one rank (one node, or one rank per node) is skipped and quantizes nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

LEVELS = {8: 127, 4: 7}  # bits -> L, the largest |q|


def n_blocks(n: int, block: int) -> int:
    return -(-n // block)


def wire_bytes(n: int, block: int, bits: int) -> int:
    """Bytes of one quantized part of n elements: its fp32 scales, then its payload."""
    nb = n_blocks(n, block)
    return 4 * nb + nb * block * bits // 8


def encode(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Rows of x ([rows, n], any float dtype) quantized: uint8 [rows, wire_bytes(n, block, bits)]."""
    rows, n = x.shape
    nb = n_blocks(n, block)
    v = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
    v[:, :n] = x
    v = v.view(rows, nb, block)
    scale = v.abs().amax(dim=2) / LEVELS[bits]
    # A block of zeros keeps the scale 0 on the wire (its error bound s/2 is 0: error_bound_sq),
    # and divides by 1 to give q = 0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(v / divisor.unsqueeze(2)).clamp_(-LEVELS[bits], LEVELS[bits]).to(torch.int8)
    if bits == 4:
        u = (q + 8).to(torch.uint8).view(rows, nb * block // 2, 2)
        payload = u[:, :, 0] | (u[:, :, 1] << 4)
    else:
        payload = q.view(torch.uint8).view(rows, nb * block)
    return torch.cat([scale.view(torch.uint8).view(rows, 4 * nb), payload], dim=1)


def decode(buf: torch.Tensor, n: int, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """encode's inverse: uint8 [rows, wire] -> (fp32 values [rows, n], fp32 scales [rows, nb])."""
    rows = buf.shape[0]
    nb = n_blocks(n, block)
    scale = buf[:, :4 * nb].clone(memory_format=torch.contiguous_format).view(torch.float32)
    payload = buf[:, 4 * nb:]
    if bits == 4:
        q = torch.stack([(payload & 15).to(torch.int8), (payload >> 4).to(torch.int8)], dim=2) - 8
    else:
        q = payload.contiguous().view(torch.int8)
    x = q.reshape(rows, nb, block).to(torch.float32) * scale.unsqueeze(2)
    return x.view(rows, nb * block)[:, :n], scale


def error_bound_sq(scale: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Σ over n elements of (s/2)²: the square of the bound on ‖x̂ − x‖₂ of parts with these
    scales ([rows, nb]; a last block's padding is not counted). fp64, shape [rows]."""
    nb = scale.shape[1]
    count = torch.full((nb,), float(block), dtype=torch.float64, device=scale.device)
    count[-1] = n - (nb - 1) * block
    return ((scale.double() / 2) ** 2 * count).sum(dim=1)


class FinishedWork:
    """The handle of a collective that has already finished (qgZ runs its two hops blocking, in
    place), queued where the sharder's reduce-scatters queue their asynchronous work (reduce.py)."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def gather_quantized(out: torch.Tensor, chunk: torch.Tensor, group, shards: int, block: int, comm, transient):
    """qwZ: start an int8 all-gather of every rank's `chunk` into `out` (size shards·len(chunk)).
    Returns (work, buffers to keep alive, finish): finish() dequantizes into `out` after the wait
    and returns the square of the bound on ‖ŵ − w‖₂ over the whole bucket."""
    c = chunk.numel()
    mine = encode(chunk.view(1, c), block, 8)
    gathered = torch.empty(shards * mine.numel(), dtype=torch.uint8, device=out.device)
    nbytes = mine.numel() + gathered.numel()
    transient.alloc(nbytes, "backward")
    comm.record("all_gather", gathered, group=group)
    work = dist.all_gather_single(gathered, mine.view(-1), group=group, async_op=True)

    def finish() -> torch.Tensor:
        values, scale = decode(gathered.view(shards, -1), c, block, 8)
        out.view(shards, c).copy_(values)
        transient.free(nbytes)
        return error_bound_sq(scale, c, block).sum()
    return work, (mine, gathered), finish


def reduce_scatter_quantized(out: torch.Tensor, buf: torch.Tensor, layout, block: int, comm, transient) -> None:
    """qgZ (module docstring): this rank's chunk of the sum over ranks of `buf` into `out`, through
    the two quantized all-to-all hops (blocking: they follow one another)."""
    n, m, chunk = layout.per_node, layout.nodes, out.numel()
    # [nodes, per_node, chunk] -> [per_node, nodes·chunk]: row l' holds what local rank l' owns across nodes
    rows = buf.view(m, n, chunk).transpose(0, 1).reshape(n, m * chunk)
    partial = _hop(rows, layout.local_group, block, comm, transient)  # inside the node
    out.copy_(_hop(partial.view(m, chunk), layout.cross_group, block, comm, transient))  # across nodes


def quantized_scatter(layout, block: int, comm, transient):
    """qgZ as the reduction's reduce-scatter (reduce.py's `scatter`): `scatter(out, buf)` runs the
    two hops and returns a finished work, so the reduction lands the chunk in order."""
    def scatter(out: torch.Tensor, buf: torch.Tensor) -> FinishedWork:
        reduce_scatter_quantized(out, buf, layout, block, comm, transient)
        return FinishedWork()
    return scatter


def _hop(rows: torch.Tensor, group: Optional[object], block: int, comm, transient) -> torch.Tensor:
    """One all-to-all: row j to the group's rank j, int4; the received rows dequantized and summed
    in fp32, in rank order. One row (a group of one rank): no exchange, no quantization."""
    if rows.shape[0] == 1:
        return rows[0].to(torch.float32)
    send = encode(rows, block, 4)
    recv = torch.empty_like(send)
    nbytes = 2 * send.numel()
    transient.alloc(nbytes, "backward")
    comm.record("all_to_all", send, group=group)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
    values, _ = decode(recv, rows.shape[1], block, 4)
    transient.free(nbytes)
    return values.sum(dim=0)
