"""Int4 GEMM on the k-chunk layout for many rows (decode batches above 64, prefill): tensor cores, no dense copy.

Same operands as `kernels/int4_kchunk.py` (`packed` int32 `[K // 32, N, 4]`: nibble j of word w of
`packed[c, n]` is row 32c + 4j + w; `scales`/`zeros [G, N]`), torch reference
`quant_reference.int4_kchunk_linear`. Per K tile of BLOCK_K rows, each program loads the
`[BLOCK_N, BLOCK_K // 32, 4]` words (16 bytes a column and chunk), dequantises the 8 nibbles
(shift + lop3 + one FMA a weight, as the decode kernels do), and puts them back in natural row order:
`tl.join` appends the nibble index j after the word index w, and swapping those two axes (both held
by one thread: a register renaming, no data movement) gives row 32r + 4j + w at its place. So ONE
`tl.dot` per K tile multiplies the weight tile by a contiguous x tile, unlike
`_kchunk_dot_kernel`'s 8 sub-dots on x columns gathered 4 out of every 32.

It computes the transposed product, out^T tile = W^T [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]:
the dequantised weights are then the MMA's A operand, which Hopper's wgmma reads from registers
(x @ W, with the weights as the B operand that wgmma reads from shared memory, does not compile
with Triton 3.6: "Illegal shared layout" in TritonGPUOptimizeDotOperands), and BLOCK_M (the rows
of x) becomes the MMA's N, which may be as small as 16. NIBBLES keeps the 8 sub-dots instead (one
per nibble, x rows gathered 4 of every 32) but with each nibble's weights an elementwise function
of one [BLOCK_N, BLOCK_K // 8] word tile. GROUP_M orders the programs in bands of GROUP_M row tiles
so that consecutive programs share weight tiles in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_common import finish_tile, grouped_tile, nibble_float


@triton.jit
def _natural_tile(words, su, cz, DTYPE: tl.constexpr, ASM: tl.constexpr):
    # words [BN, R, 4] uint32, su / cz [BN, R, 1] fp32 -> W^T [BN, 32 R] in DTYPE, column 32r + 4j + w
    # = nibble j of word w (w = q * 16 s * (1 + q / 16) - (16 + z) s = (q - z) s).
    f0 = nibble_float(words, 0, ASM) * su - cz
    f1 = nibble_float(words, 1, ASM) * su - cz
    f2 = nibble_float(words, 2, ASM) * su - cz
    f3 = nibble_float(words, 3, ASM) * su - cz
    f4 = nibble_float(words, 4, ASM) * su - cz
    f5 = nibble_float(words, 5, ASM) * su - cz
    f6 = nibble_float(words, 6, ASM) * su - cz
    f7 = nibble_float(words, 7, ASM) * su - cz
    # Nested joins append three size-2 axes, j's bits 2, 1, 0 (see `int4_common.join8`): [BN, R, 4, 2, 2, 2].
    t = tl.join(tl.join(tl.join(f0.to(DTYPE), f4.to(DTYPE)), tl.join(f2.to(DTYPE), f6.to(DTYPE))),
                tl.join(tl.join(f1.to(DTYPE), f5.to(DTYPE)), tl.join(f3.to(DTYPE), f7.to(DTYPE))))
    BN: tl.constexpr = words.shape[0]
    R: tl.constexpr = words.shape[1]
    t = tl.reshape(t, [BN, R, 4, 8])  # (n, r, w, j)
    t = tl.permute(t, (0, 1, 3, 2))  # (n, r, j, w)
    return tl.reshape(t, [BN, R * 32])


@triton.jit
def _chunk_scales(scales_ptr, zeros_ptr, offs_n, mask_n, c, mask_c, group_size, stride_sg):
    # (16 s, (16 + z) s) of chunks c ([BN, C] fp32): w = q 16 s (1 + q / 16)... = f 16 s - (16 + z) s.
    sg = offs_n[:, None] + ((c * 32) // group_size)[None, :] * stride_sg  # a chunk lies in one group
    sg_mask = mask_n[:, None] & mask_c[None, :]
    s = tl.load(scales_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)
    return s * 16.0, (z + 16.0) * s


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _kchunk_gemm_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as `_kchunk_gemv_kernel`'s
    M, N, K, group_size, tiles_per_split, split_k, stride_xm, stride_wc, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32 (NIBBLES: of 128, so that a sub-dot has >= 16 rows)
    GROUP_M: tl.constexpr,  # row tiles per band of the program order (1: row-major)
    NIBBLES: tl.constexpr,  # 8 sub-dots a K tile, one per nibble, instead of one on the reordered tile
):
    R: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    offs_m, offs_n, mask_m, mask_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
    num_chunks = K // 32
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = tl.program_id(1) * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    if NIBBLES:
        # [BN, 4R] word tiles, column q = 4 r + w: nibble j's weights are an elementwise function of
        # them (rows 32 r + 4 j + w), so their conversion to the MMA's register layout is one of the words.
        q = tl.arange(0, 4 * R)
        word_offs = (offs_n * 4)[:, None] + (q % 4)[None, :]
        for t in range(t_start, t_end):
            c = t * R + q // 4  # [4R]
            mask_c = c < num_chunks
            words = tl.load(w_ptr + c[None, :] * stride_wc + word_offs, mask=mask_n[:, None] & mask_c[None, :],
                            other=0).to(tl.uint32, bitcast=True)
            su, cz = _chunk_scales(scales_ptr, zeros_ptr, offs_n, mask_n, c, mask_c, group_size, stride_sg)
            for j in tl.static_range(8):
                w_j = (nibble_float(words, j, ASM) * su - cz).to(x_ptr.dtype.element_ty)  # [BN, 4R]
                kk = c * 32 + 4 * j + q % 4
                x_j = tl.load(x_rows[None, :] + kk[:, None], mask=(kk < K)[:, None] & mask_m[None, :], other=0.0)
                acc = tl.dot(w_j, x_j, acc, input_precision=DOT_PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        offs_r = tl.arange(0, R)  # the tile's chunks
        word_offs = (offs_n * 4)[:, None, None] + tl.arange(0, 4)[None, None, :]  # [BN, 1, 4]
        for t in range(t_start, t_end):
            c = t * R + offs_r
            mask_c = c < num_chunks
            words = tl.load(w_ptr + c[None, :, None] * stride_wc + word_offs,
                            mask=mask_n[:, None, None] & mask_c[None, :, None], other=0).to(tl.uint32, bitcast=True)
            su, cz = _chunk_scales(scales_ptr, zeros_ptr, offs_n, mask_n, c, mask_c, group_size, stride_sg)
            w_t = _natural_tile(words, su[:, :, None], cz[:, :, None], x_ptr.dtype.element_ty, ASM)  # [BN, BK]
            kk = t * BLOCK_K + offs_k
            x_t = tl.load(x_rows[None, :] + kk[:, None], mask=(kk < K)[:, None] & mask_m[None, :], other=0.0)
            acc = tl.dot(w_t, x_t, acc, input_precision=DOT_PRECISION)
    finish_tile(tl.trans(acc), offs_m, offs_n, mask_m, mask_n, tl.program_id(1), split_k, pid, M, N, bias_ptr,
                out_ptr, partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)
