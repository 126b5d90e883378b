"""FP8 GEMM sweep: `kernels/fp8_gemm.py` tilings against `torch._scaled_mm` (rowwise) and bf16 cuBLAS.

One command (one H100/H200, about 3 minutes, mostly Triton compiles):

  python3 bench/fp8_gemm_sweep.py [--json PATH] [--ms 24,32,64,128,256,512,2048]

For the 8B projections (qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096) and
each M, on activations already quantised per token (`quantize_rows_fp8`, common to both paths, not
timed): bf16 `F.linear`, `torch._scaled_mm` as `kernels/fp8_matmul.scaled_mm_linear` calls it, the
picked tiling (`pick_fp8_gemm_config`) and each candidate at the split-K factors reaching 1 and 2
programs per SM: µs, GB/s (FP8 weight + activation + output bytes), TFLOP/s and the relative error
against `quant_reference.fp8_scaled_matmul`. Timings replay a CUDA graph of calls rotating over
>= 256 MB of weight copies (`bench/quant_kernels.time_us`). Last: the linear layers of one 8B step
(32 layers) per M for bf16, `_scaled_mm`, the picked tiling and the best tiling per shape.

`--tma` times `kernels/fp8_gemm_tma.py` (TMA operands, persistent programs) instead of the pointer kernel:
its candidate tilings (`tma_candidates`: tiles, 1-2 persistent programs per SM, the tile loop flattened with the
K loop or not); the step table then gives the best TMA tiling per shape and the best of it and
`_scaled_mm` per shape.

(`--fused`, which timed a variant of the kernel quantising x itself, went with that variant: it lost,
bench/RESULTS.md run 59. `bench/fp8_rows.py` times the activation quantisation as serving runs it.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402

import kernels  # noqa: E402
from bench.quant_kernels import _copies, start_report, time_us, write_report  # noqa: E402
from bench.quant_speed import _rel, _try  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, pick_fp8_gemm_config  # noqa: E402
from kernels.fp8_gemm_tma import Fp8TmaConfig, fp8_gemm_tma, pick_fp8_tma_config  # noqa: E402
from kernels.fp8_rows import quantize_rows_fp8  # noqa: E402
from kernels.int4_matmul import _split_for  # noqa: E402

BF16 = torch.bfloat16
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
NUM_LAYERS = 32


def candidates(m: int) -> list[Fp8GemmConfig]:
    """Tilings for one M (split_k 0: filled in per shape)."""
    C = Fp8GemmConfig
    bms = [bm for bm in (16, 32, 64, 128) if bm >= min(m, 64) // 2 and bm <= max(16, 2 * m)]
    out = []
    for bm in bms:
        for bn, bk, w, st in ((64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 4, 6), (128, 256, 4, 3),
                              (128, 128, 8, 4), (256, 128, 8, 3), (64, 256, 4, 4)):
            if bm == 128 and w == 4 and bn >= 128:
                continue
            out.append(C(bm, bn, bk, 0, w, st))
    return out


def tma_candidates() -> list[Fp8TmaConfig]:
    """`fp8_gemm_tma` tilings: (rows, columns, K step, warps, stages) tiles x 1-2 persistent programs per SM (2 only
    where two programs' stages fit an SM) x the tile loop flattened with the K loop or not."""
    out = []
    for bm, bn, bk, w, st in ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (64, 256, 128, 4, 4), (64, 256, 128, 8, 4),
                              (128, 128, 128, 4, 5), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3), (64, 128, 128, 4, 3),
                              (64, 128, 128, 4, 6), (128, 128, 256, 8, 3)):
        for per_sm in (1, 2) if 2 * st * (bm + bn) * bk <= 200 * 1024 else (1,):
            for flatten in (False, True):
                out.append(Fp8TmaConfig(bm, bn, bk, w, st, per_sm, flatten))
    return out


def with_splits(cfg: Fp8GemmConfig, m: int, n: int, k: int, num_sms: int) -> list[Fp8GemmConfig]:
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    kt = triton.cdiv(k, cfg.block_k)
    return [cfg._replace(split_k=s) for s in sorted({_split_for(tiles, kt, p * num_sms) for p in (1, 2)})]


def _weights(k: int, n: int) -> tuple[list, list]:
    """Rotating copies (>= 256 MB each kind): bf16 [N, K]; FP8 (e4m3 [N, K], per-channel fp32 scale [N])."""
    w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(_copies(k * n * 2))]
    return w16, [kernels.quantize_fp8(w16[i % len(w16)]) for i in range(_copies(k * n))]


