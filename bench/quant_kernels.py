"""Quantized linear micro-benchmark at Llama-3-8B layer shapes: bf16 F.linear vs int4 vs FP8.

Run: python bench/quant_kernels.py [--sweep] [--json PATH]. Prints one table per shape and M:
bf16 `F.linear` µs, int4 (group 128) µs, FP8 (per-channel weights, per-token activations) µs,
int4 achieved GB/s and the fraction of the int4 bandwidth floor (bytes it must move / measured
copy bandwidth). Each timing replays a CUDA graph of calls that rotate over enough weight copies
to overflow L2 (so weights stream from HBM as they do across a model's layers). `--sweep` times
candidate tilings of the int4 kernel per (shape, M) first and prints the fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from bench.ceilings import copy_bandwidth_gbs  # noqa: E402
from kernels.int4_matmul import MatmulConfig, _split_for, pick_config, quant_linear_impl  # noqa: E402

BF16 = torch.bfloat16
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N) of the linears in SHAPE_NAMES
SHAPE_NAMES = ("qkv", "o", "gate_up", "down")
NUM_LAYERS = 32
ROTATE_BYTES = 256 << 20  # several times the H200's L2


def _copies(nbytes: int) -> int:
    return max(2, min(32, -(-ROTATE_BYTES // nbytes)))


def time_us(calls: list, reps: int = 5) -> float:
    """Median µs per call of a CUDA graph that runs every function in `calls` once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return sorted(times)[len(times) // 2]


def start_report() -> tuple[int, dict]:
    """A sweep's first lines: the device, its SM count and versions, then the copy bandwidth measured now;
    returns (SM count, the report dict with device, copy_gbs and an empty rows list)."""
    import triton

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:,.0f} GB/s", flush=True)
    return num_sms, {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": []}


def write_report(path: str, report: dict) -> None:
    """The report as JSON at `path` (nothing without one); called as parts finish, so a cut run keeps them."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)


def add_to_step(step: dict, **us: float) -> None:
    """Add one projection's µs a call, key by key, to the step's linears in ms (NUM_LAYERS layers of it)."""
    for key, v in us.items():
        step[key] += v * NUM_LAYERS / 1e3


def int4_weights(k: int, n: int, group_size: int, copies: int):
    out = []
    for _ in range(copies):
        qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
        scales = (torch.rand(k // group_size, n, device="cuda") / 16).to(BF16)
        zeros = torch.randint(0, 16, (k // group_size, n), device="cuda").to(BF16)
        out.append((qweight, scales, zeros))
    return out


def int4_bytes(m: int, k: int, n: int, group_size: int) -> int:
    return k * n // 2 + 2 * (k // group_size) * n * 2 + m * k * 2 + m * n * 2


def time_int4(x, ws, group_size: int, config: MatmulConfig | None) -> float:
    calls = [lambda w=w: quant_linear_impl(x, w[0], w[1], w[2], None, 4, group_size, None, config) for w in ws]
    return time_us(calls)


def candidates(m: int) -> list[MatmulConfig]:
    """Tilings to time per M (split_k 0: filled in by with_splits)."""
    if m == 1:
        gemv = [MatmulConfig(1, bn, bk, 0, w, 1, fma_tile=fma) for bn, w in ((128, 1), (256, 2), (512, 4))
                for bk in (128, 64) for fma in (False, True)]
        # 8 columns per thread (x loads and conversions amortised over twice the weights): fewest
        # SASS instructions per weight in a static count (5.0 against 6.0 for the default)
        gemv += [MatmulConfig(1, 1024, 32, 0, 4, 1, fma_tile=fma) for fma in (False, True)]
        gemv += [MatmulConfig(1, 512, 32, 0, 2, 1, fma_tile=True)]
        return gemv + [MatmulConfig(16, 64, 128, 0, 4, 3, True)]
    if m <= 4:
        return [MatmulConfig(2, 512, 64, 0, 4, 1, fma_tile=True), MatmulConfig(4, 512, 64, 0, 4, 1, fma_tile=True),
                MatmulConfig(16, 64, 128, 0, 4, 3, True)]
    if m <= 16:
        return [MatmulConfig(16, 64, 128, 0, 4, 3, True), MatmulConfig(16, 128, 128, 0, 4, 3, True),
                MatmulConfig(16, 64, 128, 0, 4, 3), MatmulConfig(16, 128, 64, 0, 4, 3),
                MatmulConfig(16, 64, 256, 0, 4, 3, True)]
    if m <= 64:
        return [MatmulConfig(64, 64, 128, 0, 4, 3), MatmulConfig(64, 64, 128, 0, 4, 3, True),
                MatmulConfig(32, 64, 128, 0, 4, 3, True), MatmulConfig(64, 128, 64, 0, 4, 3)]
    return [MatmulConfig(128, 64, 64, 0, 4, 4), MatmulConfig(128, 128, 64, 0, 8, 3),
            MatmulConfig(128, 128, 128, 0, 8, 3, True), MatmulConfig(64, 128, 64, 0, 4, 4),
            MatmulConfig(128, 256, 64, 0, 8, 3), MatmulConfig(0, 0, 0, 1, 0, 0)]


def with_splits(cfg: MatmulConfig, m: int, n: int, k: int, num_sms: int) -> list[MatmulConfig]:
    if cfg.split_k:
        return [cfg]
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    k_tiles = -(-k // cfg.block_k)
    out = {_split_for(tiles, k_tiles, 0)}
    for per_sm in ((1, 2, 4, 8) if m <= 64 else (1, 2)):
        out.add(_split_for(tiles, k_tiles, per_sm * num_sms))
    return [cfg._replace(split_k=s) for s in sorted(out)]


def sweep(num_sms: int, report: dict) -> dict:
    """Time the candidate tilings; returns {(K, N, M): (best µs, best config)}."""
    print("\n# int4 tiling sweep (group 128): default and best three per shape and M", flush=True)
    best = {}
    for k, n in SHAPES:
        ws = int4_weights(k, n, 128, _copies(k * n // 2))
        for m in (1, 2, 4, 16, 64, 256, 2048):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            results = []
            for base in candidates(m):
                for cfg in with_splits(base, m, n, k, num_sms):
                    try:
                        results.append((time_int4(x, ws, 128, cfg), cfg))
                    except Exception as e:  # a tiling that does not fit (shared memory, registers)
                        print(f"  skip {tuple(cfg)}: {type(e).__name__} {str(e)[:120]}", flush=True)
            results.sort(key=lambda r: r[0])
            default = pick_config(m, n, k, 128, 4, False, num_sms)
            d_us = time_int4(x, ws, 128, default)
            print(f"K={k} N={n} M={m}: default {tuple(default)} {d_us:.1f} us; best " +
                  "; ".join(f"{tuple(c)} {t:.1f} us" for t, c in results[:3]), flush=True)
            report.setdefault("sweep", []).append(
                {"K": k, "N": n, "M": m, "default": [list(default), d_us],
                 "best": [[list(c), t] for t, c in results[:5]]})
            best[(k, n, m)] = results[0] if results and results[0][0] < d_us else (d_us, default)
        del ws
        torch.cuda.empty_cache()
    return best


def table(bw: float, report: dict, best: dict) -> None:
    print(f"\ncopy bandwidth {bw:,.0f} GB/s; int4 group 128 (bf16 activations{', best swept tiling' if best else ''}); "
          "fp8 per-channel weights, per-token activations")
    print(f"{'K x N':>12} {'M':>5} {'bf16 us':>9} {'int4 us':>9} {'fp8 us':>9} {'int4/bf16':>9} "
          f"{'fp8/bf16':>9} {'int4 GB/s':>10} {'of floor':>9}")
    per_token = {"bf16": 0.0, "int4": 0.0, "fp8": 0.0}
    for k, n in SHAPES:
        copies = _copies(k * n * 2)
        w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(copies)]
        ws = int4_weights(k, n, 128, _copies(k * n // 2))
        w8 = [kernels.quantize_fp8(w) for w in w16[: _copies(k * n)]]
        for m in (1, 16, 256, 2048):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            t16 = time_us([lambda w=w: F.linear(x, w) for w in w16])
            cfg = best[(k, n, m)][1] if (k, n, m) in best else None
            t4 = time_int4(x, ws, 128, cfg)
            t8 = time_us([lambda w=w: kernels.fp8_linear(x, w[0], w[1]) for w in w8])
            nbytes = int4_bytes(m, k, n, 128)
            gbs = nbytes / t4 / 1e3
            print(f"{k:>5} x {n:<5} {m:>5} {t16:>9.1f} {t4:>9.1f} {t8:>9.1f} {t4 / t16:>9.2f} {t8 / t16:>9.2f} "
                  f"{gbs:>10,.0f} {gbs / bw:>9.0%}", flush=True)
            report.setdefault("table", []).append(
                {"K": k, "N": n, "M": m, "bf16_us": t16, "int4_us": t4, "fp8_us": t8, "int4_gbs": gbs,
                 "int4_floor_frac": gbs / bw, "int4_config": list(cfg) if cfg else None})
            if m == 1:
                per_token["bf16"] += t16 * NUM_LAYERS / 1e3
                per_token["int4"] += t4 * NUM_LAYERS / 1e3
                per_token["fp8"] += t8 * NUM_LAYERS / 1e3
        del w16, ws, w8
        torch.cuda.empty_cache()
    floor_ms = sum(int4_bytes(1, k, n, 128) for k, n in SHAPES) * NUM_LAYERS / bw / 1e6
    print(f"\nbatch-1 linear layers of one 8B token (32 layers, no LM head): bf16 {per_token['bf16']:.3f} ms, "
          f"int4 {per_token['int4']:.3f} ms ({per_token['int4'] / per_token['bf16']:.2f}x; int4 floor "
          f"{floor_ms:.3f} ms = {floor_ms / per_token['int4']:.0%}), fp8 {per_token['fp8']:.3f} ms")
    report["per_token_ms"] = per_token | {"int4_floor": floor_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), f"{num_sms} SMs, torch {torch.__version__}", flush=True)
    report: dict = {}
    bw = copy_bandwidth_gbs()
    report["copy_gbs"] = bw
    best = sweep(num_sms, report) if args.sweep else {}
    table(bw, report, best)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
