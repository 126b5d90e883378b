"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm that follow it: one launch.

In every Llama-style layer a row-parallel projection (o_proj, down_proj; the vocab-parallel
embedding) leaves each rank a partial sum that is all-reduced and then, at once, added to the
residual stream and RMSNorm-ed. At decode sizes (one 8-16 KiB row per sequence) the all-reduce
is latency: two barriers over NVLink in a one-shot kernel (~10 us on H100), then a norm launch.

Here each rank pushes its partial rows straight into a slot of every rank's receive buffer
(peer-to-peer stores), and every rank polls its own buffer until no element still holds the
sentinel (-0.0, which senders never send: their -0.0 goes as +0.0, the same number), so no
barrier is needed (a "Lamport" exchange). Two buffers alternate: during call s a rank receives
into buffer s % 2 and, once it has read a row, resets it to the sentinel; peers write that
buffer again only in call s + 2, which they reach only after receiving this rank's call s + 1
rows, sent after this launch ended (and a peer wrote into this rank's buffer in call s only
after this rank's call s - 2, which reset it, had ended). The phase s % 2 lives in device
memory (`state`), advanced by the last program of each launch, so a CUDA graph replays the
right phase. Ranks sum in rank order 0..W-1 in fp32:
every rank gets bitwise the same rows, deterministically.

Then, in the same program (one per row): the sum is rounded to the input dtype (what the
all-reduce would return), added to the residual and rounded (the new residual), and normed as
`kernels/rms_norm.py` does. Without a residual (the first layer's input) the sum itself becomes
the residual. The reference: `reference.all_reduce_rms_norm` over every rank's partials.

Layout of each rank's receive buffer (`PeerBuffers.nbytes`): [2 phases][W slots][slot_elems], the
sentinel everywhere between calls (`reset_buffer` once, before the first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.rms_norm import normed_row

PHASES = 2  # receive into buffer s % 2: see the module docstring
_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


@dataclass(frozen=True)
class PeerBuffers:
    """What one rank's launches need to reach every rank's receive buffer.

    Exists so the kernel's callers (serving/executor/custom_all_reduce.py) hand over one checked
    object: the peer addresses from the symmetric-memory rendezvous, the phase counter, and the
    sizes every rank agreed on.
    """

    peer_ptrs: torch.Tensor  # int64 [world_size]: each rank's receive buffer, on this rank's device
    state: torch.Tensor  # int32 [2]: the current phase (0, 1) and the programs arrived in this launch
    rank: int
    world_size: int
    slot_bytes: int  # one sender's slot in one phase
    dtype: torch.dtype  # the buffers hold this dtype's sentinel: the only dtype they carry

    def __post_init__(self) -> None:
        assert self.peer_ptrs.dtype == torch.int64 and self.peer_ptrs.shape == (self.world_size,)
        assert self.state.dtype == torch.int32 and self.state.numel() == 2
        assert 0 <= self.rank < self.world_size and self.slot_bytes % 16 == 0

    @staticmethod
    def nbytes(world_size: int, slot_bytes: int) -> int:
        """The receive buffer each rank allocates (symmetric: the same on every rank)."""
        return PHASES * world_size * slot_bytes

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() * x.element_size() <= self.slot_bytes


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr,  # [T, N] this rank's partial sums
    residual_ptr,  # [T, N] (only read with HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [T, N] normed
    residual_out_ptr,  # [T, N] the new residual (the sum, plus the old residual)
    peers_ptr,  # int64 [W] receive buffers' addresses
    state_ptr,  # int32 [2]
    rank,
    num_rows,
    stride_x,
    stride_r,
    slot_elems,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    W: tl.constexpr,
    INT: tl.constexpr,  # the integer type of the data's bits
    SENTINEL: tl.constexpr,  # -0.0's bits as INT
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    phase = tl.load(state_ptr)  # the same in every program: only the last one to arrive advances it
    sentinel = tl.full([BLOCK], SENTINEL, INT)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    bits = x.to(INT, bitcast=True)
    bits = tl.where(bits == sentinel, tl.zeros_like(bits), bits)  # -0.0 goes as +0.0: never the sentinel
    at = row * N + offs  # this row's place within a slot
    # Push this rank's row into its slot of every rank's current buffer (its own included).
    for p in tl.static_range(W):
        peer = tl.load(peers_ptr + p).to(tl.pointer_type(INT))
        tl.store(peer + (phase * W + rank) * slot_elems + at, bits, mask=mask)
    # Receive every slot in rank order, once none of its elements holds the sentinel; then reset it.
    mine = tl.load(peers_ptr + rank).to(tl.pointer_type(INT))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(W):
        src = mine + (phase * W + s) * slot_elems + at
        v = tl.load(src, mask=mask, other=0, volatile=True)
        while tl.max((v == sentinel).to(tl.int32), axis=0) > 0:
            v = tl.load(src, mask=mask, other=0, volatile=True)
        tl.store(src, sentinel, mask=mask)
        acc += v.to(DTYPE, bitcast=True).to(tl.float32)
    total = acc.to(DTYPE)  # what the all-reduce returns
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        total = (total.to(tl.float32) + r).to(DTYPE)
    tl.store(residual_out_ptr + row.to(tl.int64) * N + offs, total, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * N + offs,
             normed_row(total.to(tl.float32), weight_ptr, offs, mask, eps, N, UNIT_OFFSET, DTYPE), mask=mask)
    # The last program of this launch advances the phase (all others have read it by now).
    arrived = tl.atomic_add(state_ptr + 1, 1)
    if arrived == num_rows - 1:
        tl.store(state_ptr, 1 - phase)
        tl.store(state_ptr + 1, 0)


def all_reduce_rms_norm(
    x: torch.Tensor,  # [T, N] this rank's partial sums
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None,  # [T, N], or None: the sum becomes the residual
    unit_offset: bool,
    peers: PeerBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) of sum-over-ranks(x) (+ residual); every rank of the group must call
    it with the same shapes, in the same order. `x` must fit one slot (`peers.fits`)."""
    assert (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and x.dim() == 2 and x.stride(1) == 1, (x.device, x.stride())
    num_rows, hidden = x.shape
    assert x.dtype in _BITS and weight.dtype == x.dtype and weight.shape == (hidden,) and weight.is_contiguous()
    assert peers.fits(x), (tuple(x.shape), x.dtype, peers.slot_bytes, peers.dtype)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    if num_rows == 0:
        return out, residual_out
    bits = _BITS[x.dtype]
    block = triton.next_power_of_2(hidden)
    _all_reduce_rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, residual_out, peers.peer_ptrs, peers.state,
        peers.rank, num_rows, x.stride(0), residual.stride(0) if residual is not None else 0,
        peers.slot_bytes // x.element_size(), eps,
        N=hidden, BLOCK=block, W=peers.world_size, INT=tl.int16 if bits == 16 else tl.int32,
        SENTINEL=-(1 << (bits - 1)), HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
        num_warps=min(16, max(4, block // 256)),
    )
    return out, residual_out


def reset_buffer(buffer: torch.Tensor, dtype: torch.dtype) -> None:
    """Fill a receive buffer with the sentinel of `dtype` (before first use; then a barrier)."""
    bits = _BITS[dtype]
    flat = buffer.view(torch.int16 if bits == 16 else torch.int32)
    flat.fill_(-(1 << (bits - 1)))
