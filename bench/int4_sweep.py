"""Int4 decode sweep: the k-chunk kernels' tilings against bf16 cuBLAS and the general GPTQ kernel.

One command (one H100/H200, about 2-3 minutes, mostly Triton compiles):

  python3 bench/int4_sweep.py [--json PATH] [--quick] [--large] [--ms 1,2,4,8,16] [--picked]

For the 8B engine projections (qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down
14336 x 4096) and M = 1, 2, 4, 16 it prints one line per candidate: µs, effective GB/s (int4 bytes
moved: weights, scales, zeros, x, out) and relative error against the torch reference
(`quant_reference.quant_linear` on the checkpoint's GPTQ words, so the load-time repack is checked
too), beside bf16 `F.linear` and the general kernel (`kernels/int4_matmul.py`, what serving runs
today). Candidates: `kernels/int4_kchunk.KChunkConfig` tilings, each at the split-K factors that
reach 1, 2 and 4 programs per SM. Timings replay a CUDA graph of calls rotating over >= 256 MB of
weight copies (`bench/quant_kernels.time_us`). Last: the batch-1 linear layers of one 8B token
(32 layers) for bf16, the general kernel, the tiling serving picks and the best k-chunk tiling per shape.
`--ms` picks the rows timed, `--picked` times only the tiling serving picks (a baseline).

`--large` sweeps the tensor-core paths for many rows instead (M = 64, 128, 256, 512, 2048, about
3 minutes): per shape and M, bf16 cuBLAS, today's dequantise-then-cuBLAS (`KChunkConfig` block_m 0:
a bf16 copy of the weight per call) and each `large_configs` candidate (`_kchunk_dot_kernel` with
bigger tiles, `int4_kchunk_gemm` with one dot per K tile or one per nibble), split-K to reach one
program per SM:
µs, TFLOP/s, GB/s (int4 bytes), ratio to bf16 and relative error; then the 8B step totals per M.
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

from bench.quant_kernels import _copies, int4_weights, start_report, time_us, write_report  # noqa: E402
from bench.quant_speed import _rel, _try  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels.int4_kchunk import (  # noqa: E402
    GEMM_JOIN, GEMM_MMA, GEMM_NIBBLES, GEMM_WGMMA, KChunkConfig, int4_kchunk_linear_impl, pick_kchunk_config,
)
from kernels.int4_matmul import _split_for, pick_config, quant_linear_impl  # noqa: E402

BF16 = torch.bfloat16
GROUP = 128
MS = (1, 2, 4, 16)
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
NUM_LAYERS = 32
PER_SM = (1, 2, 4)


def int4_bytes(m: int, k: int, n: int) -> int:
    return k * n // 2 + 2 * (k // GROUP) * n * 2 + m * k * 2 + m * n * 2


def base_configs(m: int, quick: bool) -> list[KChunkConfig]:
    """Tilings per M (split_k 0: filled in per shape). GEMV: block_n = 32 * warps * columns a thread."""
    C = KChunkConfig
    # `kernels/int4_kchunk_mma.py` (GEMM_MMA): block_n, warps
    mma = [C(16, bn, 128, 0, w, gemm=GEMM_MMA) for bn, w in
           (((64, 4), (128, 4), (256, 4), (128, 8), (256, 8)) if m <= 16 else ((128, 4), (128, 8), (256, 8)))]
    if m == 1:
        out = [C(1, 512, 128, 0, 4), C(1, 512, 128, 0, 4, pairs=False), C(1, 512, 128, 0, 4, reduce_each=True),
               C(1, 256, 128, 0, 4), C(1, 1024, 64, 0, 4), C(1, 1024, 64, 0, 4, reduce_each=True),
               C(1, 512, 64, 0, 4), C(1, 1024, 128, 0, 8), C(1, 512, 128, 0, 8), C(1, 256, 128, 0, 2),
               C(1, 512, 128, 0, 4, asm=False)]  # the plain and + or, for comparison
    elif m == 2:
        out = [C(2, 256, 64, 0, 4), C(2, 256, 128, 0, 4), C(2, 512, 64, 0, 4), C(2, 512, 64, 0, 4, reduce_each=True),
               C(2, 128, 128, 0, 4), C(2, 256, 64, 0, 2), C(16, 64, 128, 0, 4)]
    elif m == 4:
        out = [C(4, 128, 64, 0, 4), C(4, 256, 64, 0, 4), C(4, 256, 32, 0, 4), C(4, 128, 32, 0, 4),
               C(4, 128, 128, 0, 4), C(16, 64, 128, 0, 4)]
    else:
        out = [C(16, bn, bk, 0, w, st) for bn, bk, w, st in
               ((64, 128, 4, 1), (128, 128, 4, 1), (64, 256, 4, 1), (32, 256, 4, 1), (128, 128, 8, 1),
                (64, 128, 4, 3), (128, 256, 8, 1))]
    return out[:3] + mma[:2] if quick else out + mma


LARGE_MS = (64, 128, 256, 512, 2048)


def large_configs(m: int, tiles: bool = True) -> list[KChunkConfig]:
    """Tensor-core candidates for one M of `--large` (split_k 0: filled in per shape). W: `int4_kchunk_wgmma`
    (sm_90 only: wgmma on weights dequantised in registers, x from shared memory); D: `_kchunk_dot_kernel`
    (8 sub-dots, the weights as the MMA's B operand); J / N: `int4_kchunk_gemm` (W^T x^T, the weights
    as the A operand) with one dot per K tile (GEMM_JOIN) or one per nibble (GEMM_NIBBLES); `tiles`
    False: W only."""
    C = KChunkConfig

    def W(bm, bn, w, st):  # `int4_kchunk_wgmma` (sm_90): bm rows of x a program, st K tiles of x in shared memory
        return C(bm, bn, 128, 0, w, st, gemm=GEMM_WGMMA)

    wg = []
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        wg = [W(16, 128, 4, 6), W(16, 64, 4, 6), W(32, 128, 4, 4), W(32, 64, 4, 4), W(64, 128, 4, 4),
              W(64, 64, 4, 4), W(128, 128, 8, 4)]
        if m >= 256:  # programs of many rows: each dequantised weight tile serves 128-256 rows of x
            wg += [W(128, 128, 4, 4), W(128, 64, 4, 4), W(256, 128, 8, 3), W(256, 64, 4, 3)]
        wg = [c for c in wg if c.block_m <= max(16, triton.next_power_of_2(m))]
    return wg + (_tile_configs(m) if tiles else [])


def _tile_configs(m: int) -> list[KChunkConfig]:
    C = KChunkConfig

    def D(bm, bn, bk, w, st, gm=1):
        return C(bm, bn, bk, 0, w, st, group_m=gm)

    def J(bm, bn, bk, w, st, gm=1):
        return C(bm, bn, bk, 0, w, st, group_m=gm, gemm=GEMM_JOIN)

    def N(bm, bn, bk, w, st, gm=1):
        return C(bm, bn, bk, 0, w, st, group_m=gm, gemm=GEMM_NIBBLES)

    # bench/RESULTS.md run 41 (H100): J beat D everywhere and N (run 42) almost everywhere;
    # these vary J's warps, stages and tiles.
    if m <= 64:
        return [J(64, 128, 64, 4, 3), J(64, 128, 64, 8, 3), J(64, 128, 64, 4, 4), J(64, 128, 64, 4, 2),
                J(32, 128, 64, 4, 3), J(64, 128, 32, 4, 4), J(64, 256, 64, 8, 4), N(64, 256, 128, 8, 3),
                D(64, 128, 128, 4, 3)]
    if m <= 128:
        return [J(128, 128, 64, 8, 3), J(64, 128, 64, 4, 3), J(64, 128, 64, 8, 3), J(128, 128, 64, 8, 4),
                J(128, 256, 64, 8, 3), J(64, 128, 64, 4, 4), J(128, 64, 64, 4, 3), J(128, 128, 32, 8, 4)]
    if m <= 256:
        return [J(128, 128, 64, 8, 3), J(64, 128, 64, 4, 3), J(128, 128, 64, 8, 4), J(128, 256, 64, 8, 3),
                J(64, 128, 64, 8, 3), J(256, 128, 64, 8, 3), J(128, 128, 32, 8, 4)]
    return [J(128, 128, 64, 8, 3, gm=8), J(128, 256, 64, 8, 3, gm=8), J(128, 128, 64, 8, 4, gm=8),
            J(128, 128, 32, 8, 4, gm=8), J(64, 128, 64, 4, 3, gm=8), J(128, 256, 32, 8, 4, gm=8)]


def with_splits(cfg: KChunkConfig, m: int, n: int, k: int, num_sms: int, quick: bool) -> list[KChunkConfig]:
    tiles = triton.cdiv(n, cfg.block_n) * (1 if cfg.block_m < 16 else triton.cdiv(m, cfg.block_m))
    k_tiles = triton.cdiv(k, cfg.block_k)
    splits = {_split_for(tiles, k_tiles, p * num_sms) for p in ((2,) if quick else PER_SM)}
    return [cfg._replace(split_k=s) for s in sorted(splits)]


def time_configs(x, ref, w4, configs, default, row, t16, base, nbytes, flops, label) -> list:
    """Check and time each k-chunk tiling on x (w4: rotating (GPTQ words, k-chunks, scales, zeros)),
    print a line each and append it to row["kchunk"], then the fastest kernel (not dequantise+cuBLAS);
    returns [(us, config)] of the kernels that ran, fastest first."""
    p0, s0, z0 = w4[0][1:]
    t_base, base_name = base
    results = []
    for cfg in dict.fromkeys(configs):
        err = _try(lambda c=cfg: _rel(int4_kchunk_linear_impl(x, p0, s0, z0, GROUP, None, c), ref))
        t = _try(lambda c=cfg: time_us([lambda w=w: int4_kchunk_linear_impl(x, w[1], w[2], w[3], GROUP, None, c)
                                        for w in w4])) if isinstance(err, float) else err
        ok = isinstance(t, float)
        tag = " (default)" if cfg == default else ""
        if ok:
            results.append((t, cfg))
            bad = "  WRONG" if err > 1e-2 else ""
            print(f"  {label(cfg)}{tag}: {t:.1f} us {flops / t / 1e6:,.1f} TFLOP/s {nbytes / t / 1e3:,.0f} GB/s "
                  f"x{t / t16:.2f} bf16 x{t / t_base:.2f} {base_name} err {err:.1e}{bad}", flush=True)
        else:
            print(f"  {label(cfg)}{tag}: FAIL {t}", flush=True)
        row["kchunk"].append({"config": list(cfg), "us": t if ok else None, "err": err if ok else None,
                              "tflops": flops / t / 1e6 if ok else None, "gbs": nbytes / t / 1e3 if ok else None,
                              "error": None if ok else t, "default": cfg == default})
    results = sorted((r for r in results if r[1].block_m), key=lambda r: r[0])
    if results:
        t, c = results[0]
        print(f"  best {label(c)} {t:.1f} us = {flops / t / 1e6:,.1f} TFLOP/s {nbytes / t / 1e3:,.0f} GB/s, "
              f"x{t / t16:.2f} bf16, x{t / t_base:.2f} {base_name}", flush=True)
    return results


def run_shape(name: str, k: int, n: int, num_sms: int, quick: bool, report: dict, ms: tuple = MS,
              only_picked: bool = False) -> dict:
    """Every M for one projection; returns {M: (bf16 us, general us, best k-chunk (us, config), today's pick us)}."""
    w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(_copies(k * n * 2))]
    w4 = [(q, quant_reference.repack_int4_kchunk(q), s, z) for q, s, z in int4_weights(k, n, GROUP, _copies(k * n // 2))]
    q0, _, s0, z0 = w4[0]
    best = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        ref = quant_reference.quant_linear(x, q0, s0, z0, None, 4, GROUP)
        nbytes = int4_bytes(m, k, n)
        t16 = time_us([lambda w=w: F.linear(x, w) for w in w16])
        old_cfg = pick_config(m, n, k, GROUP, 4, False, num_sms)
        t_old = time_us([lambda w=w: quant_linear_impl(x, w[0], w[2], w[3], None, 4, GROUP, None, old_cfg) for w in w4])
        e_old = _rel(quant_linear_impl(x, q0, s0, z0, None, 4, GROUP, None, old_cfg), ref)
        print(f"\n## {name} K={k} N={n} M={m}: bf16 {t16:.1f} us ({k * n * 2 / t16 / 1e3:,.0f} GB/s); general "
              f"{tuple(old_cfg)} {t_old:.1f} us ({nbytes / t_old / 1e3:,.0f} GB/s, err {e_old:.1e})", flush=True)
        row = {"name": name, "K": k, "N": n, "M": m, "bf16_us": t16, "general_us": t_old, "general_err": e_old,
               "general_config": list(old_cfg), "kchunk": []}
        default = pick_kchunk_config(m, n, k, GROUP, num_sms, mma=True)  # as serving picks for bf16 CUDA x
        cands = [] if only_picked else [c for base in base_configs(m, quick)
                                        for c in with_splits(base, m, n, k, num_sms, quick)]
        results = time_configs(x, ref, w4, [default, *cands], default, row, t16, (t_old, "general"), nbytes,
                               2 * m * k * n, lambda c: str(tuple(c)))
        picked = next((t for t, c in results if c == default), float("nan"))
        best[m] = (t16, t_old, results[0] if results else None, picked)
        report["rows"].append(row)
    del w16, w4
    torch.cuda.empty_cache()
    return best


def run_large_shape(name: str, k: int, n: int, num_sms: int, report: dict, ms: tuple = LARGE_MS,
                    tiles: bool = True) -> dict:
    """`--large` for one projection; returns {M: (bf16 us, dequantise+cuBLAS us, best (us, config) or None)}."""
    w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(_copies(k * n * 2))]
    w4 = [(q, quant_reference.repack_int4_kchunk(q), s, z) for q, s, z in int4_weights(k, n, GROUP, _copies(k * n // 2))]
    q0, _, s0, z0 = w4[0]
    dense = KChunkConfig(0, 0, 0, 1, 0)
    best = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        ref = quant_reference.quant_linear(x, q0, s0, z0, None, 4, GROUP)
        nbytes, flops = int4_bytes(m, k, n), 2 * m * k * n
        t16 = time_us([lambda w=w: F.linear(x, w) for w in w16])
        t_dq = time_us([lambda w=w: int4_kchunk_linear_impl(x, w[1], w[2], w[3], GROUP, None, dense) for w in w4])
        print(f"\n## {name} K={k} N={n} M={m}: bf16 {t16:.1f} us ({flops / t16 / 1e6:,.0f} TFLOP/s); dequantise+cuBLAS "
              f"{t_dq:.1f} us (x{t_dq / t16:.2f} bf16)", flush=True)
        row = {"name": name, "K": k, "N": n, "M": m, "bf16_us": t16, "dequant_cublas_us": t_dq, "kchunk": []}
        default = pick_kchunk_config(m, n, k, GROUP, num_sms)
        cands = []
        for cfg in large_configs(m, tiles):
            n_tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
            per_sm = PER_SM if cfg.gemm == GEMM_WGMMA else (1,)  # its few-row tiles: more programs to hide latency
            splits = {_split_for(n_tiles, triton.cdiv(k, cfg.block_k), p * num_sms) for p in per_sm}
            cands += [cfg._replace(split_k=sp) for sp in sorted(splits)]
        results = time_configs(x, ref, w4, [default, *cands], default, row, t16, (t_dq, "dq"), nbytes, flops, _short)
        best[m] = (t16, t_dq, results[0] if results else None)
        report["rows"].append(row)
    del w16, w4
    torch.cuda.empty_cache()
    return best


def _short(cfg: KChunkConfig) -> str:
    """The fields that matter for the tensor-core paths."""
    if cfg.block_m == 0:
        return "dequantise+cuBLAS"
    kind = {0: "D", GEMM_JOIN: "J", GEMM_NIBBLES: "N", GEMM_MMA: "MMA", GEMM_WGMMA: "W"}[cfg.gemm]
    return (f"{kind} m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"
            f" g{cfg.group_m}")


def large(num_sms: int, json_path: str, report: dict, t0: float, ms: tuple = LARGE_MS, tiles: bool = True) -> None:
    totals = {m: [0.0, 0.0, 0.0] for m in ms}
    for name, k, n in SHAPES:
        best = run_large_shape(name, k, n, num_sms, report, ms, tiles)
        for m, (t16, t_dq, b) in best.items():
            totals[m][0] += t16 * NUM_LAYERS / 1e3
            totals[m][1] += t_dq * NUM_LAYERS / 1e3
            totals[m][2] += (b[0] if b else float("nan")) * NUM_LAYERS / 1e3
        print(f"# {name} done: {time.perf_counter() - t0:.0f} s", flush=True)
        write_report(json_path, report)
    print("\n# linear layers of one 8B step (qkv, o, gate_up, down x 32 layers), ms")
    for m in ms:
        b16, dq, new = totals[m]
        print(f"M={m}: bf16 {b16:.3f}; dequantise+cuBLAS {dq:.3f} (x{dq / b16:.2f}); tensor-core best {new:.3f} "
              f"(x{new / b16:.2f} bf16, x{new / dq:.2f} dequantise+cuBLAS)", flush=True)
    report["per_step_ms"] = {str(m): {"bf16": totals[m][0], "dequant_cublas": totals[m][1], "kchunk_best": totals[m][2]}
                             for m in ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--quick", action="store_true", help="three tilings per M at one split (a smoke run)")
    ap.add_argument("--large", action="store_true", help="the tensor-core paths at M = 64..2048 instead")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows to time (comma-separated, <= 64)")
    ap.add_argument("--picked", action="store_true", help="only the tiling serving picks per shape and M (a baseline)")
    ap.add_argument("--large-ms", default=",".join(map(str, LARGE_MS)), help="rows to time with --large")
    ap.add_argument("--wgmma-only", action="store_true", help="--large: today's pick and the wgmma tilings only")
    args = ap.parse_args()
    ms = tuple(int(v) for v in args.ms.split(","))
    t0 = time.perf_counter()
    num_sms, report = start_report()
    bw = report["copy_gbs"]
    if args.large:
        large(num_sms, args.json, report, t0, tuple(int(v) for v in args.large_ms.split(",")), not args.wgmma_only)
        write_report(args.json, report)
        print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)
        return
    totals = {m: [0.0, 0.0, 0.0, 0.0] for m in ms}
    for name, k, n in SHAPES:
        best = run_shape(name, k, n, num_sms, args.quick, report, ms, args.picked)
        for m, (t16, t_old, b, picked) in best.items():
            totals[m][0] += t16 * NUM_LAYERS / 1e3
            totals[m][1] += t_old * NUM_LAYERS / 1e3
            totals[m][2] += (b[0] if b else float("nan")) * NUM_LAYERS / 1e3
            totals[m][3] += picked * NUM_LAYERS / 1e3
        print(f"# {name} done: {time.perf_counter() - t0:.0f} s", flush=True)
        write_report(args.json, report)  # after each shape: a run cut short keeps what it measured
    floor = {m: sum(int4_bytes(m, k, n) for _, k, n in SHAPES) * NUM_LAYERS / bw / 1e6 for m in ms}
    print("\n# linear layers of one 8B decode step (qkv, o, gate_up, down x 32 layers, no LM head), ms")
    for m in ms:
        b16, old, new, picked = totals[m]
        print(f"M={m}: bf16 {b16:.3f}; general {old:.3f} (x{old / b16:.2f}); today's pick {picked:.3f} "
              f"(x{picked / b16:.2f}); k-chunk best {new:.3f} (x{new / b16:.2f}; int4 floor {floor[m]:.3f} = "
              f"{floor[m] / new:.0%} of it)", flush=True)
    report["per_step_ms"] = {str(m): {"bf16": totals[m][0], "general": totals[m][1], "kchunk_best": totals[m][2],
                                      "kchunk_picked": totals[m][3], "int4_floor": floor[m]} for m in ms}
    write_report(args.json, report)
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
