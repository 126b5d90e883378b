"""The per-launch floor of a weight-streaming kernel: how fast a kernel that only READS a linear's bytes runs.

The batch-1 bars compare whole steps with "bytes / copy bandwidth", but each linear is its own launch of
8-235 MB, and a launch of that size never reaches the big-copy bandwidth (ramp-up, tail, one wave of
programs). This script times a Triton kernel that reads N bytes with 16-byte loads and writes one word
per program (its best of 1-8 programs per SM and three block shapes), for the byte counts of the 8B
layer's four linears as int4 g128 (weights + scales + zero points), FP8 and bf16, timed exactly like the
quantized kernels (`bench.quant_kernels.time_us`: a CUDA graph of calls over rotating copies, so every
read comes from HBM). What a GEMV could reach per launch, and what a layer's linears cost at that floor.

  python3 bench/read_floor.py            # one GPU, ~15 s
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.quant_kernels import NUM_LAYERS, SHAPE_NAMES, SHAPES, _copies, int4_bytes, time_us  # noqa: E402

# Bytes a linear's weights take: int4 g128 with its bf16 scales and zero points, FP8 with fp32 per-channel
# scales, bf16.
WEIGHT_BYTES = {
    "int4": lambda k, n: int4_bytes(0, k, n, 128),
    "fp8": lambda k, n: k * n + 4 * n,
    "bf16": lambda k, n: 2 * k * n,
}


@triton.jit
def _read_kernel(src, out, n_vec, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # Program p reads 16-byte vectors p * BLOCK + i * programs * BLOCK + [0, BLOCK): a grid-stride walk.
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, 4], dtype=tl.int32)
    for i in range(ITERS):
        idx = offs + i * step
        acc ^= tl.load(src + idx[:, None] * 4 + tl.arange(0, 4)[None, :], mask=(idx < n_vec)[:, None], other=0,
                       eviction_policy="evict_first")
    tl.store(out + pid, tl.sum(tl.sum(acc, 1), 0))  # one word a program: the loads cannot be dropped


def read_floor_us(nbytes: int, num_sms: int) -> tuple[float, tuple[int, int, int]]:
    """(best us, (programs per SM, block of 16-byte vectors, warps)) to read `nbytes` from HBM."""
    nbytes = nbytes // 16 * 16
    n_vec = nbytes // 16
    bufs = [torch.ones(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(_copies(nbytes))]
    out = torch.empty(num_sms * 8, dtype=torch.int32, device="cuda")
    best = (float("inf"), (0, 0, 0))
    for per_sm in (1, 2, 4, 8):
        for block, warps in ((256, 4), (512, 4), (1024, 8)):
            programs = num_sms * per_sm
            iters = triton.cdiv(n_vec, programs * block)
            t = time_us([lambda b=b: _read_kernel[(programs,)](b, out, n_vec, ITERS=iters, BLOCK=block, num_warps=warps)
                         for b in bufs])
            best = min(best, (t, (per_sm, block, warps)))
    return best


def main() -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: a read-only kernel per linear of the 8B layer, us (TB/s)")
    for fmt, weight_bytes in WEIGHT_BYTES.items():
        total = 0.0
        for name, (k, n) in zip(SHAPE_NAMES, SHAPES):
            nbytes = weight_bytes(k, n)
            t, cfg = read_floor_us(nbytes, num_sms)
            total += t
            print(f"  {fmt:5} {name:8} {nbytes / 1e6:6.1f} MB {t:7.1f} us ({nbytes / t / 1e6:4.2f} TB/s)  "
                  f"programs/SM, block, warps {cfg}", flush=True)
        print(f"  {fmt:5} layer {total:.1f} us, x {NUM_LAYERS} layers {total * NUM_LAYERS / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
