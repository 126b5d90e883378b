"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm that follow it: one launch.

In every Llama-style layer a row-parallel projection (o_proj, down_proj; the vocab-parallel
embedding) leaves each rank a partial sum that is all-reduced and then, at once, added to the
residual stream and RMSNorm-ed. At decode sizes (one 8-16 KiB row per sequence) the all-reduce
is latency: two barriers over NVLink in a one-shot kernel (~10 us on H100), then a norm launch.

Here each rank pushes its partial rows straight into a slot of every rank's receive buffer
(peer-to-peer stores), and every rank polls its own buffer until no element still holds the
sentinel (-0.0, which senders never send: their -0.0 goes as +0.0, the same number), so no
barrier is needed (a "Lamport" exchange). A row is split over C programs (`_split`): each
pushes its 1/C of the row (one SM's stores over NVLink are slow: spread them), and each reads
the whole row from every slot (local reads) to norm it, writing its 1/C of the results.

Three buffers rotate, so no program resets what a sibling may still be reading: during call s a
rank receives into buffer s % 3 and resets, in buffer (s + 2) % 3, the rows that call s - 1 used
(their count is kept in `state`). Peers write that buffer again only in call s + 2, which they
reach only after receiving this rank's call s + 1 rows, sent after this launch ended; and the
rows call s receives were reset during call s - 2. The phase, the arrivals and the last row count
live in device memory (`state`), updated by the last program of each launch, so a CUDA graph
replays them right. Every program sums the slots in rank order 0..W-1 in fp32: every rank gets
bitwise the same rows, deterministically. All C x rows programs must be resident at once (they
wait on each other through the peers): the launcher keeps the grid within one wave.

Then, in the same program: the sum is rounded to the input dtype (what the all-reduce would
return), added to the residual and rounded (the new residual), and normed as `kernels/rms_norm.py`
does. Without a residual (the first layer's input) the sum itself becomes the residual. The
reference: `reference.all_reduce_rms_norm` over every rank's partials.

A row-parallel GEMV may push its output rows itself, from its epilogue, as each tile is done
(`push_partial`; `kernels/fp8_gemv.py` with `push=`): the launch after it then runs with
`pushed=True` and only resets, receives and norms. The pushed bits are the ones this kernel would
push (the GEMV's output rounded to the dtype, -0.0 as +0.0), so the result is bitwise the same; the
exchange starts while the GEMV's last tiles still run instead of after its launch ended.

With an `L2Hint` (`prefetch`, decode-sized calls) the grid has extra rows of programs past the
data's: they wait for the previous kernel, prefetch their share of the next weight's first bytes
into L2 while the exchange goes on, and exit; they take no part in the exchange or the state, and
wait on no sibling, so the one-wave rule concerns the data's programs only.

Layout of each rank's receive buffer (`PeerBuffers.nbytes`): [3 phases][W slots][slot_elems], the
sentinel everywhere before the first call (`reset_buffer`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.l2_prefetch import L2Hint, hint_launch, prefetch_share
from kernels.pdl import launch_options, release_dependents, wait_upstream
from kernels.rms_norm import normed_row

PHASES = 3  # receive into buffer s % 3, reset what call s - 1 used in (s + 2) % 3: see the module docstring
_MIN_CHUNK = 512  # elements a program pushes, at the least
# Programs per launch beyond which rows are not split: run 37 (4x H100) measured 1 row x 8 programs at
# 6.7 us (one program: 7.7) but 8 rows x 8 at 13.9 us (8 x 1: 8.3), every program of a row polling it whole.
_SPLIT_PROGRAMS = 16
_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


@dataclass(frozen=True)
class PeerBuffers:
    """What one rank's launches need to reach every rank's receive buffer.

    Exists so the kernel's callers (serving/executor/custom_all_reduce.py) hand over one checked
    object: the peer addresses from the symmetric-memory rendezvous, the phase counter, and the
    sizes every rank agreed on.
    """

    peer_ptrs: torch.Tensor  # int64 [world_size]: each rank's receive buffer, on this rank's device
    state: torch.Tensor  # int32 [3]: the phase (0..2), the programs arrived this launch, the last call's rows
    rank: int
    world_size: int
    slot_bytes: int  # one sender's slot in one phase
    dtype: torch.dtype  # the buffers hold this dtype's sentinel: the only dtype they carry
    max_programs: int  # programs that surely run at once (the GPU's SMs): every program waits on others

    def __post_init__(self) -> None:
        assert self.peer_ptrs.dtype == torch.int64 and self.peer_ptrs.shape == (self.world_size,)
        assert self.state.dtype == torch.int32 and self.state.numel() == 3
        assert 0 <= self.rank < self.world_size and self.slot_bytes % 16 == 0

    @staticmethod
    def nbytes(world_size: int, slot_bytes: int) -> int:
        """The receive buffer each rank allocates (symmetric: the same on every rank)."""
        return PHASES * world_size * slot_bytes

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.numel() * x.element_size() <= self.slot_bytes
                and x.shape[0] <= self.max_programs)


@triton.jit
def push_partial(values, offs, mask, phase, peers_ptr, rank, slot_elems, W: tl.constexpr):
    # Store `values` (the data dtype) at element offsets `offs` (row * N + column) of this rank's slot
    # of phase `phase` in every rank's receive buffer, its own included, as raw bits; -0.0 goes as
    # +0.0 (the same number), so no element sent is ever the sentinel.
    BITS: tl.constexpr = values.dtype.primitive_bitwidth
    INT: tl.constexpr = tl.int16 if BITS == 16 else tl.int32
    SENTINEL: tl.constexpr = -(1 << (BITS - 1))
    bits = values.to(INT, bitcast=True)
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)
    at = (phase * W + rank) * slot_elems + offs
    for p in tl.static_range(W):
        peer = tl.load(peers_ptr + p).to(tl.pointer_type(INT))
        tl.store(peer + at, bits, mask=mask)


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr,  # [T, N] this rank's partial sums
    residual_ptr,  # [T, N] (only read with HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [T, N] normed
    residual_out_ptr,  # [T, N] the new residual (the sum, plus the old residual)
    peers_ptr,  # int64 [W] receive buffers' addresses
    state_ptr,  # int32 [3]
    rank,
    num_rows,
    stride_x,
    stride_r,
    slot_elems,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,  # the row, padded to a power of two
    CHUNK: tl.constexpr,  # this program's share of the row: BLOCK // C
    W: tl.constexpr,
    INT: tl.constexpr,  # the integer type of the data's bits
    SENTINEL: tl.constexpr,  # -0.0's bits as INT
    POLL_2D: tl.constexpr,  # poll every slot at once ([W, BLOCK] in registers) rather than one by one
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    PUSHED: tl.constexpr,  # the GEMV that made x pushed it already (`push_partial`): x is not read
    hint_ptr,  # uint8: the next weight's bytes (only with HINT)
    hint_lines,
    HINT: tl.constexpr,  # program rows past num_rows warm L2 with the next weight (kernels/l2_prefetch.py)
    HINT_ASM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # Before the previous kernel ends: what never changes (the norm's weight, the buffers' addresses).
    w_row = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    mine = tl.load(peers_ptr + rank).to(tl.pointer_type(INT))
    wait_upstream(PDL)  # the partials, the state and the residual come from earlier kernels
    row = tl.program_id(0)
    part = tl.program_id(1)
    if row < num_rows:
        _reduce_norm_share(x_ptr, residual_ptr, out_ptr, residual_out_ptr, peers_ptr, state_ptr, mine, w_row, row,
                           part, rank, num_rows, stride_x, stride_r, slot_elems, eps, N, BLOCK, CHUNK, W, INT,
                           SENTINEL, POLL_2D, HAS_RESIDUAL, UNIT_OFFSET, PUSHED)
    elif HINT:
        # the exchange barely touches HBM: the next weight's first bytes arrive meanwhile
        C: tl.constexpr = BLOCK // CHUNK
        prefetch_share(hint_ptr, hint_lines, (row - num_rows) * C + part, (tl.num_programs(0) - num_rows) * C,
                       HINT_ASM)


@triton.jit
def _reduce_norm_share(x_ptr, residual_ptr, out_ptr, residual_out_ptr, peers_ptr, state_ptr, mine, w_row, row, part,
                       rank, num_rows, stride_x, stride_r, slot_elems, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                       CHUNK: tl.constexpr, W: tl.constexpr, INT: tl.constexpr, SENTINEL: tl.constexpr,
                       POLL_2D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                       PUSHED: tl.constexpr):
    # Program (row, part): reset, push (unless PUSHED), receive, sum and norm its share of the row
    # (module docstring).
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    C: tl.constexpr = BLOCK // CHUNK
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    phase = tl.load(state_ptr)  # the same in every program: only the last one to arrive changes state
    prev_rows = tl.load(state_ptr + 2)
    cols = part * CHUNK + tl.arange(0, CHUNK)  # this program's share
    cmask = cols < N
    csent = tl.full([CHUNK], SENTINEL, INT)
    # Reset this share of the rows call s - 1 received (buffer (phase + 2) % 3), every slot.
    reset = mine + ((phase + 2) % 3) * W * slot_elems
    for r in range(row, prev_rows, num_rows):
        for s in tl.static_range(W):
            tl.store(reset + s * slot_elems + r * N + cols, csent, mask=cmask)
    if not PUSHED:  # push this share of the row into this rank's slot of every rank's buffer
        part_x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cmask, other=0.0)
        push_partial(part_x, row * N + cols, cmask, phase, peers_ptr, rank, slot_elems, W)
    # Meanwhile: what the norm needs besides the sum.
    if HAS_RESIDUAL:
        r_row = tl.load(residual_ptr + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    # Receive the whole row from every slot, once none of its elements holds the sentinel.
    here = mine + phase * W * slot_elems + row * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if POLL_2D:
        slots = tl.arange(0, W)
        src = here + slots[:, None] * slot_elems + offs[None, :]
        m2 = (slots[:, None] < W) & mask[None, :]
        v = tl.load(src, mask=m2, other=0, volatile=True)
        while tl.max(tl.max((v == SENTINEL).to(tl.int32), axis=1), axis=0) > 0:
            v = tl.load(src, mask=m2, other=0, volatile=True)
        f = v.to(DTYPE, bitcast=True).to(tl.float32)
        for s in tl.static_range(W):  # rank order: one slot at a time (x + 0 is exact)
            acc += tl.sum(tl.where(slots[:, None] == s, f, 0.0), axis=0)
    else:
        sent = tl.full([BLOCK], SENTINEL, INT)
        for s in tl.static_range(W):
            src = here + s * slot_elems + offs
            v = tl.load(src, mask=mask, other=0, volatile=True)
            while tl.max((v == sent).to(tl.int32), axis=0) > 0:
                v = tl.load(src, mask=mask, other=0, volatile=True)
            acc += v.to(DTYPE, bitcast=True).to(tl.float32)
    total = acc.to(DTYPE)  # what the all-reduce returns
    if HAS_RESIDUAL:
        total = (total.to(tl.float32) + r_row).to(DTYPE)
    normed = normed_row(total.to(tl.float32), w_row, DTYPE, eps, N, UNIT_OFFSET)
    # Write this program's share: pick its columns out of the full row.
    mine_cols = (offs >= part * CHUNK) & (offs < part * CHUNK + CHUNK) & mask
    tl.store(residual_out_ptr + row.to(tl.int64) * N + offs, total, mask=mine_cols)
    tl.store(out_ptr + row.to(tl.int64) * N + offs, normed, mask=mine_cols)
    # The last program of this launch moves the state on (all others have read it by now).
    arrived = tl.atomic_add(state_ptr + 1, 1)
    if arrived == num_rows * C - 1:
        tl.store(state_ptr, (phase + 1) % 3)
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr + 2, num_rows)


def _split(num_rows: int, hidden: int, max_programs: int) -> int:
    """Programs per row C (a power of two): up to 8, chunks of >= _MIN_CHUNK, at most _SPLIT_PROGRAMS
    in all (and one wave)."""
    c = 1
    while (c < 8 and hidden // (2 * c) >= _MIN_CHUNK
           and num_rows * 2 * c <= min(_SPLIT_PROGRAMS, max_programs)):
        c *= 2
    return c


def all_reduce_rms_norm(
    x: torch.Tensor,  # [T, N] this rank's partial sums
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None,  # [T, N], or None: the sum becomes the residual
    unit_offset: bool,
    peers: PeerBuffers,
    prefetch: L2Hint | None = None,  # the next weight: warmed in L2 by added programs (decode-sized calls)
    pushed: bool = False,  # the GEMV that made x pushed its rows already (`push_partial`): x is not read
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
    c = _split(num_rows, hidden, peers.max_programs)
    pdl = launch_options(x)
    hint_ptr, hint_lines, hint_programs, hint = hint_launch(prefetch, num_rows, x)
    _all_reduce_rms_norm_kernel[(num_rows + triton.cdiv(hint_programs, c), c)](
        x, residual if residual is not None else x, weight, out, residual_out, peers.peer_ptrs, peers.state,
        peers.rank, num_rows, x.stride(0), residual.stride(0) if residual is not None else 0,
        peers.slot_bytes // x.element_size(), eps,
        N=hidden, BLOCK=block, CHUNK=block // c, W=peers.world_size, INT=tl.int16 if bits == 16 else tl.int32,
        SENTINEL=-(1 << (bits - 1)), POLL_2D=peers.world_size * block <= 32768, HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset, PUSHED=pushed, hint_ptr=hint_ptr, hint_lines=hint_lines, **hint,
        num_warps=min(16, max(4, block // 256)), **pdl,
    )
    return out, residual_out


def reset_buffer(buffer: torch.Tensor, dtype: torch.dtype) -> None:
    """Fill a receive buffer with the sentinel of `dtype` (before first use; then a barrier)."""
    bits = _BITS[dtype]
    flat = buffer.view(torch.int16 if bits == 16 else torch.int32)
    flat.fill_(-(1 << (bits - 1)))
