"""Where cuBLAS's FP8 choice breaks: `torch._scaled_mm`, bf16 `F.linear` and a few `kernels/fp8_gemm_tma.py`
tilings at every row count of a range, over the 8B projections.

  python3 bench/fp8_gemm_scan.py [--ms 144-512:16,2048] [--json PATH]

Run 76 (bench/RESULTS.md) found `_scaled_mm` at 288 rows slower than at 384 on every 8B projection (gate_up
103 us against 79, qkv 28 against 26, 256 rows: 55 / 15): cuBLAS's heuristic picks per shape, so the rows serving
sends (decode buckets every 16, mixed-step buckets) are scanned one by one here. Per M: us of each, the best, and
the step's linears (32 layers) in ms for bf16, `_scaled_mm`, the tilings `pick_fp8_tma_config` picks (what serving
runs from 129 rows on Hopper), and the best of `_scaled_mm` and the timed tilings per shape. Timings replay a CUDA
graph rotating over >= 256 MB of weight copies (`bench/quant_kernels.time_us`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.fp8_gemm_sweep import SHAPES, _weights, time_baselines  # noqa: E402
from bench.quant_kernels import add_to_step, start_report, time_us, write_report  # noqa: E402
from bench.quant_speed import _rel  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels.fp8_gemm_tma import _TILINGS, Fp8TmaConfig, fp8_gemm_tma, pick_fp8_tma_config  # noqa: E402
from kernels.fp8_rows import quantize_rows_fp8  # noqa: E402

BF16 = torch.bfloat16
TILINGS = {f"{c.block_m}x{c.block_n}" + ("f" if c.flatten else ""): c for c in (t.config for t in _TILINGS)}  # the picker's
MORE = {  # `--more`: the other tilings run 76 timed (the picker's three before flattening, and four more)
    **{label[:-1]: cfg._replace(flatten=False) for label, cfg in TILINGS.items()},
    "64x128x2": Fp8TmaConfig(64, 128, 128, 4, 3, 2),
    "64x128x2f": Fp8TmaConfig(64, 128, 128, 4, 3, 2, flatten=True),
    "128x128k256": Fp8TmaConfig(128, 128, 256, 8, 3, 1),
    "256x128": Fp8TmaConfig(256, 128, 128, 8, 3, 1),
}


def parse_ms(spec: str) -> list[int]:
    """'144-512:16,2048' -> 144, 160, ..., 512, 2048."""
    out = []
    for part in spec.split(","):
        if "-" in part:
            span, _, step = part.partition(":")
            lo, hi = (int(v) for v in span.split("-"))
            out += list(range(lo, hi + 1, int(step or 16)))
        else:
            out.append(int(part))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="144-512:16,2048")
    ap.add_argument("--json", default="")
    ap.add_argument("--more", action="store_true", help="also time the MORE tilings")
    args = ap.parse_args()
    tilings = {**TILINGS, **(MORE if args.more else {})}
    ms = parse_ms(args.ms)
    _, report = start_report()
    steps = {m: {"bf16": 0.0, "scaled_mm": 0.0, "picked": 0.0, "best": 0.0} for m in ms}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, k, n in SHAPES:
        w16, w8 = _weights(k, n)
        print(f"\n## {name} K={k} N={n}: us   bf16   _scaled_mm   " + "   ".join(tilings), flush=True)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            xq, xs = quantize_rows_fp8(x)
            ref = quant_reference.fp8_scaled_matmul(xq, xs, *w8[0])
            t16, tmm = time_baselines(x, xq, xs, w16, w8)
            row = {"name": name, "M": m, "bf16_us": t16, "scaled_mm_us": tmm}
            for label, cfg in tilings.items():
                err = _rel(fp8_gemm_tma(xq, xs, *w8[0], None, BF16, cfg), ref)
                assert err < 1e-2, (name, m, label, err)
                row[label] = time_us([lambda w=w, c=cfg: fp8_gemm_tma(xq, xs, *w, None, BF16, c) for w in w8])
            best_label = min(tilings, key=lambda lb: row[lb])
            best = min(tmm, row[best_label])
            picked = pick_fp8_tma_config(m, n, k, num_sms)
            row["picked"] = next(row[lb] for lb, c in tilings.items() if c == picked)
            add_to_step(steps[m], bf16=t16, scaled_mm=tmm, picked=row["picked"], best=best)
            report["rows"].append(row)
            print(f"M={m:5d} {t16:7.1f} {tmm:7.1f} " + " ".join(f"{row[lb]:7.1f}" for lb in tilings)
                  + f"   picked x{row['picked'] / tmm:.2f} _scaled_mm; best {best_label} x{row[best_label] / tmm:.2f}",
                  flush=True)
        del w16, w8
        torch.cuda.empty_cache()
    print("\n# linear layers of one 8B step (32 layers), ms: bf16, _scaled_mm, the picked tilings, the best of "
          "_scaled_mm and the timed tilings per shape")
    for m in ms:
        s = steps[m]
        print(f"M={m:5d} {s['bf16']:7.3f} {s['scaled_mm']:7.3f} {s['picked']:7.3f} {s['best']:7.3f}  picked "
              f"x{s['picked'] / s['scaled_mm']:.2f} _scaled_mm, x{s['bf16'] / s['picked']:.2f} faster than bf16", flush=True)
    report["steps_ms"] = steps
    write_report(args.json, report)


if __name__ == "__main__":
    main()
