"""Int4 linear for a few rows (<= 64; picked from 1 to 24) on `mma.sync`, the k-chunk words loaded straight into the MMA's registers.

Same operands as `kernels/int4_kchunk.py` (`packed` int32 `[K // 32, N, 4]`: nibble j of word w of
`packed[c, n]` is row 32c + 4j + w; `scales`/`zeros [G, N]` with integer zero points 0..127), torch
reference `quant_reference.int4_kchunk_linear`; CUDA only (sm_80+), bf16 or fp16 x, K and the group a
multiple of 128 (or one group).

Why: from 2 to 24 rows the CUDA-core GEMV repeats its dequantisation per row and the Triton
tensor-core tiles move every dequantised weight through shared memory to reach the MMA's operand
layout, so both run at 25-35 % of HBM there (bench/RESULTS.md run 61). Written in Gluon, where
layouts are explicit, this kernel loads each program's words directly in the layout of the MMA's A
operand (out^T = W^T x^T: the weights are A, the rows of x padded to 8 or 16 are B), so every
thread holds two neighbouring words of a column, whose nibble j is the sub-dot j's pair of k values.
One `prmt` sets byte b of both words side by side, a `lop3` or's their low nibbles into the mantissas
of the magic pair (128.0, 128.0) (bf16; 1024.0 for fp16) and one packed FMA subtracts 128 + z: two
weights as exact (q - z) in three instructions, the high nibbles in three more, no shared memory.
The 8 sub-dots of a 128-row tile sum x (q - z) exactly in fp32 before the group's scale multiplies
them once. Everything a tile reads from HBM (words, zero points, scales) is requested one tile ahead:
a zero point loaded in its own iteration stalled every tile for a DRAM latency (bench/RESULTS.md run
66). Split-K partials meet as in the other int4 kernels: fp32 workspace, per-tile counter, the last
program sums them in split order (deterministic) and resets the counter. With GATED (a SwiGLU MLP's
packed [gate | up]) each 16-column MMA tile holds 8 gate columns and their 8 up columns, so the
epilogue writes silu(gate) * up without the activation's own launch (2-8 rows on the gate|up of the
8B shape: 27.4-30.0 us against 31.9-38.6 for this kernel plus `silu_and_mul`, run 68).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels.int4_matmul import split_k_workspace
from kernels.pdl import launch_options

BLOCK_K = 128  # rows per K tile: 4 chunks, each nibble's sub-dot an MMA k-step of 16
MAX_ROWS = 64  # rows of x a launch takes (padded to a power of two >= 8: the MMA's N)


def fits(K: int, group_size: int) -> bool:
    """Whether the kernel takes this weight: K tiles of BLOCK_K rows, each inside one group."""
    return K % BLOCK_K == 0 and (group_size >= K or group_size % BLOCK_K == 0)


def group_tiles(K: int, group_size: int) -> int:
    """K tiles a scale group spans, the kernels' GROUP_TILES: 0 for one group over all of K. A constexpr, so the
    group of tile t is t itself at group 128, not an integer division by a runtime value in every tile (with it
    the mma kernel's loop at one row is 332 SASS instructions a tile instead of 391; its time did not change,
    bench/RESULTS.md run 68)."""
    assert fits(K, group_size), (K, group_size)
    return 0 if group_size >= K else group_size // BLOCK_K


@gluon.jit
def group_row(t, stride_sg, GROUP_TILES: gl.constexpr):
    """Offset of K tile t's row of scales / zero points (`group_tiles`)."""
    if GROUP_TILES == 0:
        return t * 0
    elif GROUP_TILES == 1:
        return t * stride_sg
    else:
        return (t // GROUP_TILES) * stride_sg

# Per pair of neighbouring words ($2, $3) and byte B: $0 = (nibble 2B of $2, of $3) + $4 and
# $1 = (nibble 2B + 1 ...) + $4 in the packed dtype, $4 = -(MAGIC + z) twice; `scaled` also multiplies both
# by $5 (= s twice). prmt selector: byte 0 = byte B of $2, byte 2 = byte B of $3; 983055 = 0x000F000F;
# LUT 234 = (a & b) | c.
_PAIR_PTX = """{{
.reg .b32 t, u, v, one;
mov.b32 one, {one};
prmt.b32 t, $2, $3, {sel};
lop3.b32 u, t, 983055, {magic}, 234;
fma.rn.{ty}x2 {lo}, u, one, $4;{scale_lo}
shr.b32 v, t, 4;
lop3.b32 v, v, 983055, {magic}, 234;
fma.rn.{ty}x2 {hi}, v, one, $4;{scale_hi}
}}"""


def pair_ptx(byte: int, fp16: bool, scaled: bool = False) -> str:
    """The inline PTX that turns byte `byte` of two neighbouring words into two pairs of exact (q - z), or of
    (q - z) * s rounded once with `scaled`, in fp16 or bf16 (the magic-number trick)."""
    # bf16: magic 0x43004300 (128.0 twice), one 0x3F803F80; fp16: 0x64006400 (1024.0), 0x3C003C00
    sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
    ty, magic, one = ("f16", 1677747200, 1006648320) if fp16 else ("bf16", 1124090624, 1065369472)
    if scaled:
        regs = dict(lo="u", hi="v", scale_lo=f"\nmul.rn.{ty}x2 $0, u, $5;", scale_hi=f"\nmul.rn.{ty}x2 $1, v, $5;")
    else:
        regs = dict(lo="$0", hi="$1", scale_lo="", scale_hi="")
    return _PAIR_PTX.format(sel=sel, ty=ty, magic=magic, one=one, **regs)


_BF16_0 = gl.constexpr(pair_ptx(0, False))
_BF16_1 = gl.constexpr(pair_ptx(1, False))
_BF16_2 = gl.constexpr(pair_ptx(2, False))
_BF16_3 = gl.constexpr(pair_ptx(3, False))
_FP16_0 = gl.constexpr(pair_ptx(0, True))
_FP16_1 = gl.constexpr(pair_ptx(1, True))
_FP16_2 = gl.constexpr(pair_ptx(2, True))
_FP16_3 = gl.constexpr(pair_ptx(3, True))


@gluon.jit
def _ptx(PTX: gl.constexpr):
    # A side effect only (PDL's grid-dependency instructions).
    gl.inline_asm_elementwise(PTX, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _sub_dots(words, neg_zero, x_rows, x_mask, kk, part, PTX: gl.constexpr):
    # The sub-dots of nibbles 2B and 2B + 1 (PTX for byte B): part += W_2B^T x_2B^T + W_2B+1^T x_2B+1^T.
    lo, hi = gl.inline_asm_elementwise(PTX, "=r,=r,r,r,r", [words, neg_zero],
                                       dtype=(neg_zero.dtype, neg_zero.dtype), is_pure=True, pack=2)
    x_lo = gl.load(x_rows + kk[:, None], mask=x_mask, other=0.0)
    x_hi = gl.load(x_rows + (kk + 4)[:, None], mask=x_mask, other=0.0)
    part = mma_v2(lo, x_lo, part)
    return mma_v2(hi, x_hi, part)


@gluon.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _kchunk_mma_kernel(
    # as `int4_kchunk._kchunk_gemv_kernel`'s, with x bf16 / fp16 of M <= XN rows and integer zero points 0..127
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, tiles_per_split, split_k, stride_xm, stride_wc, stride_sg, stride_om,
    HAS_BIAS: gl.constexpr,
    USE_SPLIT: gl.constexpr,
    GROUP_TILES: gl.constexpr,  # K tiles a scale group (`group_tiles`; 0: one group)
    BLOCK_N: gl.constexpr,  # weight columns per program: 16 * WARPS * (row tiles a warp)
    XN: gl.constexpr,  # rows of x padded to the MMA's N: a power of two, 8 to MAX_ROWS
    WARPS: gl.constexpr,
    PDL: gl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py's contract)
    GATED: gl.constexpr,  # W is [gate | up] (N = 2 I columns): write silu(gate) * up [M, I] (`_columns`)
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    MAGIC: gl.constexpr = 1024.0 if DTYPE == gl.float16 else 128.0
    if PDL:
        _ptx("griddepcontrol.launch_dependents; // $0")
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    # A operand side: [BLOCK_N, 16] words, column q = 4 r + w of the tile's chunk r (rows 32 r + 4 j + w).
    # Columns past N re-read column N - 1 (valid memory; their outputs are masked at the store).
    n_sa = _columns(pid_n, N, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_L)), BLOCK_N, GATED)[0]
    q_a = gl.arange(0, 16, layout=gl.SliceLayout(0, A_L))
    word_offs = (n_sa * 4)[:, None] + ((q_a // 4) * stride_wc + q_a % 4)[None, :]
    # B operand side: x^T [16, XN]; rows past M re-read row M - 1 (valid memory), masked to zero.
    q_b = gl.arange(0, 16, layout=gl.SliceLayout(1, B_L))
    m_b = gl.arange(0, XN, layout=gl.SliceLayout(0, B_L))
    x_rows = x_ptr + (gl.minimum(m_b, M - 1) * stride_xm)[None, :]
    x_mask = (m_b < M)[None, :]
    k_b = (q_b // 4) * 32 + q_b % 4  # [16]: sub-dot row q is tile row k_b[q] + 4 j
    # Accumulator side: out^T [BLOCK_N, XN].
    n_sm, valid_m = _columns(pid_n, N, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA)), BLOCK_N, GATED)
    num_k_tiles = K // 128
    t_start = split * tiles_per_split
    t_end = gl.minimum(t_start + tiles_per_split, num_k_tiles)
    acc = gl.zeros([BLOCK_N, XN], gl.float32, layout=MMA)
    # The first tile's words, zero points and scales; an empty split (t_start >= t_end) reads tile 0 and adds nothing.
    t_first = gl.minimum(t_start, num_k_tiles - 1)
    words_next = gl.load(w_ptr + t_first * 4 * stride_wc + word_offs)
    g_row = group_row(t_first, stride_sg, GROUP_TILES)
    z_next = gl.load(zeros_ptr + g_row + n_sa)
    s_next = gl.load(scales_ptr + g_row + n_sm)
    if PDL:
        _ptx("griddepcontrol.wait; // $0")  # the first tile's words were requested before the upstream kernel ended
    for t in range(t_start, t_end):
        # Everything the next tile reads from HBM is in flight while this one computes (the last tile re-reads
        # itself, from L2): a zero point or scale loaded in the same iteration would stall it for a DRAM latency.
        words = words_next
        z = z_next
        s = s_next
        t_next = gl.minimum(t + 1, t_end - 1)
        words_next = gl.load(w_ptr + t_next * 4 * stride_wc + word_offs)
        g_next = group_row(t_next, stride_sg, GROUP_TILES)
        z_next = gl.load(zeros_ptr + g_next + n_sa)
        s_next = gl.load(scales_ptr + g_next + n_sm)
        neg_zero = gl.broadcast((-(z.to(gl.float32) + MAGIC)).to(DTYPE)[:, None], words)[0]
        kk = t * 128 + k_b
        part = gl.zeros([BLOCK_N, XN], gl.float32, layout=MMA)
        if DTYPE == gl.float16:
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk, part, _FP16_0)
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk + 8, part, _FP16_1)
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk + 16, part, _FP16_2)
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk + 24, part, _FP16_3)
        else:
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk, part, _BF16_0)
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk + 8, part, _BF16_1)
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk + 16, part, _BF16_2)
            part = _sub_dots(words, neg_zero, x_rows, x_mask, kk + 24, part, _BF16_3)
        acc += part * s.to(gl.float32)[:, None]
    m_m = gl.arange(0, XN, layout=gl.SliceLayout(0, MMA))
    store_tile(acc, n_sm, valid_m, m_m, pid_n, split, split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr,
               stride_om, HAS_BIAS, USE_SPLIT, GATED)