def time_baselines(x: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, w16: list, w8: list) -> tuple[float, float]:
    """(bf16 `F.linear` us, `torch._scaled_mm` us as `kernels/fp8_matmul.scaled_mm_linear` calls it) over the
    rotating weight copies `_weights` returns."""
    t16 = time_us([lambda w=w: F.linear(x, w) for w in w16])
    tmm = time_us([lambda w=w: torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].reshape(1, -1),
                                                out_dtype=BF16) for w in w8])
    return t16, tmm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--ms", default="")
    ap.add_argument("--tma", action="store_true", help="time kernels/fp8_gemm_tma.py's tilings (not fp8_gemm's)")
    args = ap.parse_args()
    ms = [int(v) for v in (args.ms or "24,32,64,128,256,512,2048").split(",")]
    t0 = time.perf_counter()
    num_sms, report = start_report()
    bw = report["copy_gbs"]
    totals = {m: {"bf16": 0.0, "scaled_mm": 0.0, "picked": 0.0, "best": 0.0, "best_or_mm": 0.0} for m in ms}
    for name, k, n in SHAPES:
        w16, w8 = _weights(k, n)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            xq, xs = quantize_rows_fp8(x)
            ref = quant_reference.fp8_scaled_matmul(xq, xs, *w8[0])
            nbytes, flops = n * k + m * k + 2 * m * n, 2 * m * k * n
            t16, tmm = time_baselines(x, xq, xs, w16, w8)
            if args.tma:
                picked = pick_fp8_tma_config(m, n, k, num_sms)
                cands, run = [picked] + tma_candidates(), fp8_gemm_tma
            else:
                picked = pick_fp8_gemm_config(m, n, k, num_sms)
                cands = [picked] + [c for base in candidates(m) for c in with_splits(base, m, n, k, num_sms)]
                run = fp8_gemm
            results = []
            row = {"name": name, "K": k, "N": n, "M": m, "bf16_us": t16, "scaled_mm_us": tmm, "configs": []}
            print(f"\n## {name} K={k} N={n} M={m}: bf16 {t16:.1f} us; _scaled_mm {tmm:.1f} us "
                  f"({nbytes / tmm / 1e3:,.0f} GB/s, {nbytes / tmm / 1e3 / bw:.0%} of copy)", flush=True)
            for cfg in dict.fromkeys(cands):
                err = _try(lambda c=cfg: _rel(run(xq, xs, *w8[0], None, BF16, c), ref))
                t = (_try(lambda c=cfg: time_us([lambda w=w: run(xq, xs, *w, None, BF16, c) for w in w8]))
                     if isinstance(err, float) else err)
                ok = isinstance(t, float) and err < 1e-2
                row["configs"].append({"config": list(cfg), "us": t if ok else None, "err": err if isinstance(err, float) else None})
                if ok:
                    results.append((t, cfg))
                tag = " (picked)" if cfg == picked else ""
                print(f"  {tuple(cfg)}{tag}: " + (f"{t:.1f} us {nbytes / t / 1e3:,.0f} GB/s {flops / t / 1e6:,.0f} "
                                                  f"TFLOP/s x{t / tmm:.2f} _scaled_mm err {err:.1e}" if ok else
                                                  f"FAIL {t if not isinstance(t, float) else err}"), flush=True)
            results.sort(key=lambda r: r[0])
            t_pick = next((t for t, c in results if c == picked), float("nan"))
            if results:
                print(f"  best {tuple(results[0][1])} {results[0][0]:.1f} us (x{results[0][0] / tmm:.2f} _scaled_mm, "
                      f"{nbytes / results[0][0] / 1e3 / bw:.0%} of copy); picked {t_pick:.1f}", flush=True)
            best = results[0][0] if results else float("nan")
            for key, v in (("bf16", t16), ("scaled_mm", tmm), ("picked", t_pick), ("best", best),
                           ("best_or_mm", min(best, tmm))):
                totals[m][key] += v * NUM_LAYERS / 1e3
            report["rows"].append(row)
        del w16, w8
        torch.cuda.empty_cache()
        print(f"# {name} done: {time.perf_counter() - t0:.0f} s", flush=True)
        write_report(args.json, report)
    print("\n# linear layers of one 8B step (qkv, o, gate_up, down x 32 layers), ms")
    for m in ms:
        t = totals[m]
        print(f"M={m}: bf16 {t['bf16']:.3f}; _scaled_mm {t['scaled_mm']:.3f} (x{t['scaled_mm'] / t['bf16']:.2f} bf16); "
              f"picked {t['picked']:.3f} (x{t['picked'] / t['scaled_mm']:.2f} _scaled_mm); best per shape "
              f"{t['best']:.3f} (x{t['best'] / t['scaled_mm']:.2f}); best of it and _scaled_mm per shape "
              f"{t['best_or_mm']:.3f} (x{t['best_or_mm'] / t['scaled_mm']:.2f}, x{t['best_or_mm'] / t['bf16']:.2f} bf16)",
              flush=True)
    report["per_step_ms"] = {str(m): totals[m] for m in ms}
    write_report(args.json, report)
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
