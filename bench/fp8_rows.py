"""FP8 rows written by the op before the linear (`kernels/fp8_rows.py`) against a quantisation launch of their own.

One command (one H100/H200, under a minute):

  python3 bench/fp8_rows.py [--ms 17,32,64,128,256,512,2048] [--json PATH]

At the 8B shapes (hidden 4096, MLP 14336), per M, µs from CUDA-graph replays (`bench/quant_kernels.time_us`):
- RMSNorm with the residual add, then `quantize_rows_fp8`, against the RMSNorm writing the FP8 rows itself;
- SwiGLU of a [M, 2 x 14336] gate|up, then `quantize_rows_fp8`, against the SwiGLU writing them;
- one layer's FP8 linears as serving chains them (norm -> qkv, norm -> gate_up (gated) -> down; o_proj
  left out: its input comes from attention), each linear quantising its own input, against the norm and the
  SwiGLU handing their FP8 rows on (`fp8_rows=True`), and the step total (x 32 layers) of both.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels  # noqa: E402
from bench.quant_kernels import start_report, time_us, write_report  # noqa: E402
from kernels.fp8_rows import quantize_rows_fp8  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="17,32,64,128,256,512,2048")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    _, report = start_report()
    H, I, layers = 4096, 14336, 32
    dev, bf16 = "cuda", torch.bfloat16
    norm_w = (1 + 0.1 * torch.randn(H, device=dev)).to(bf16)
    w_qkv, s_qkv = kernels.quantize_fp8(torch.randn(6144, H, device=dev) * 0.02)
    w_gu, s_gu = kernels.quantize_fp8(torch.randn(2 * I, H, device=dev) * 0.02)
    w_down, s_down = kernels.quantize_fp8(torch.randn(H, I, device=dev) * 0.02)
    rows = []
    print(f"{'M':>5} {'norm+quant':>10} {'norm rows':>9} {'silu+quant':>10} {'silu rows':>9} "
          f"{'layer sep':>9} {'layer rows':>10} {'step sep ms':>11} {'step rows ms':>12}")
    for m in [int(v) for v in args.ms.split(",")]:
        x = torch.randn(m, H, device=dev, dtype=bf16)
        res = torch.randn(m, H, device=dev, dtype=bf16)
        gu = torch.randn(m, 2 * I, device=dev, dtype=bf16)

        def norm_sep():
            quantize_rows_fp8(kernels.rms_norm(x, norm_w, 1e-5, res)[0])

        def norm_rows():
            kernels.rms_norm(x, norm_w, 1e-5, res, fp8_rows=True)

        def silu_sep():
            quantize_rows_fp8(kernels.silu_and_mul(gu))

        def silu_rows():
            kernels.silu_and_mul(gu, fp8_rows=True)

        def layer(with_rows: bool):
            def run():
                h, r = kernels.rms_norm(x, norm_w, 1e-5, res, fp8_rows=with_rows)
                kernels.fp8_linear(h, w_qkv, s_qkv)
                h, _ = kernels.rms_norm(x, norm_w, 1e-5, r, fp8_rows=with_rows)
                a = kernels.fp8_linear(h, w_gu, s_gu, gated=True, fp8_rows=with_rows)
                kernels.fp8_linear(a, w_down, s_down)
            return run

        t = {"m": m, "norm_sep": time_us([norm_sep]), "norm_rows": time_us([norm_rows]),
             "silu_sep": time_us([silu_sep]), "silu_rows": time_us([silu_rows]),
             "layer_sep": time_us([layer(False)]), "layer_rows": time_us([layer(True)])}
        rows.append(t)
        print(f"{m:>5} {t['norm_sep']:>10.1f} {t['norm_rows']:>9.1f} {t['silu_sep']:>10.1f} {t['silu_rows']:>9.1f} "
              f"{t['layer_sep']:>9.1f} {t['layer_rows']:>10.1f} {t['layer_sep'] * layers / 1e3:>11.3f} "
              f"{t['layer_rows'] * layers / 1e3:>12.3f}")
    report["rows"] = rows
    write_report(args.json, report)


if __name__ == "__main__":
    main()