@gluon.jit
def _columns(pid_n, N, r, BLOCK_N: gl.constexpr, GATED: gl.constexpr):
    """Weight columns of program pid_n's rows r (0..BLOCK_N-1 of out^T), clamped below N so every load is in
    bounds, and whether each is real. With GATED (N = 2 I: [gate | up]) each 16-row MMA tile holds 8 gate
    columns c then the 8 up columns I + c of the same outputs c = pid_n * BLOCK_N / 2 + 8 (r // 16) + r % 8:
    the MMA's accumulator layout keeps rows g and g + 8 in one thread, so the epilogue pairs them there."""
    if GATED:
        I = N // 2
        c = pid_n * (BLOCK_N // 2) + (r // 16) * 8 + r % 8
        return gl.minimum(c, I - 1) + ((r // 8) % 2) * I, c < I
    n = pid_n * BLOCK_N + r
    return gl.minimum(n, N - 1), n < N


@gluon.jit
def _gated_pairs(v):
    # [BLOCK_N, XN] in `_columns`' GATED row order -> (gate, up) [BLOCK_N / 2, XN] with the same outputs in each.
    v = gl.reshape(v, [v.shape[0] // 16, 2, 8, v.shape[1]])
    gate, up = gl.split(gl.permute(v, (0, 2, 3, 1)))
    return gl.reshape(gate, [v.shape[0] * 8, v.shape[3]]), gl.reshape(up, [v.shape[0] * 8, v.shape[3]])


@gluon.jit
def _store_out(total, n_sm, valid, m_m, M, out_ptr, stride_om, GATED: gl.constexpr):
    # out[m, n] = total[n, m] (total fp32, bias included); with GATED out[m, c] = silu(gate) * up, rounded as
    # `kernels/activation.silu_and_mul` rounds the gate|up product it reads (x's dtype) and its result.
    DTYPE: gl.constexpr = out_ptr.dtype.element_ty
    rows = gl.broadcast(n_sm[:, None], total)[0]
    cols = gl.broadcast(m_m[None, :], total)[0]
    ok = gl.broadcast(valid[:, None], total)[0] & (cols < M)
    if GATED:
        gate, up = _gated_pairs(total)
        out_cols = _gated_pairs(rows)[0]  # the gate column c is the output column
        m_out = _gated_pairs(cols)[0]
        ok = _gated_pairs(ok.to(gl.int32))[0] != 0
        gate = gate.to(DTYPE).to(gl.float32)
        act = (gate / (1.0 + gl.exp(-gate))).to(DTYPE).to(gl.float32)
        y = (act * up.to(DTYPE).to(gl.float32)).to(DTYPE)
        gl.store(out_ptr + m_out * stride_om + out_cols, y, mask=ok)
    else:
        gl.store(out_ptr + cols * stride_om + rows, total.to(DTYPE), mask=ok)


@gluon.jit
def store_tile(acc, n_sm, valid, m_m, tile, split, split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr,
               stride_om, HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, GATED: gl.constexpr):
    """out[m, n] = acc[n, m] (+ bias[n]) for the tile's weight columns n_sm (clamped, `valid` where real) and rows
    m_m (slices of acc's layout); with GATED silu(gate) * up of `_columns`' paired rows. With USE_SPLIT the
    partial goes to the fp32 workspace, and the last of the split_k programs of `tile` to arrive sums them in
    split order (deterministic), writes out and resets the tile's counter."""
    if USE_SPLIT:
        part_mask = gl.broadcast(valid[:, None], acc)[0] & (m_m < M)[None, :]
        part_offs = m_m[None, :] * N + n_sm[:, None]
        gl.store(partial_ptr + split * M * N + part_offs, acc, mask=part_mask)
        _ptx("bar.sync 0; // $0")  # every thread's partial is stored before the release below
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = gl.zeros_like(acc)
            for i in range(split_k):
                total += gl.load(partial_ptr + i * M * N + part_offs, mask=part_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += gl.load(bias_ptr + n_sm).to(gl.float32)[:, None]
            _store_out(total, n_sm, valid, m_m, M, out_ptr, stride_om, GATED)
            gl.store(counter_ptr + tile, 0)  # ready for the next launch
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + n_sm).to(gl.float32)[:, None]
        _store_out(acc, n_sm, valid, m_m, M, out_ptr, stride_om, GATED)


def launch(x, packed, scales, zeros, group_size, bias, out, block_n, split, num_warps, gated=False) -> None:
    """One launch over out [M, N] (M <= MAX_ROWS), or with `gated` out [M, N / 2] = silu(gate) * up of a packed
    [gate | up] weight: block_n = 16 * num_warps * (row tiles a warp) weight columns a program (block_n / 2
    outputs when gated); the split-K workspace and PDL as the other int4 kernels take them
    (`split_k_workspace`, `launch_options`)."""
    M, K = x.shape
    N = packed.shape[1]
    tiles = triton.cdiv(N // 2, block_n // 2) if gated else triton.cdiv(N, block_n)
    partial, counters = split_k_workspace(out, split, tiles, N)  # partials per weight column
    _kchunk_mma_kernel[(tiles, split)](
        x, packed, scales, zeros, bias if bias is not None else scales, out, partial, counters,
        M, N, K, triton.cdiv(K // BLOCK_K, split), split, x.stride(0), packed.stride(0), scales.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, USE_SPLIT=split > 1, GROUP_TILES=group_tiles(K, group_size),
        BLOCK_N=block_n, XN=max(8, triton.next_power_of_2(M)), WARPS=num_warps, GATED=gated, num_warps=num_warps,
        **launch_options(x),
    )
