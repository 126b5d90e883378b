"""Int4 GEMM for many rows on Hopper, warp-specialised: dequantising warps feed a `wgmma` warp group via shared memory.

Same operands as `kernels/int4_kchunk.py` (`packed` int32 `[K // 32, N, 4]`: nibble j of word w of `packed[c, n]`
is row 32c + 4j + w; `scales`/`zeros [G, N]`), torch reference `quant_reference.int4_kchunk_linear`; CUDA sm_90,
bf16 / fp16 x, K a multiple of 64, each 64-row K tile inside one scale group. Each weight is (q - z) * s rounded
once to x's dtype, as the dequantised weight is.

Why: the int4 x @ W kernels that dequantise in the warps issuing the MMA (bench/RESULTS.md run 79, Triton and
Gluon) spend ~1 us a K tile with one warp a scheduler: every dependent step waits out its latency and the tensor
cores idle (1.6 % busy). Here the partitions of one program (a [BLOCK_M, 128] output tile) run at once:
- a loader warp copies x's [BLOCK_M, 64] tiles by TMA into STAGES buffers (mbarriers: ready / empty);
- a second loader warp copies each K tile's packed words ([2, 128, 4] int32, 4 KB) and its scale group's scales
  and zero points by TMA into RAW buffers, so that RAW tiles of weights are in flight at once;
- DQ_PARTS dequantising partitions of DQ_WARPS warps, taking the K tiles in turn, read each tile's words (two
  16-byte vectors a column), turn them into (q - z) * s two weights an instruction (`int4_kchunk_mma.pair_ptx`),
  put them in row order by register renaming and store the [128, 64] tile, K-contiguous, into a free one of WBUF
  buffers;
- the default warp group issues `wgmma` on ready x and weight tiles and releases them when the MMA is done.
Measured (run 81, clock64 stamps per partition on an H200): one dequantising partition takes ~1,050 cycles a K
tile (~585 reading and dequantising, ~270 storing, fencing and signalling), where the tensor cores' peak would do a
128-row tile's MMA in ~512; a second and third partition bring the 8B gate|up at 128 rows from 87.6 to 70.6 us
(bf16 cuBLAS 70.9), not further: at 128 rows a K tile moves ~88 KB through shared memory (the MMA's operands, the
weight tile's store, the TMA copies), ~700 cycles at 128 bytes a cycle.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.int4_kchunk_mma import _ptx
# pair_ptx with the scale, and its call: per pair of words and byte, two pairs of (q - z) * s
from kernels.int4_kchunk_wgmma import (_BF16_0, _BF16_1, _BF16_2, _BF16_3, _FP16_0, _FP16_1, _FP16_2, _FP16_3,
                                       _weights as _pairs)
from kernels.int4_matmul import _num_sms, split_k_workspace

BLOCK_K = 64  # rows of a K tile: two 32-row chunks
BLOCK_N = 128  # weight columns a program: one a dequantising thread (4 warps)
SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
WORDS_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)  # [2, 128, 4] words, dense
ROW_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)  # [1, 128] scales / zeros


@gluon.jit
def _weight_tile(words, neg_zero, scale, P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr):
    # words [BN, 2, 4] uint32 (column n's word w of chunk r), neg_zero = -(magic + z), scale = s ([BN, 2, 4], x's
    # dtype) -> [BN, 64], row 32 r + 4 j + w = nibble j of word w, as (q - z) s rounded once.
    t0, t1 = _pairs(words, neg_zero, scale, P0)
    t2, t3 = _pairs(words, neg_zero, scale, P1)
    t4, t5 = _pairs(words, neg_zero, scale, P2)
    t6, t7 = _pairs(words, neg_zero, scale, P3)
    # Nested joins append j's bits 2, 1, 0 as three size-2 axes: [BN, 2, 4, 2, 2, 2] -> (n, r, j, w).
    t = gl.join(gl.join(gl.join(t0, t4), gl.join(t2, t6)), gl.join(gl.join(t1, t5), gl.join(t3, t7)))
    t = gl.permute(gl.reshape(t, [t.shape[0], 2, 4, 8]), (0, 1, 3, 2))
    return gl.reshape(t, [t.shape[0], 64])


@gluon.jit
def _group_of(t, GROUP_TILES: gl.constexpr):
    # K tile t's scale group (GROUP_TILES 64-row tiles a group; 0: one group for all of K).
    if GROUP_TILES == 0:
        return t * 0
    else:
        return t // GROUP_TILES


@gluon.jit
def _mma_partition(x_bufs, w_bufs, x_ready, x_empty, w_ready, w_empty, num_k_tiles, pid, pid_m, pid_n, split,
                   split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, BLOCK_M: gl.constexpr,
                   WARPS: gl.constexpr, HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr):
    # num_k_tiles: this program's K tiles (its split's)
    # The default warp group(s): MMA on each ready pair of tiles, then release the pair before it (whose MMA is done);
    # then the epilogue, here rather than after the partitions join: there the accumulator would have only the
    # registers a thread gets at launch (96 with two MMA warp groups and two dequantising partitions: spills).
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    WBUF: gl.constexpr = w_bufs.type.shape[0]
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 128, 16])
    acc = gl.zeros([BLOCK_M, 128], gl.float32, layout=MMA)
    for t in range(num_k_tiles):
        s = t % STAGES
        b = t % WBUF
        mbarrier.wait(x_ready.index(s), (t // STAGES) & 1)
        mbarrier.wait(w_ready.index(b), (t // WBUF) & 1)
        acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(b).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])  # MMA t - 1 is done: its buffers are free
        mbarrier.arrive(x_empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
        mbarrier.arrive(w_empty.index((t + WBUF - 1) % WBUF), count=1, pred=t > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    DTYPE: gl.constexpr = x_bufs.dtype
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    offs_n = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if USE_SPLIT:
        part = partial_ptr + (offs_m * N)[:, None] + offs_n[None, :]
        gl.store(part + split * M * N, acc, mask=mask)
        if WARPS == 8:  # the MMA warp groups' partial is stored before the release below
            _ptx("bar.sync 9, 256; // $0")
        else:
            _ptx("bar.sync 9, 128; // $0")
        arrived = gl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        if arrived == split_k - 1:
            acc = gl.zeros_like(acc)
            for si in range(split_k):
                acc += gl.load(part + si * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(counter_ptr + pid, 0)  # ready for the next launch
            _store_out(acc, offs_m, offs_n, mask, N, bias_ptr, out_ptr, stride_om, HAS_BIAS, DTYPE)
    else:
        _store_out(acc, offs_m, offs_n, mask, N, bias_ptr, out_ptr, stride_om, HAS_BIAS, DTYPE)


@gluon.jit
def _x_partition(x_desc, x_bufs, x_ready, x_empty, pid_m, num_k_tiles, t0, BLOCK_M: gl.constexpr):
    # One warp: x's K tiles by TMA into the free stages.
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    for t in range(num_k_tiles):
        s = t % STAGES
        mbarrier.wait(x_empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [pid_m * BLOCK_M, (t0 + t) * 64], x_ready.index(s), x_bufs.index(s))


@gluon.jit
def _raw_partition(w_desc, s_desc, z_desc, raw_bufs, s_bufs, z_bufs, raw_ready, raw_empty, pid_n, num_k_tiles, t0,
                   GROUP_TILES: gl.constexpr):
    # One warp: each K tile's packed words and its group's scales and zero points by TMA into the free buffers.
    RAW: gl.constexpr = raw_bufs.type.shape[0]
    for t in range(num_k_tiles):
        r = t % RAW
        g = _group_of(t0 + t, GROUP_TILES)
        mbarrier.wait(raw_empty.index(r), ((t // RAW) & 1) ^ 1)
        mbarrier.expect(raw_ready.index(r), w_desc.block_type.nbytes + 2 * s_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [(t0 + t) * 2, pid_n * 128, 0], raw_ready.index(r), raw_bufs.index(r))
        tma.async_copy_global_to_shared(s_desc, [g, pid_n * 128], raw_ready.index(r), s_bufs.index(r))
        tma.async_copy_global_to_shared(z_desc, [g, pid_n * 128], raw_ready.index(r), z_bufs.index(r))


@gluon.jit
def _dequant_partition(w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty, num_k_tiles,
                       PART: gl.constexpr, PARTS: gl.constexpr):
    # One of PARTS dequantising partitions (4 or 8 warps, one weight column a thread), taking K tiles PART, PART +
    # PARTS, ...: each tile's words -> (q - z) s -> the free weight buffer. Independent partitions overlap one's
    # loads, stores and barriers with another's arithmetic (one partition alone spends ~1,000 cycles a tile).
    WBUF: gl.constexpr = w_bufs.type.shape[0]
    RAW: gl.constexpr = raw_bufs.type.shape[0]
    DTYPE: gl.constexpr = w_bufs.dtype
    MAGIC: gl.constexpr = 1024.0 if DTYPE == gl.float16 else 128.0
    RW: gl.constexpr = gl.num_warps() // 4  # warps across a column's two chunks: 1 or 2
    # the words as they sit in shared memory, [chunk, column, word]; permuted, [column, chunk, word]
    W3S: gl.constexpr = gl.BlockedLayout([2 // RW, 1, 4], [1, 32, 1], [RW, 4, 1], [2, 0, 1])
    for t in range(PART, num_k_tiles, PARTS):
        r = t % RAW
        mbarrier.wait(raw_ready.index(r), (t // RAW) & 1)
        raw = raw_bufs.index(r).load(W3S)
        s = s_bufs.index(r).load(gl.SliceLayout(2, W3S))  # [1, 128]: one scale a column
        z = z_bufs.index(r).load(gl.SliceLayout(2, W3S))
        neg_zero = (-(z.to(gl.float32) + MAGIC)).to(DTYPE)  # exact
        neg_zero = gl.permute(gl.broadcast(neg_zero[:, :, None], raw)[0], (1, 0, 2))
        scale = gl.permute(gl.broadcast(s[:, :, None], raw)[0], (1, 0, 2))
        words = gl.permute(raw, (1, 0, 2)).to(gl.uint32, bitcast=True)
        if DTYPE == gl.float16:
            w = _weight_tile(words, neg_zero, scale, _FP16_0, _FP16_1, _FP16_2, _FP16_3)
        else:
            w = _weight_tile(words, neg_zero, scale, _BF16_0, _BF16_1, _BF16_2, _BF16_3)
        # Release the raw buffer behind a proxy fence: the TMA refilling it writes through the async proxy, which the
        # mbarrier alone does not order after these generic shared loads (in flight when issued). Released behind
        # only the compiler's bar.sync, the next tile's words overwrote ~1 % of the tiles being read once two
        # dequantising partitions ran (bench/RESULTS.md run 81); the fence (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in
        # the SASS) waits for the loads.
        fence_async_shared()
        mbarrier.arrive(raw_empty.index(r), count=1)
        b = t % WBUF
        mbarrier.wait(w_empty.index(b), ((t // WBUF) & 1) ^ 1)
        w_bufs.index(b).store(w)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(b), count=1)


@gluon.jit(do_not_specialize=["M"])
def _kchunk_ws_kernel(
    x_desc,  # x [M, K] in [BLOCK_M, 64] boxes (rows past M arrive as zeros)
    w_desc,  # packed [K // 32, N, 4] int32 in [2, 128, 4] boxes (columns past N arrive as zeros)
    s_desc, z_desc,  # scales, zero points [G, N] in [1, 128] boxes
    bias_ptr, out_ptr,
    partial_ptr,  # [split_k, M, N] fp32 (only with USE_SPLIT)
    counter_ptr,  # [>= tiles] int32, zero between launches (only with USE_SPLIT)
    M, N, K, tiles_per_split, split_k, stride_om,
    GROUP_TILES: gl.constexpr,  # 64-row K tiles a scale group spans (0: one group for all of K)
    HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,  # rows of x a program: 64 or 128 (one MMA warp group), 256 (two: num_warps 8)
    STAGES: gl.constexpr,  # x tiles in shared memory
    RAW: gl.constexpr,  # K tiles of packed words (and their scales, zero points) in shared memory
    WBUF: gl.constexpr,  # weight tiles in shared memory
    DQ_WARPS: gl.constexpr,  # warps a dequantising partition: 4 (one weight column a thread) or 8 (a 32-row chunk)
    DQ_PARTS: gl.constexpr,  # dequantising partitions, taking K tiles in turn (RAW and WBUF multiples of it)
    USE_SPLIT: gl.constexpr,  # K split over split_k programs a tile (their fp32 partials summed in split order)
    DQ_REGS: gl.constexpr,  # registers a dequantising thread (setmaxnreg)
    num_warps: gl.constexpr,
):
    DTYPE: gl.constexpr = x_desc.dtype
    pid = gl.program_id(0)
    split = gl.program_id(1)
    num_m = gl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # neighbouring programs share a weight tile: its words come from L2 after the first
    pid_n = pid // num_m
    t0 = split * tiles_per_split
    num_k_tiles = gl.minimum(tiles_per_split, K // 64 - t0)  # >= 1: the launcher leaves no split empty
    x_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 64], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(DTYPE, [WBUF, 128, 64], x_desc.layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [WBUF, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [WBUF, 1], mbarrier.MBarrierLayout())
    raw_bufs = gl.allocate_shared_memory(gl.int32, [RAW, 2, 128, 4], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(DTYPE, [RAW, 1, 128], s_desc.layout)
    z_bufs = gl.allocate_shared_memory(DTYPE, [RAW, 1, 128], z_desc.layout)
    raw_ready = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
    raw_empty = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=1)
    for i in gl.static_range(WBUF):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    for i in gl.static_range(RAW):
        mbarrier.init(raw_ready.index(i), count=1)
        mbarrier.init(raw_empty.index(i), count=1)
    # (the argument tuples written out in each call: a tuple held in a variable loses its constexprs)
    if DQ_PARTS == 1:
        gl.warp_specialize([
            (_mma_partition, (x_bufs, w_bufs, x_ready, x_empty, w_ready, w_empty, num_k_tiles, pid, pid_m, pid_n,
                              split, split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, BLOCK_M,
                              num_warps, HAS_BIAS, USE_SPLIT)),
            (_dequant_partition, (w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty,
                                  num_k_tiles, 0, 1)),
            (_x_partition, (x_desc, x_bufs, x_ready, x_empty, pid_m, num_k_tiles, t0, BLOCK_M)),
            (_raw_partition, (w_desc, s_desc, z_desc, raw_bufs, s_bufs, z_bufs, raw_ready, raw_empty, pid_n,
                              num_k_tiles, t0, GROUP_TILES)),
        ], [DQ_WARPS, 1, 1], [DQ_REGS, 24, 24])
    elif DQ_PARTS == 2:
        gl.warp_specialize([
            (_mma_partition, (x_bufs, w_bufs, x_ready, x_empty, w_ready, w_empty, num_k_tiles, pid, pid_m, pid_n,
                              split, split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, BLOCK_M,
                              num_warps, HAS_BIAS, USE_SPLIT)),
            (_dequant_partition, (w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty,
                                  num_k_tiles, 0, 2)),
            (_dequant_partition, (w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty,
                                  num_k_tiles, 1, 2)),
            (_x_partition, (x_desc, x_bufs, x_ready, x_empty, pid_m, num_k_tiles, t0, BLOCK_M)),
            (_raw_partition, (w_desc, s_desc, z_desc, raw_bufs, s_bufs, z_bufs, raw_ready, raw_empty, pid_n,
                              num_k_tiles, t0, GROUP_TILES)),
        ], [DQ_WARPS, DQ_WARPS, 1, 1], [DQ_REGS, DQ_REGS, 24, 24])
    else:
        gl.static_assert(DQ_PARTS == 3)
        gl.warp_specialize([
            (_mma_partition, (x_bufs, w_bufs, x_ready, x_empty, w_ready, w_empty, num_k_tiles, pid, pid_m, pid_n,
                              split, split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, BLOCK_M,
                              num_warps, HAS_BIAS, USE_SPLIT)),
            (_dequant_partition, (w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty,
                                  num_k_tiles, 0, 3)),
            (_dequant_partition, (w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty,
                                  num_k_tiles, 1, 3)),
            (_dequant_partition, (w_bufs, raw_bufs, s_bufs, z_bufs, w_ready, w_empty, raw_ready, raw_empty,
                                  num_k_tiles, 2, 3)),
            (_x_partition, (x_desc, x_bufs, x_ready, x_empty, pid_m, num_k_tiles, t0, BLOCK_M)),
            (_raw_partition, (w_desc, s_desc, z_desc, raw_bufs, s_bufs, z_bufs, raw_ready, raw_empty, pid_n,
                              num_k_tiles, t0, GROUP_TILES)),
        ], [DQ_WARPS, DQ_WARPS, DQ_WARPS, 1, 1], [DQ_REGS, DQ_REGS, DQ_REGS, 24, 24])


@gluon.jit
def _store_out(acc, offs_m, offs_n, mask, N, bias_ptr, out_ptr, stride_om, HAS_BIAS: gl.constexpr, DTYPE: gl.constexpr):
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[None, :]
    gl.store(out_ptr + (offs_m * stride_om)[:, None] + offs_n[None, :], acc.to(DTYPE), mask=mask)


def _tma_ok(t: torch.Tensor) -> bool:
    # TMA copies rows whose base and pitch are 16-byte aligned, the last dimension contiguous
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]))


def fits(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel takes the call: 16-bit x, and scales and zero points of x's dtype (the kernel reads them
    by TMA as that type), every operand a TMA can copy (16-byte aligned base and row pitch: N a multiple of 8),
    contiguous words, K a multiple of 64 and each 64-row K tile inside one scale group."""
    K = x.shape[1]
    return (x.dtype in (torch.bfloat16, torch.float16) and scales.dtype == x.dtype and zeros.dtype == x.dtype
            and packed.dtype == torch.int32 and packed.is_contiguous() and packed.shape[0] * 32 == K
            and all(_tma_ok(t) for t in (x, packed, scales, zeros)) and K % BLOCK_K == 0
            and (group_size >= K or group_size % BLOCK_K == 0))


