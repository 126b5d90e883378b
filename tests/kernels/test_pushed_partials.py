"""Row-parallel GEMVs that push their rows into the fused all-reduce's buffers (`push_partial`).

W ranks are simulated on one device: every rank's receive buffer is a plain tensor, each rank runs
`fp8_gemv(..., push=its PeerBuffers)` on its own weight slice, then each rank's
`all_reduce_rms_norm(..., pushed=True)` sums and norms. Checked against the unpushed path (the GEMV
writes its output, the fused kernel pushes it) and `reference.all_reduce_rms_norm` over the
GEMVs' outputs: bitwise the same rows on every rank, the buffers turned over as in unpushed calls
(three phases walked by four calls; rows past the pushed ones still the sentinel), split-K tiles
(the last split pushes), bias, FP8 and bf16 weights, M = 1 and 2, an odd hidden size. Float32
activations on CPU (the interpreter), bf16 on CUDA. The guards: a gated GEMV or a slot too small
is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference, reference
from kernels.all_reduce_norm import PeerBuffers, all_reduce_rms_norm, reset_buffer
from kernels.fp8_gemv import MODE_ACC, MODE_ROWSUM, GemvConfig, fp8_gemv

SLOT = 16 * 1024  # bytes a sender's slot holds


def _group(world: int, dtype: torch.dtype, device: str) -> tuple[list[PeerBuffers], list[torch.Tensor]]:
    bufs = [torch.empty(PeerBuffers.nbytes(world, SLOT), dtype=torch.uint8, device=device) for _ in range(world)]
    for b in bufs:
        reset_buffer(b, dtype)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    peers = [PeerBuffers(ptrs, torch.zeros(3, dtype=torch.int32, device=device), r, world, SLOT, dtype, 128)
             for r in range(world)]
    return peers, bufs


CASES = [
    # (world, M, N (hidden), K per rank, weight, bias, config)
    (2, 1, 96, 256, "bf16", False, GemvConfig(MODE_ACC, 8, 64, 1, 1, 4, 1)),
    (4, 2, 72, 128, "bf16", True, GemvConfig(MODE_ACC, 16, 32, 1, 2, 4, 1)),  # split-K: the last split pushes
    (2, 1, 100, 192, "fp8", True, GemvConfig(MODE_ROWSUM, 16, 32, 2, 3, 4, 1)),  # N tail, split 3
]


@pytest.mark.parametrize("world, M, N, K, kind, with_bias, config", CASES)
def test_pushed_rows_sum_as_unpushed(device, world, M, N, K, kind, with_bias, config):
    act = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(world * 1000 + N + K)
    pushed_peers, pushed_bufs = _group(world, act, device)
    plain_peers, plain_bufs = _group(world, act, device)
    ints = torch.int16 if act == torch.bfloat16 else torch.int32
    norm_w = (1 + 0.1 * torch.randn(N, generator=gen)).to(act).to(device)
    for call in range(4):  # three phases, and back to the first
        weights, scales = [], []
        for _ in range(world):
            w = torch.randn(N, K, generator=gen)
            if kind == "fp8":
                q, s = quant_reference.quantize_fp8(w)
                weights.append(q.to(device))
                scales.append(s.to(device))
            else:
                weights.append(w.to(torch.bfloat16).to(device))
                scales.append(None)
        xs = [torch.randn(M, K, generator=gen).to(act).to(device) for _ in range(world)]
        xs[0][0, :8] = 0.0  # rows with zeros: -0.0 products must arrive as +0.0, never the sentinel
        bias = torch.randn(N, generator=gen).to(act).to(device) if with_bias else None
        residual = torch.randn(M, N, generator=gen).to(act).to(device) if call % 2 else None
        # unpushed: each GEMV writes its rows, the fused kernel pushes them
        partials = [fp8_gemv(xs[r], weights[r], scales[r], bias if r == 0 else None, config) for r in range(world)]
        phase = call % 3
        # pushed: every rank's GEMV first (on GPUs they run at once), then every rank's sum
        for r in range(world):
            assert int(pushed_peers[r].state[0]) == phase
            fp8_gemv(xs[r], weights[r], scales[r], bias if r == 0 else None, config, push=pushed_peers[r])
        got = [all_reduce_rms_norm(torch.empty_like(partials[r]), norm_w, 1e-5, residual, False, pushed_peers[r],
                                   pushed=True) for r in range(world)]
        for r in range(world):
            # the unpushed kernel simulated as in test_all_reduce_norm: the peers' rows written before
            view = plain_bufs[r].view(ints).view(3, world, -1)
            for s in range(world):
                bits = partials[s].view(ints).reshape(-1).clone()
                bits[bits == _sentinel(act)] = 0
                view[phase, s, : M * N] = bits
            want = all_reduce_rms_norm(partials[r], norm_w, 1e-5, residual, False, plain_peers[r])
            assert torch.equal(got[r][0], want[0]) and torch.equal(got[r][1], want[1]), (call, r)
            assert torch.equal(got[r][1], got[0][1]) and torch.equal(got[r][0], got[0][0])
        want_normed, want_res = reference.all_reduce_rms_norm([p.cpu() for p in partials], norm_w.cpu(), 1e-5,
                                                              None if residual is None else residual.cpu())
        assert torch.equal(got[0][1].cpu(), want_res)
        torch.testing.assert_close(got[0][0].cpu().float(), want_normed.float(), atol=2e-2, rtol=2e-2)
        for r in range(world):
            view = pushed_bufs[r].view(ints).view(3, world, -1)
            assert not bool((view[phase, :, : M * N] == _sentinel(act)).any())  # every slot arrived
            assert bool((view[phase, :, M * N:] == _sentinel(act)).all())  # nothing past the rows
            assert bool((view[(phase + 2) % 3] == _sentinel(act)).all())  # the previous call's rows reset
            assert pushed_peers[r].state.tolist() == [(phase + 1) % 3, 0, M]


def _sentinel(dtype: torch.dtype) -> int:
    return -(1 << 15) if dtype == torch.bfloat16 else -(1 << 31)


def test_push_refuses_gated_and_oversized(device):
    act = torch.float32 if device == "cpu" else torch.bfloat16
    peers, _ = _group(2, act, device)
    w = torch.randn(64, 32).to(torch.bfloat16).to(device)
    x = torch.randn(1, 32).to(act).to(device)
    config = GemvConfig(MODE_ACC, 8, 32, 1, 1, 4, 1)
    with pytest.raises(ValueError, match="cannot push a gated output"):
        fp8_gemv(x, w, None, None, config, gated=True, push=peers[0])
    wide = torch.randn(SLOT, 32).to(torch.bfloat16).to(device)  # a row wider than one slot
    with pytest.raises(ValueError, match="cannot push this output"):
        fp8_gemv(x, wide, None, None, config, push=peers[0])
