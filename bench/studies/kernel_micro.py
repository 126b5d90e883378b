"""Micro timings of our Triton kernels at Llama-3-8B shapes on the GPU, against the copy ceiling.

Run: python bench/studies/kernel_micro.py. Prints one table: achieved GB/s (bytes each kernel must move)
and the fraction of the measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "support"))

import kernels  # noqa: E402
from bench.ceilings import copy_bandwidth_gbs, graphed, matmul_tflops, time_ms  # noqa: E402
from kernel_helpers import make_paged_cache  # noqa: E402

BF16 = torch.bfloat16


def main() -> None:
    bw = copy_bandwidth_gbs()
    tf = matmul_tflops()
    rows = [("copy ceiling", "", f"{bw:,.0f} GB/s", ""), ("bf16 matmul 8192^3", "", f"{tf:,.0f} TFLOP/s", "")]
    for num_seqs, ctx, head_dim in [(1, 1024, 128), (1, 8192, 128), (64, 1024, 128), (256, 1024, 128), (256, 1024, 64)]:
        lens = [ctx] * num_seqs
        k, v, tables, seq_lens = make_paged_cache(lens, 8, head_dim, 16, BF16, "cuda")
        q = torch.randn(num_seqs, 32, head_dim, device="cuda", dtype=BF16)
        fn = graphed(lambda: kernels.paged_decode_attention(q, k, v, tables, seq_lens, 0.1))
        ms = time_ms(fn, iters=50)
        nbytes = 2 * num_seqs * ctx * 8 * head_dim * 2
        rows.append((f"decode S={num_seqs} ctx={ctx} D={head_dim}", f"{ms * 1e3:.1f} us",
                     f"{nbytes / ms / 1e6:,.0f} GB/s", f"{nbytes / ms / 1e6 / bw:.0%}"))
    for head_dim in (128, 64):
        chunks = [(0, 1024)] * 8
        lens = [c + n for c, n in chunks]
        k, v, tables, seq_lens = make_paged_cache(lens, 8, head_dim, 16, BF16, "cuda")
        qsl = torch.arange(0, 8 * 1024 + 1, 1024, device="cuda", dtype=torch.int32)
        q = torch.randn(8 * 1024, 32, head_dim, device="cuda", dtype=BF16)
        ms = time_ms(lambda: kernels.prefill_attention(q, k, v, tables, qsl, seq_lens, 1024, 0.1))
        flops = 8 * 32 * 2 * 2 * head_dim * 1024 * 1024 / 2  # causal half
        rows.append((f"prefill 8x1024 D={head_dim}", f"{ms * 1e3:.1f} us", f"{flops / ms / 1e9:,.0f} TFLOP/s",
                     f"{flops / ms / 1e9 / tf:.0%}"))
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    ms = time_ms(graphed(lambda: kernels.rms_norm(x, w, 1e-5, r)), iters=50)
    nbytes = 4 * x.numel() * 2
    rows.append(("rms_norm+res 256x4096", f"{ms * 1e3:.1f} us", f"{nbytes / ms / 1e6:,.0f} GB/s", f"{nbytes / ms / 1e6 / bw:.0%}"))
    gu = torch.randn(256, 2 * 14336, device="cuda", dtype=BF16)
    ms = time_ms(graphed(lambda: kernels.silu_and_mul(gu)), iters=50)
    nbytes = gu.numel() * 2 * 3 // 2
    rows.append(("silu_and_mul 256x14336", f"{ms * 1e3:.1f} us", f"{nbytes / ms / 1e6:,.0f} GB/s", f"{nbytes / ms / 1e6 / bw:.0%}"))
    random.seed(0)
    print(f"\n{'kernel':34} {'time':>10} {'achieved':>16} {'of ceiling':>10}")
    for row in rows:
        print(f"{row[0]:34} {row[1]:>10} {row[2]:>16} {row[3]:>10}")


if __name__ == "__main__":
    main()
