"""The 8B projections' quantized kernels as serving runs them, one launch each, for Nsight Compute.

Why: whether a kernel is bound by HBM, by instruction issue or by latency decides what to change
(fewer instructions a weight, more bytes in flight, fewer launches), and timings alone cannot tell.
Run under `ncu` on a GPU machine (about a minute), e.g.:

  ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
      --section LaunchStats python3 bench/int4_ncu.py [--ms 1,256] [--shapes gate_up,down]

Each (shape, M) runs the int4 k-chunk linear (`kernels.int4_kchunk_linear`, the tiling serving
picks), then the FP8 linear (`kernels.fp8_linear`, per-channel e4m3 weights) on the same shape:
warm-up calls first (compiles), then one call each between `cudaProfilerStart` / `Stop`, so that
ncu with `--profile-from-start off` sees only those (every kernel they launch), labelled on stdout
in launch order.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels  # noqa: E402
from bench.quant_kernels import int4_weights  # noqa: E402
from kernels import quant_reference  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
GROUP = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,256")
    ap.add_argument("--shapes", default="gate_up,down")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        qweight, scales, zeros = int4_weights(k, n, GROUP, 1)[0]
        packed = quant_reference.repack_int4_kchunk(qweight)
        w8, s8 = quant_reference.quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):  # compile and warm
                kernels.int4_kchunk_linear(x, packed, scales, zeros, GROUP)
                kernels.fp8_linear(x, w8, s8)
            torch.cuda.synchronize()
            print(f"profiled: int4 {name} M={m} (K={k}, N={n}), then fp8 {name} M={m}", flush=True)
            torch.cuda.profiler.start()
            kernels.int4_kchunk_linear(x, packed, scales, zeros, GROUP)
            kernels.fp8_linear(x, w8, s8)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
