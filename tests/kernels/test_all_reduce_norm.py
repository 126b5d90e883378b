"""The fused all-reduce + residual add + RMSNorm kernel on one device, its peers simulated.

Rank 0 of W runs `kernels.all_reduce_norm.all_reduce_rms_norm`; the other ranks' receive buffers
are plain tensors on the same device and their pushes into rank 0's buffer are written before
the call (what they would have sent). Checked against `reference.all_reduce_rms_norm` over
every rank's rows: the sum and norm, -0.0 sent as +0.0, rank 0's row pushed into every peer's
slot, the rows of the previous call reset to the sentinel (buffer (s + 2) % 3, however many rows
it had), and the phase turning every launch (five calls of varying rows walk the three buffers);
every other call adds L2-prefetch programs (`kernels/l2_prefetch.py`), which change nothing.
Rows are split over several programs where wide enough (hidden 1024, 2048). float32: the
interpreter rounds bfloat16 its own way.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.all_reduce_norm import PeerBuffers, all_reduce_rms_norm, reset_buffer
from kernels.l2_prefetch import l2_hint

SENTINEL = -(1 << 31)  # float32 -0.0's bits


@pytest.mark.parametrize("world,rows,hidden", [(2, 3, 64), (4, 1, 96), (4, 5, 128), (2, 2, 1024), (4, 1, 2048), (2, 1, 20000)])
def test_rank0_sums_norms_pushes_and_resets(device, world, rows, hidden):
    dtype, slot = torch.float32, 4 * 2 * 20480
    elems = slot // 4
    bufs = [torch.empty(PeerBuffers.nbytes(world, slot), dtype=torch.uint8, device=device) for _ in range(world)]
    for b in bufs:
        reset_buffer(b, dtype)
    views = [b.view(torch.int32).view(3, world, elems) for b in bufs]
    peers = PeerBuffers(torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device),
                        torch.zeros(3, dtype=torch.int32, device=device), 0, world, slot, dtype, 128)
    gen = torch.Generator().manual_seed(world * 100 + rows)
    base_rows = rows
    for call in range(5):
        rows = base_rows + (call % 3 == 1)  # a call with one row more, then fewer again
        xs = [torch.randn(rows, hidden, generator=gen) for _ in range(world)]
        xs[0][0, :2] = -0.0
        xs[-1][-1, -3:] = -0.0
        residual = torch.randn(rows, hidden, generator=gen) if call % 2 == 0 else None
        weight = 1 + 0.1 * torch.randn(hidden, generator=gen)
        phase = call % 3
        assert int(peers.state[0]) == phase
        # What every rank pushed into rank 0's buffer, rank 0 included: the interpreter runs one
        # program at a time, so the first of a row's programs would wait forever for its siblings'
        # share of rank 0's own row (on a GPU they run at once; the kernel writes the same bits).
        for r in range(world):
            bits = xs[r].view(torch.int32).reshape(-1).clone()
            bits[bits == SENTINEL] = 0
            views[0][phase, r, : rows * hidden] = bits.to(device)
        # odd calls warm "L2" with a weight's first lines from added programs: the same answers
        hint = l2_hint(torch.zeros(777, 33, device=device), 9000) if call % 2 else None
        normed, new_res = all_reduce_rms_norm(xs[0].to(device), weight.to(device), 1e-5,
                                              None if residual is None else residual.to(device), False, peers, hint)
        want_normed, want_res = reference.all_reduce_rms_norm(xs, weight, 1e-5, residual)
        assert torch.equal(new_res.cpu(), want_res)
        torch.testing.assert_close(normed.cpu(), want_normed, atol=1e-5, rtol=1e-5)
        sent = xs[0].view(torch.int32).reshape(-1).clone()
        sent[sent == SENTINEL] = 0  # -0.0 went as +0.0
        for r in range(1, world):
            assert torch.equal(views[r][phase, 0, : rows * hidden].cpu(), sent)
            views[r][(phase + 2) % 3].fill_(SENTINEL)  # what rank r resets in its own call
        assert bool((views[0][(phase + 2) % 3] == SENTINEL).all())  # the previous call's rows, reset
        assert not bool((views[0][phase, :, : rows * hidden] == SENTINEL).any())  # this call's, kept
        assert bool((views[0][phase, :, rows * hidden:] == SENTINEL).all())
        assert peers.state.tolist() == [(phase + 1) % 3, 0, rows]


def test_peer_buffers_fit_only_their_dtype_and_slot(device):
    peers = PeerBuffers(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), 1, 2, 1024,
                        torch.bfloat16, 3)
    assert peers.fits(torch.zeros(2, 256, dtype=torch.bfloat16))
    assert not peers.fits(torch.zeros(2, 257, dtype=torch.bfloat16))  # over the slot
    assert not peers.fits(torch.zeros(1, 16, dtype=torch.float32))  # the buffers hold bf16's sentinel
    assert not peers.fits(torch.zeros(4, 16, dtype=torch.bfloat16))  # more rows than programs at once
    assert PeerBuffers.nbytes(4, 1024) == 3 * 4 * 1024
