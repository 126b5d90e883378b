"""Paged KV layouts on the GPU: decode attention's KV read bandwidth per cache layout and page size.

RESULTS run 15 found no launch shape of stage 1 above 67 % (head_dim 64) / 82 % (head_dim 128) of
copy bandwidth and named the layout as what is left: in the token-major cache
`[blocks, page, kv_heads, head_dim]` one KV head's page is `page` rows of head_dim x 2 bytes, each
`kv_heads x head_dim x 2` bytes from the next. A head-major cache `[blocks, kv_heads, page, head_dim]`
keeps that page contiguous. The kernel reads the cache through its strides, so both layouts run the
same compiled code: the head-major cache is passed as a permuted view of shape
`[blocks, page, kv_heads, head_dim]`. Also times the bf16 GEMMs of a decode step at the workload's
batch sizes (cuBLAS through `F.linear`) against the matmul ceiling and copy bandwidth, to see which
of the two halves of the step has room left.

  python bench/studies/decode_attention_layout.py [--out /tmp/layout.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs, graphed, matmul_tflops, time_ms  # noqa: E402
from bench.studies.decode_attention_sweep import make_case  # noqa: E402
from kernels.paged_decode_attention import _default_num_splits, paged_decode_attention_impl  # noqa: E402

KV_HEADS = 8  # the Llama shapes (make_case builds 32 query heads over 8 KV heads)


def attention_rows(bw: float) -> list[dict]:
    rows = []
    layouts = [("token-major", 16, False), ("head-major", 16, True), ("head-major", 32, True),
               ("head-major", 64, True)]
    for head_dim in (64, 128):
        for num_seqs in (256, 64):
            ref = None
            for name, page, head_major in layouts:
                q, k, v, tables, lens, kv_bytes = make_case(num_seqs, head_dim, 1 << 21, page=page, head_major=head_major)
                if ref is None:
                    ref = (q, lens)
                splits = _default_num_splits(q, KV_HEADS, tables.shape[1] * page, 64)
                for block_n, warps, stages in ((64, 4, 2), (128, 4, 3), (64, 4, 3)):
                    fn = lambda: paged_decode_attention_impl(q, k, v, tables, lens, head_dim**-0.5, block_n=block_n,  # noqa: E731
                                                             num_splits=splits, num_warps=warps, num_stages=stages)
                    ms = time_ms(fn, iters=30, warmup=3)
                    row = {"head_dim": head_dim, "num_seqs": num_seqs, "layout": name, "page": page,
                           "shape": f"{block_n}/{warps}/{stages}", "splits": splits, "us": ms * 1e3,
                           "of_copy": kv_bytes / (ms * 1e-3) / 1e9 / bw}
                    rows.append(row)
                    print(f"d={head_dim:3d} S={num_seqs:3d} {name:11s} page {page:2d} {row['shape']:7s} "
                          f"{row['us']:7.1f} us  {row['of_copy']:6.1%} of copy", flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    return rows


def split_rows(bw: float) -> list[dict]:
    """Token-major page 16 (the engine's cache) at the batch sizes a draining workload passes through,
    per split count and launch shape: the split heuristic sizes the grid to ~2 programs per SM."""
    rows = []
    for head_dim in (64, 128):
        for num_seqs in (256, 128, 64, 32, 16):
            q, k, v, tables, lens, kv_bytes = make_case(num_seqs, head_dim, 1 << 21)
            default = _default_num_splits(q, KV_HEADS, tables.shape[1] * 16, 64)
            line = []
            for splits in sorted({1, 2, 4, 8, 16, default}):
                for block_n, warps, stages in ((64, 4, 2), (128, 4, 3), (64, 2, 3)):
                    fn = lambda: paged_decode_attention_impl(q, k, v, tables, lens, head_dim**-0.5, block_n=block_n,  # noqa: E731
                                                             num_splits=splits, num_warps=warps, num_stages=stages)
                    ms = graph_ms(fn)
                    rows.append({"head_dim": head_dim, "num_seqs": num_seqs, "splits": splits, "default": default,
                                 "shape": f"{block_n}/{warps}/{stages}", "us": ms * 1e3,
                                 "of_copy": kv_bytes / (ms * 1e-3) / 1e9 / bw})
                    line.append(f"{splits}:{block_n}/{warps}/{stages} {ms * 1e3:.0f}")
            best = min((r for r in rows if r["head_dim"] == head_dim and r["num_seqs"] == num_seqs), key=lambda r: r["us"])
            cur = next(r for r in rows if r["head_dim"] == head_dim and r["num_seqs"] == num_seqs
                       and r["splits"] == default and r["shape"] == "64/4/2")
            print(f"d={head_dim} S={num_seqs}: default {default} split(s) 64/4/2 {cur['us']:.0f} us "
                  f"({cur['of_copy']:.1%}); best {best['splits']}:{best['shape']} {best['us']:.0f} us "
                  f"({best['of_copy']:.1%}) | " + " ".join(line), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def graph_ms(fn, reps: int = 10) -> float:
    """Milliseconds per call of `fn`, from a CUDA graph of `reps` calls (no launch gaps in the timing)."""
    return time_ms(graphed(fn, reps), iters=20, warmup=2) / reps


def gemm_rows(bw: float, peak: float) -> list[dict]:
    """Each projection of the 1B / 8B shapes at decode-step row counts: us, % of peak, % of copy bw."""
    shapes = {"1B": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
                     "lm_head": (2048, 128256)},
              "8B": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
                     "lm_head": (4096, 128256)}}
    rows = []
    for model, projs in shapes.items():
        for m in (64, 128, 256, 320, 512):
            for name, (k, n) in projs.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                ms = graph_ms(lambda: F.linear(x, w))  # noqa: B023
                flops, nbytes = 2 * m * k * n, 2 * (k * n + m * k + m * n)
                ideal = max(flops / (peak * 1e12), nbytes / (bw * 1e9)) * 1e3
                rows.append({"model": model, "m": m, "proj": name, "us": ms * 1e3, "of_ideal": ideal / ms,
                             "tflops": flops / (ms * 1e-3) / 1e12})
                del x, w
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            us = sum(r["us"] for r in sel)
            print(f"{model} M={m:3d}: " + "  ".join(f"{r['proj']} {r['us']:.0f}us ({r['of_ideal']:.0%})" for r in sel)
                  + f"  | sum {us:.0f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--layouts", action="store_true", help="also compare token-major and head-major caches")
    args = ap.parse_args()
    bw, peak = copy_bandwidth_gbs(), matmul_tflops()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:,.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    out = {"device": torch.cuda.get_device_name(), "copy_gbs": bw, "peak_tflops": peak,
           "gemm": gemm_rows(bw, peak), "splits": split_rows(bw)}
    if args.layouts:
        out["attention"] = attention_rows(bw)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
