"""Int4 at many rows: `kernels/int4_kchunk_ws.py` tilings against what serving runs today and bf16 cuBLAS.

  python3 bench/int4_ws_scan.py [--ms 64,80,128,144,192,256,272,384,512,1024,2048] [--shapes gate_up,down]
      [--tilings ws64p2s,ws128p3s] [--json PATH]

For the 8B projections (qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096), GPTQ int4
group 128 in the k-chunk layout, bf16 x, and each M: bf16 `F.linear`, today's pick
(`kernels.int4_kchunk.int4_kchunk_linear`), the pick without this kernel (`prev`: above 64 rows mostly a bf16 copy
of the weight per call, then cuBLAS), dequantise + cuBLAS forced, and each TILINGS entry of the kernel: us per
call (each checked against the torch reference first; a wrong one is printed, WRONG). Then the step's linears
(32 layers) per M, ms: bf16, today's pick, the best ws tiling per shape, and the best of today's pick and the ws
tilings. Timings replay a CUDA graph rotating over >= 256 MB
of weight copies (`bench/quant_kernels.time_us`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.fp8_gemm_scan import parse_ms  # noqa: E402
from bench.quant_kernels import (SHAPE_NAMES, SHAPES, _copies, add_to_step, int4_weights, start_report,  # noqa: E402
                                 time_us, write_report)
from bench.quant_speed import _rel  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels.int4_kchunk import DENSE, int4_kchunk_linear, int4_kchunk_linear_impl, pick_kchunk_config  # noqa: E402
from kernels.int4_matmul import _num_sms  # noqa: E402
from kernels.int4_kchunk_ws import int4_kchunk_ws  # noqa: E402

BF16 = torch.bfloat16
GROUP = 128
TILINGS = {  # (rows a program, x stages, weight buffers, dequantising warps a partition, K split: None = to fill
    # the SMs, K tiles of packed words in flight, dequantising partitions)
    "ws128s": (128, 4, 2, 4, None, 8, 1),
    "ws128p2": (128, 4, 2, 4, 1, 8, 2),
    "ws128p2s": (128, 4, 2, 4, None, 8, 2),
    "ws128p2w4s": (128, 4, 4, 4, None, 8, 2),
    "ws128p3s": (128, 4, 3, 4, None, 6, 3),
    "ws64p2s": (64, 4, 2, 4, None, 8, 2),
    "ws64p3s": (64, 4, 3, 4, None, 6, 3),
    "ws64p2w4s": (64, 4, 4, 4, None, 8, 2),
    "ws256s": (256, 4, 2, 4, None, 8, 1),
    "ws256d8s": (256, 4, 2, 8, None, 8, 1),
    "ws256d8w3s": (256, 3, 3, 8, None, 8, 1),
    "ws256d8": (256, 4, 2, 8, 1, 8, 1),
}


def _weights(k: int, n: int) -> list[tuple]:
    """`int4_weights`' random GPTQ copies, their words in the k-chunk layout."""
    return [(quant_reference.repack_int4_kchunk(q).contiguous(), s, z)
            for q, s, z in int4_weights(k, n, GROUP, _copies(k * n // 2))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="64,80,128,144,192,256,272,384,512,1024,2048")
    ap.add_argument("--json", default="")
    ap.add_argument("--tilings", default="", help="comma-separated TILINGS labels (default: all)")
    ap.add_argument("--shapes", default="", help="comma-separated SHAPES names (default: all)")
    args = ap.parse_args()
    tilings = {lb: TILINGS[lb] for lb in args.tilings.split(",")} if args.tilings else TILINGS
    ms = parse_ms(args.ms)
    _, report = start_report()
    steps = {m: {"bf16": 0.0, "today": 0.0, "ws": 0.0, "best": 0.0} for m in ms}
    shapes = [(name, k, n) for name, (k, n) in zip(SHAPE_NAMES, SHAPES)
              if not args.shapes or name in args.shapes.split(",")]
    for name, k, n in shapes:
        w4 = _weights(k, n)
        w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(_copies(k * n * 2))]
        print(f"\n## {name} K={k} N={n}: us   bf16   today   prev   dense   " + "   ".join(tilings), flush=True)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            ref = quant_reference.int4_kchunk_linear(x, *w4[0][:3], GROUP)
            row = {"name": name, "M": m}
            row["bf16"] = time_us([lambda w=w: F.linear(x, w) for w in w16])
            row["today"] = time_us([lambda w=w: int4_kchunk_linear(x, *w, GROUP) for w in w4])
            prev = pick_kchunk_config(m, n, k, GROUP, _num_sms(0), mma=True, wgmma=True)
            row["prev"] = time_us([lambda w=w: int4_kchunk_linear_impl(x, *w, GROUP, None, prev) for w in w4])
            row["dense"] = time_us([lambda w=w: int4_kchunk_linear_impl(x, *w, GROUP, None, DENSE) for w in w4])
            for label, cfg in tilings.items():
                err = _rel(int4_kchunk_ws(x, *w4[0], GROUP, None, *cfg), ref)
                if err > 1e-2:
                    print(f"WRONG {name} M={m} {label}: relative error {err:.4f}", flush=True)
                row[label] = time_us([lambda w=w, c=cfg: int4_kchunk_ws(x, *w, GROUP, None, *c) for w in w4])
            best_label = min(tilings, key=lambda lb: row[lb])
            add_to_step(steps[m], bf16=row["bf16"], today=row["today"], ws=row[best_label],
                        best=min(row["today"], row[best_label]))
            report["rows"].append(row)
            print(f"M={m:5d} {row['bf16']:7.1f} {row['today']:7.1f} {row['prev']:7.1f} {row['dense']:7.1f} "
                  + " ".join(f"{row[lb]:7.1f}" for lb in tilings)
                  + f"   best {best_label} x{row[best_label] / row['today']:.2f} today, "
                  f"x{row[best_label] / row['bf16']:.2f} bf16", flush=True)
        del w4, w16
        torch.cuda.empty_cache()
    print("\n# linear layers of one 8B step (32 layers), ms: bf16, today's pick, the best ws tiling per shape, "
          "the best of both")
    for m in ms:
        s = steps[m]
        print(f"M={m:5d} {s['bf16']:7.3f} {s['today']:7.3f} {s['ws']:7.3f} {s['best']:7.3f}  best ws "
              f"x{s['ws'] / s['today']:.2f} today, x{s['ws'] / s['bf16']:.2f} bf16", flush=True)
    report["steps_ms"] = steps
    write_report(args.json, report)


if __name__ == "__main__":
    main()
