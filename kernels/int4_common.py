"""Device helpers shared by the quantized-linear kernels: code-to-float and the split-K epilogue.

`unit_float` turns one packed field into the exact fp32 1 + q / 2**bits with integer ops only
(`nibble_float` the same for the repacked int4 words, with an optional one-lop3 form, and
`nibble_pair_floats` two nibbles from one shift; `unpack_nibbles`
a word tile into its 8 columns per word, `join8` the same column order for any 8 tensors);
`stack_rows` gathers a GEMV's row accumulators into one tile; `grouped_pids` / `grouped_tile` place a
tensor-core program's output tile (bands of GROUP_M row tiles, for L2 reuse of the weight tiles);
`finish_tile` writes an fp32 accumulator tile to the output, or meets the other split-K programs
of its tile through an fp32 workspace and a self-resetting counter (the last one sums in order);
`gemv_rows` / `finish_gemv_tile` place a GEMV program's rows and finish them, also over a packed
[gate | up] weight whose epilogue writes silu(gate) * up (`finish_gated_tile`: the SwiGLU activation
without its own launch and round trip), or whose finished rows go straight into the fused
all-reduce's buffers (`PUSH_W`: a row-parallel partial, `kernels/all_reduce_norm.push_partial`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.all_reduce_norm import push_partial


@triton.jit
def unit_float(words, J: tl.constexpr, BITS: tl.constexpr):
    # Field J of each packed word as the fp32 1 + q / 2**BITS (exact): the field is moved to the
    # top of the mantissa and the exponent of 1.0 is or-ed in. One shift + one and/or per weight,
    # no int-to-float conversion (those issue at 1/8 the FMA rate).
    SHIFT: tl.constexpr = 23 - BITS - BITS * J
    if SHIFT >= 0:
        moved = words << SHIFT
    else:
        moved = words >> (-SHIFT)
    return ((moved & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _shifted(words, SHIFT: tl.constexpr):
    # words << SHIFT, or >> -SHIFT (logical: the words are unsigned)
    if SHIFT >= 0:
        moved = words << SHIFT
    else:
        moved = words >> (-SHIFT)
    return moved


@triton.jit
def nibble_float(words, J: tl.constexpr, ASM: tl.constexpr):
    # Nibble J of each uint32 word as the fp32 1 + q / 16 (exact): move it to the top of the
    # mantissa (bits 19-22) and or in 1.0's exponent; no int-to-float conversion. With ASM the
    # and + or is one lop3 (ptxas emits two LOP3s for the plain form: both constants are immediates).
    moved = _shifted(words, 19 - 4 * J)
    if ASM:
        # lop3 LUT 0xEA = (a & b) | c, b = 0x780000 (mantissa bits 19-22), c = 0x3F800000 (1.0)
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 7864320, 1065353216, 234;", "=r,r", [moved],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return ((moved & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def nibble_pair_floats(words, I: tl.constexpr, ASM: tl.constexpr):
    # Nibbles 2I and 2I + 1 of each uint32 word as the fp32 pair (1 + q / 256, 1 + q / 16), both exact,
    # from ONE shift: it moves nibble 2I to mantissa bits 15-18 and nibble 2I + 1 to bits 19-22, and a
    # lop3 each ors in 1.0's exponent (half the shifts of `nibble_float`). The 1 / 256 term keeps 16
    # bits of an fp32 sum of such values (enough for bf16/fp16 outputs).
    moved = _shifted(words, 15 - 8 * I)
    if ASM:
        # lop3 LUT 0xEA = (a & b) | c: b = 0x78000 / 0x780000 (mantissa bits 15-18 / 19-22), c = 1.0
        lo = tl.inline_asm_elementwise("lop3.b32 $0, $1, 491520, 1065353216, 234;", "=r,r", [moved],
                                       dtype=tl.float32, is_pure=True, pack=1)
        hi = tl.inline_asm_elementwise("lop3.b32 $0, $1, 7864320, 1065353216, 234;", "=r,r", [moved],
                                       dtype=tl.float32, is_pure=True, pack=1)
        return lo, hi
    lo = ((moved & 0x78000) | 0x3F800000).to(tl.float32, bitcast=True)
    hi = ((moved & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def join8(f0, f1, f2, f3, f4, f5, f6, f7):
    # [R, C] x 8 -> [R, 8 C] with element (r, 8 c + j) = f_j[r, c]. tl.join appends a size-2 axis
    # whose index is the less significant one after the final reshape than every later join's.
    t = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
    return tl.reshape(t, [f0.shape[0], f0.shape[1] * 8])


@triton.jit
def unpack_nibbles(words, ASM: tl.constexpr):
    # [R, C] uint32 words -> [R, 8 C] fp32 1 + q / 16, columns in natural order.
    return join8(nibble_float(words, 0, ASM), nibble_float(words, 1, ASM), nibble_float(words, 2, ASM),
                 nibble_float(words, 3, ASM), nibble_float(words, 4, ASM), nibble_float(words, 5, ASM),
                 nibble_float(words, 6, ASM), nibble_float(words, 7, ASM))


@triton.jit
def stack_rows(acc0, acc1, acc2, acc3, ROWS: tl.constexpr):
    # The GEMVs' per-row [BLOCK_N] accumulators as one [max(ROWS, 2), BLOCK_N] tile for `finish_tile`
    # (a 1-row tile repeats row 0, which the store mask drops); returns (tile, its row offsets).
    offs_m = tl.arange(0, 2 if ROWS == 1 else ROWS)
    if ROWS == 1:
        acc = tl.where(offs_m[:, None] == 0, acc0[None, :], acc0[None, :])
    elif ROWS == 2:
        acc = tl.where(offs_m[:, None] == 0, acc0[None, :], acc1[None, :])
    else:
        acc = tl.where(offs_m[:, None] == 0, acc0[None, :], acc1[None, :])
        acc = tl.where(offs_m[:, None] == 2, acc2[None, :], acc)
        acc = tl.where(offs_m[:, None] == 3, acc3[None, :], acc)
    return acc, offs_m


@triton.jit
def grouped_pids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Program pid's (row tile, column tile): programs run along bands of GROUP_M row tiles, column by
    # column (GROUP_M = 1: row-major), so programs in flight together share weight columns in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    band = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % band) % rows_in_band, (pid % band) // rows_in_band


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # `grouped_pids` as (row offsets, column offsets, row mask, column mask).
    pid_m, pid_n = grouped_pids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _arrive(acc, partial_ptr, part_offs, part_mask, split, tile, split_elems, counter_ptr):
    # Store this split's partial tile, then count this split in at the tile's counter: returns how
    # many splits arrived before it (the last one, split_k - 1 before it, sums them all).
    tl.store(partial_ptr + split.to(tl.int64) * split_elems + part_offs, acc, mask=part_mask)
    # NOTE: the barrier orders every thread's partial store before the release below.
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")


@triton.jit
def _sum_partials(acc, partial_ptr, part_offs, part_mask, split_k, split_elems):
    # Every split's partial tile summed in split order (deterministic whichever split arrived last).
    total = tl.zeros_like(acc)
    for s_i in range(split_k):
        total += tl.load(partial_ptr + s_i * split_elems + part_offs, mask=part_mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_final(total, offs_m, offs_n, out_mask, N, out_ptr, stride_om, push_ptr, push_state, push_rank, slot_elems,
                 PUSH_W: tl.constexpr):
    # A tile's final fp32 rows, rounded to the output dtype: stored to out, or with PUSH_W (the group's
    # size) pushed into every rank's receive buffer for the fused all-reduce that follows
    # (`kernels.all_reduce_norm.push_partial`; out is then not written).
    y = total.to(out_ptr.dtype.element_ty)
    if PUSH_W > 0:
        phase = tl.load(push_state)  # the all-reduce's phase: set by its previous launch, long done
        push_partial(y, offs_m[:, None] * N + offs_n[None, :], out_mask, phase, push_ptr, push_rank, slot_elems,
                     PUSH_W)
    else:
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y, mask=out_mask)


@triton.jit
def _finish(
    acc, offs_m, offs_n, mask_m, mask_n, split, split_k, tile, M, N, bias_ptr, out_ptr, partial_ptr,
    counter_ptr, stride_om, push_ptr, push_state, push_rank, slot_elems, HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr, PUSH_W: tl.constexpr,
):
    # acc [BM, BN] fp32 -> out (+ bias), or pushed (`_store_final`). With split-K: store this split's
    # partial; the last split of the tile (per-tile counter) sums all partials in split order and
    # resets the counter.
    out_mask = mask_m[:, None] & mask_n[None, :]
    if USE_SPLIT:
        part_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        arrived = _arrive(acc, partial_ptr, part_offs, out_mask, split, tile, M * N, counter_ptr)
        if arrived == split_k - 1:
            total = _sum_partials(acc, partial_ptr, part_offs, out_mask, split_k, M * N)
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            _store_final(total, offs_m, offs_n, out_mask, N, out_ptr, stride_om, push_ptr, push_state, push_rank,
                         slot_elems, PUSH_W)
            tl.store(counter_ptr + tile, 0)  # ready for the next launch
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        _store_final(acc, offs_m, offs_n, out_mask, N, out_ptr, stride_om, push_ptr, push_state, push_rank,
                     slot_elems, PUSH_W)


@triton.jit
def finish_tile(
    acc, offs_m, offs_n, mask_m, mask_n, split, split_k, tile, M, N, bias_ptr, out_ptr, partial_ptr,
    counter_ptr, stride_om, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr,
):
    # acc [BM, BN] fp32 -> out (+ bias). With split-K: store this split's partial; the last split
    # of the tile (per-tile counter) sums all partials in split order and resets the counter.
    _finish(acc, offs_m, offs_n, mask_m, mask_n, split, split_k, tile, M, N, bias_ptr, out_ptr, partial_ptr,
            counter_ptr, stride_om, out_ptr, counter_ptr, 0, 0, HAS_BIAS, USE_SPLIT, 0)


@triton.jit
def gemv_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    # GEMV program pid_n's weight rows and their validity: BLOCK_N rows from pid_n * BLOCK_N, or with
    # GATED, over a packed [gate | up] weight of N = 2 I rows, gate rows c and up rows I + c for its
    # BLOCK_N / 2 output columns c = pid_n * BLOCK_N / 2 + ... (row j < BLOCK_N / 2 is gate's;
    # rows clamped below N, so every load is in bounds).
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        I = N // 2
        j = tl.arange(0, BLOCK_N)
        col = pid_n * HALF + j % HALF
        rows = tl.minimum(col, I - 1) + (j >= HALF).to(tl.int32) * I
        valid = col < I
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows < N
    return rows, valid


@triton.jit
def finish_gemv_tile(
    acc, offs_m, rows, mask_m, mask_n, split, split_k, tile, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    stride_om, push_ptr, push_state, push_rank, slot_elems, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, PUSH_W: tl.constexpr,
):
    # A GEMV's epilogue over the `gemv_rows` of its program: `finish_gated_tile` (silu(gate) * up of
    # the N / 2 output columns) with GATED, else `finish_tile`'s, the rows pushed to the fused
    # all-reduce's buffers with PUSH_W (`_store_final`; push_* unused without).
    if GATED:
        tl.static_assert(PUSH_W == 0, "a gated GEMV's rows are not a row-parallel partial")
        finish_gated_tile(acc, offs_m, rows, mask_m, mask_n, split, split_k, tile, M, N // 2, bias_ptr, out_ptr,
                          partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT, BLOCK_N)
    else:
        _finish(acc, offs_m, rows, mask_m, mask_n, split, split_k, tile, M, N, bias_ptr, out_ptr, partial_ptr,
                counter_ptr, stride_om, push_ptr, push_state, push_rank, slot_elems, HAS_BIAS, USE_SPLIT, PUSH_W)


@triton.jit
def _store_gated(total, offs_m, rows, mask_m, mask_n, tile, I, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    # total [BM, BLOCK_N] fp32 gate | up sums (+ bias) -> silu(gate) * up at the tile's BLOCK_N / 2 columns.
    HALF: tl.constexpr = BLOCK_N // 2
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    pair = tl.permute(tl.reshape(total, [total.shape[0], 2, HALF]), (0, 2, 1))
    gate, up = tl.split(pair)  # [BM, HALF] each
    gate = gate.to(DTYPE).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    y = (act * up.to(DTYPE).to(tl.float32)).to(DTYPE)
    cols = tile * HALF + tl.arange(0, HALF)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + cols[None, :], y,
             mask=mask_m[:, None] & (cols < I)[None, :])


@triton.jit
def finish_gated_tile(
    acc, offs_m, rows, mask_m, mask_n, split, split_k, tile, M, I, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    stride_om, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # `finish_tile` for a gated tile (`gemv_rows` with GATED): acc [BM, BLOCK_N] holds gate | up sums of the
    # tile's BLOCK_N / 2 output columns; the total (+ bias of the weight `rows`) becomes
    # silu(gate) * up, rounded as `kernels/activation.py` rounds a stored [gate | up] row: gate and
    # up to the output dtype first, silu to it before the product. Split-K partials live in
    # [split, M, tiles * BLOCK_N] at the tile's own columns.
    if USE_SPLIT:
        width = tl.num_programs(0) * BLOCK_N
        slots = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        part_mask = mask_m[:, None] & mask_n[None, :]
        part_offs = offs_m.to(tl.int64)[:, None] * width + slots[None, :]
        arrived = _arrive(acc, partial_ptr, part_offs, part_mask, split, tile, M * width, counter_ptr)
        if arrived == split_k - 1:
            total = _sum_partials(acc, partial_ptr, part_offs, part_mask, split_k, M * width)
            _store_gated(total, offs_m, rows, mask_m, mask_n, tile, I, bias_ptr, out_ptr, stride_om, HAS_BIAS,
                         BLOCK_N)
            tl.store(counter_ptr + tile, 0)  # ready for the next launch
    else:
        _store_gated(acc, offs_m, rows, mask_m, mask_n, tile, I, bias_ptr, out_ptr, stride_om, HAS_BIAS, BLOCK_N)