def buffers(dq_parts: int) -> tuple[int, int]:
    """(weight tiles, packed-word tiles) in shared memory for dq_parts dequantising partitions: one weight tile a
    partition (two for a lone one, so that it dequantises a tile while the MMA reads the last), 8 (6 for three
    partitions) word tiles in flight: the ones bench/int4_ws_scan.py measured fastest (bench/RESULTS.md runs 81,
    84)."""
    return max(dq_parts, 2), 6 if dq_parts == 3 else 8


def mma_warps(block_m: int) -> int:
    """Warps of the MMA partition (the kernel's num_warps): one warp group up to 128 rows, two for 256 (each holds a
    [128, 128] fp32 accumulator, 128 registers a thread)."""
    return 8 if block_m == 256 else 4


def one_wave_split(tiles: int, k_tiles: int, num_sms: int) -> int:
    """K split for `tiles` output tiles: as many parts as still fit one wave (a program fills an SM: its shared
    memory), none empty. Splitting past one wave only adds a second, partly idle one (bench/RESULTS.md run 84: down
    at 256 rows, 32 tiles split to 160 programs, 106.8 us)."""
    if tiles >= num_sms:
        return 1
    split = max(1, min(k_tiles, num_sms // tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))


def registers(dq_warps: int, dq_parts: int, block_m: int = 128) -> tuple[int, int]:
    """(registers a thread at launch, registers a dequantising thread): the MMA warp groups' [block_m, 128] fp32
    accumulator gets what the loaders (24 each) and the dequantising warps leave (`setmaxnreg`)."""
    # the loaders take one warp each; partitions are padded to whole warp groups at launch
    warp_groups = -(-(mma_warps(block_m) + dq_warps * dq_parts + 2) // 4)
    launch = min(168, 65536 // (128 * warp_groups) // 8 * 8)
    dq_regs = 128 if dq_parts * dq_warps <= 4 else 96 if dq_parts * dq_warps <= 8 else 80
    if block_m == 256 and dq_warps == 8:  # two MMA warp groups of 168 registers a thread beside it (5 warp groups)
        dq_regs = 56
    return launch, dq_regs


def int4_kchunk_ws(x, packed, scales, zeros, group_size, bias, block_m: int = 128, stages: int = 4,
                   wbuf: int = 2, dq_warps: int = 4, split: int | None = None, raw: int = 8,
                   dq_parts: int = 1) -> torch.Tensor:
    """y = x @ dequantised W + bias -> `[M, N]` in x's dtype; programs of block_m rows x 128 columns, K split in
    `split` (None: `one_wave_split`), dq_parts dequantising partitions of dq_warps warps,
    `stages` x tiles, `wbuf` weight tiles and `raw` packed-word tiles in shared memory. Checks `fits` first."""
    assert fits(x, packed, scales, zeros, group_size), (x.shape, x.stride(), x.dtype, scales.dtype, group_size)
    out = torch.empty((x.shape[0], packed.shape[1]), device=x.device, dtype=x.dtype)
    launch(x, packed, scales, zeros, group_size, bias, out, block_m, stages, wbuf, dq_warps, split, raw, dq_parts)
    return out


def launch(x, packed, scales, zeros, group_size, bias, out, block_m, stages, wbuf, dq_warps, split, raw,
           dq_parts) -> None:
    """`int4_kchunk_ws` into `out` ([M, N], x's dtype), for a caller that checked `fits` (`kernels/int4_kchunk.py`
    does, once a call, before it picks this kernel)."""
    M, K = x.shape
    chunks, N, four = packed.shape
    assert four == 4 and scales.shape == zeros.shape and scales.shape[1] == N, (packed.shape, scales.shape)
    assert block_m in (64, 128, 256) and dq_warps in (4, 8) and dq_parts in (1, 2, 3), (block_m, dq_warps, dq_parts)
    assert block_m < 256 or dq_parts == 1, "256-row programs leave registers for one dequantising partition"
    assert raw % dq_parts == 0 and wbuf % dq_parts == 0, (raw, wbuf, dq_parts)
    assert out.shape == (M, N) and out.dtype == x.dtype and out.stride(1) == 1, (out.shape, out.dtype)
    if M == 0:
        return
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K
    if split is None:
        split = one_wave_split(tiles, k_tiles, _num_sms(x.device.index or 0))
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no empty split
    partial, counters = split_k_workspace(out, split, tiles)
    maxnreg, dq_regs = registers(dq_warps, dq_parts, block_m)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K], SMEM)
    w_desc = TensorDescriptor.from_tensor(packed, [2, BLOCK_N, 4], WORDS_SMEM)
    s_desc = TensorDescriptor.from_tensor(scales, [1, BLOCK_N], ROW_SMEM)
    z_desc = TensorDescriptor.from_tensor(zeros, [1, BLOCK_N], ROW_SMEM)
    _kchunk_ws_kernel[(tiles, split)](
        x_desc, w_desc, s_desc, z_desc, bias if bias is not None else scales, out, partial, counters,
        M, N, K, per_split, split, out.stride(0),
        GROUP_TILES=0 if group_size >= K else group_size // BLOCK_K, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        STAGES=stages, RAW=raw, WBUF=wbuf, DQ_WARPS=dq_warps, DQ_PARTS=dq_parts, USE_SPLIT=split > 1,
        DQ_REGS=dq_regs, num_warps=mma_warps(block_m), maxnreg=maxnreg,
    )
