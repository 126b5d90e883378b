"""Skinny linear (`kernels/skinny_linear.py`) against cuBLAS at the per-rank decode shapes, one H100.

  python3 bench/skinny_sweep.py [--json PATH] [--models 8b,70b] [--tp 1,2,4] [--ms 1,2,4,8,16]
                                [--dtypes bf16,fp8] [--jobs 12]
  python3 bench/skinny_sweep.py --fp8-gemv [--json PATH] [--tp 1,2] [--ms 1,2,4]   (8B, FP8 only)

For Llama-3-8B (hidden 4096, inter 14336, 32 q / 8 kv heads of 128) and Llama-3-70B (hidden 8192,
inter 28672, 64 q / 8 kv heads) at TP = 1, 2, 4, each rank's fused qkv, o, fused gate_up and down
(N split for qkv / gate_up, K for o / down), M = 1, 2, 4, 8, 16, bf16 and FP8 (e4m3, per-channel):
- cuBLAS µs (bf16 `F.linear`; FP8 the old path: per-token quantise + `_scaled_mm`);
- every candidate tiling's µs and its max error (|out - ref| max over |ref| max, fp32 reference);
- the best candidate's µs and GB/s; what `pick_skinny_config` picks and its µs; `use_skinny`'s
  verdict and the µs of the path it chooses.
Timings replay a CUDA graph of calls rotating over >= 256 MB of weight copies (weights from HBM).
Ends with per (model, TP, dtype) the batch-1 µs of one decoder layer's four linears (cuBLAS vs
chosen) and FP8's ratio to bf16, the number the FP8 bar of issue 27 (<= 0.62x) is about.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs  # noqa: E402
from bench.quant_kernels import _copies, time_us  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels import fp8_gemv as gemv  # noqa: E402
from kernels.fp8_matmul import scaled_mm_linear  # noqa: E402
from kernels.int4_matmul import _num_sms  # noqa: E402
from kernels.skinny_linear import (  # noqa: E402
    MODE_DOT,
    MODE_FMA,
    MODE_FMA_REDUCE,
    SkinnyConfig,
    card_of,
    config_for,
    m_bucket,
    pick_skinny_config,
    skinny_linear_impl,
    use_skinny,
)

BF16 = torch.bfloat16
ACT = BF16  # activations
T0 = time.time()
DEVICE = "cuda"  # the --fp8-gemv cases' device (a CPU dry run of the script sets "cpu")
BUDGET_S = 170.0  # after this many seconds only the picks are timed (the run stays under ~3 min)
MODELS = {  # hidden, intermediate, q heads, kv heads, head_dim
    "8b": (4096, 14336, 32, 8, 128),
    "70b": (8192, 28672, 64, 8, 128),
}


def rank_shapes(model: str, tp: int) -> list[tuple[str, int, int]]:
    """(projection, K, N) that one rank of `tp` multiplies."""
    h, inter, qh, kvh, d = MODELS[model]
    return [("qkv", h, (qh + 2 * kvh) * d // tp), ("o", qh * d // tp, h), ("gate_up", h, 2 * inter // tp),
            ("down", inter // tp, h)]


def candidates(m: int, n: int, k: int, itemsize: int, num_sms: int) -> list:
    """Tilings worth timing at this M bucket; block_k spans 16 bytes x 16-32 threads of a row."""
    kb = 2 // itemsize  # block_k doubles for 1-byte weights (same bytes per tile)
    # (mode, block_n, block_k, warps, stages[, sub]); FMA with stages > 1: tl.range pipelining
    if m == 1:
        base = [(MODE_FMA, 16, 128 * kb, 4, 1), (MODE_FMA, 16, 256 * kb, 4, 1), (MODE_FMA, 16, 512 * kb, 8, 3),
                (MODE_FMA, 16, 512 * kb, 8, 4), (MODE_FMA, 16, 512 * kb, 4, 4, 2), (MODE_FMA, 32, 512 * kb, 8, 3, 2),
                (MODE_FMA, 16, 1024 * kb, 8, 3, 4), (MODE_FMA, 8, 1024 * kb, 4, 4, 4), (MODE_DOT, 32, 256 * kb, 4, 3)]
    elif m == 2:
        base = [(MODE_FMA, 8, 256 * kb, 4, 1), (MODE_FMA, 8, 512 * kb, 8, 3), (MODE_FMA, 8, 512 * kb, 4, 4, 2),
                (MODE_FMA_REDUCE, 16, 256 * kb, 4, 1), (MODE_DOT, 32, 256 * kb, 4, 3)]
    elif m <= 4:
        base = [(MODE_FMA, 8, 128 * kb, 4, 1), (MODE_FMA_REDUCE, 16, 256 * kb, 4, 3),
                (MODE_FMA_REDUCE, 16, 512 * kb, 4, 4, 2), (MODE_DOT, 32, 256 * kb, 4, 3), (MODE_DOT, 64, 128 * kb, 4, 4)]
    else:
        base = [(MODE_DOT, 32, 256 * kb, 4, 3), (MODE_DOT, 64, 128 * kb, 4, 4), (MODE_DOT, 64, 256 * kb, 8, 3),
                (MODE_DOT, 16, 256 * kb, 4, 3), (MODE_DOT, 32, 256 * kb, 4, 4)]
    out = []
    for mode, bn, bk, w, s, *sub in base:
        for per_sm in (0, 2, 4):
            cfg = config_for(m, n, k, mode, bn, bk, w, s, per_sm, num_sms, *sub)
            if cfg not in out:
                out.append(cfg)
    return out


def _warm_one(job: tuple) -> str:
    """Compile one variant (M bucket, weight bytes, tiling, split or not) on tiny tensors of the same
    specialisation as the real shapes (N, strides multiples of 16; K as even in block_k as the real K)."""
    m, itemsize, k, cfg = job
    try:
        n = 64
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        if itemsize == 2:
            w, s = torch.randn(n, k, device="cuda", dtype=BF16), None
        else:
            w, s = quant_reference.quantize_fp8(torch.randn(n, k, device="cuda"))
        skinny_linear_impl(x, w, s, None, cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing pass too
        return f"{cfg}: {_short_error(e)}"


def prewarm(jobs: list, workers: int) -> None:
    """Fill Triton's on-disk cache in parallel processes (compiles dominate a serial sweep's time)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = list(dict.fromkeys(jobs))
    t0 = time.time()
    try:  # a worker that dies breaks the pool (an error here), where multiprocessing.Pool would hang
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            errs = [e for e in pool.map(_warm_one, jobs, timeout=120) if e]
    except Exception as e:  # noqa: BLE001 - the timing pass compiles whatever is missing
        errs = [f"prewarm failed: {type(e).__name__} {e}"]
    print(f"# prewarm: {len(jobs)} variants in {time.time() - t0:.0f} s with {workers} processes"
          + (f"; {len(errs)} failed, e.g. {errs[0]}" if errs else ""), flush=True)


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a tiling that does not compile is reported, not fatal
        return _short_error(e)


def _short_error(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[-1] if lines else '')[:120]}"


def run_case(model: str, tp: int, proj: str, k: int, n: int, dtype: str, ms: list[int], num_sms: int,
             rows: list) -> None:
    itemsize = 2 if dtype == "bf16" else 1
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    copies = _copies(k * n * itemsize)
    if dtype == "bf16":
        ws = [(torch.randn(n, k, device="cuda", dtype=BF16, generator=g) / 64, None) for _ in range(copies)]
    else:
        ws = [quant_reference.quantize_fp8(torch.randn(n, k, device="cuda", generator=g)) for _ in range(copies)]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=ACT, generator=g)
        w0, s0 = ws[0]
        ref = quant_reference.skinny_linear(x.float(), w0, s0)
        if dtype == "bf16":
            cublas = time_us([lambda w=w: F.linear(x, w) for w, _ in ws])
        else:
            cublas = time_us([lambda w=w, s=s: scaled_mm_linear(x, w, s, own_tiles=False) for w, s in ws])
        nbytes = n * k * itemsize + m * k * 2 + m * n * 2 + (4 * n if itemsize == 1 else 0)
        cands = []
        over = time.time() - T0 > BUDGET_S  # past the budget: time only the pick (and cuBLAS)
        for cfg in ([] if over else candidates(m, n, k, itemsize, num_sms)):
            err = _try(lambda c=cfg: _max_err(skinny_linear_impl(x, w0, s0, None, c), ref))
            us = _try(lambda c=cfg: time_us([lambda w=w, s=s: skinny_linear_impl(x, w, s, None, c) for w, s in ws]))
            cands.append((cfg, us, err))
        ok = [c for c in cands if isinstance(c[1], float) and isinstance(c[2], float) and c[2] < 2e-2]
        best = min(ok, key=lambda c: c[1]) if ok else None
        pick = pick_skinny_config(m, n, k, w0.dtype, num_sms, card_of(torch.device(DEVICE)))
        pick_us = next((us for cfg, us, _ in cands if cfg == pick and isinstance(us, float)), None)
        if pick_us is None:
            pick_us = _try(lambda: time_us([lambda w=w, s=s: skinny_linear_impl(x, w, s, None, pick) for w, s in ws]))
        pick_err = _try(lambda: _max_err(skinny_linear_impl(x, w0, s0, None, pick), ref))
        chosen = use_skinny(m, n, k, w0.dtype, x.device)
        chosen_us = (pick_us if isinstance(pick_us, float) else float("nan")) if chosen else cublas
        row = {"model": model, "tp": tp, "proj": proj, "K": k, "N": n, "dtype": dtype, "M": m,
               "cublas_us": cublas, "bytes": nbytes, "cublas_gbs": nbytes / cublas / 1e3,
               "candidates": [[c.short(), list(c), us, err] for c, us, err in cands],
               "best": [best[0].short(), list(best[0]), best[1], nbytes / best[1] / 1e3] if best else None,
               "pick": [pick.short(), list(pick), pick_us, nbytes / pick_us / 1e3 if isinstance(pick_us, float) else None],
               "pick_err": pick_err, "use_skinny": chosen, "chosen_us": chosen_us}
        rows.append(row)
        bad = [f"{c.short()}: {us if isinstance(us, str) else err}" for c, us, err in cands
               if not (isinstance(us, float) and isinstance(err, float) and err < 2e-2)]
        bad = [f"{len(bad)} failed, e.g. {bad[0]}"] if bad else []
        bstr = f"{best[0].short():<22} {best[1]:7.1f} {nbytes / best[1] / 1e3:6,.0f}" if best else "none"
        pstr = f"{pick.short():<22} {pick_us:7.1f}" if isinstance(pick_us, float) else f"pick failed {pick_us}"
        print(f"{model:>3} tp{tp} {proj:<7} {k:>5}x{n:<5} {dtype:<4} M={m:<2} cublas {cublas:7.1f} "
              f"({nbytes / cublas / 1e3:5,.0f} GB/s) | best {bstr} | pick {pstr} err {pick_err if isinstance(pick_err, str) else f'{pick_err:.1e}'}"
              f" | {'skinny' if chosen else 'cublas'}" + (f" | BAD {bad}" if bad else ""), flush=True)
    del ws
    torch.cuda.empty_cache()


def summary(rows: list) -> dict:
    """Batch-1 µs of one decoder layer's four linears per (model, tp, dtype), and FP8 / bf16."""
    out = {}
    for r in rows:
        if r["M"] != 1:
            continue
        key = f"{r['model']} tp{r['tp']}"
        d = out.setdefault(key, {})
        d[f"{r['dtype']}_cublas_us"] = d.get(f"{r['dtype']}_cublas_us", 0.0) + r["cublas_us"]
        d[f"{r['dtype']}_chosen_us"] = d.get(f"{r['dtype']}_chosen_us", 0.0) + r["chosen_us"]
        best = r["best"][2] if r["best"] else r["cublas_us"]
        d[f"{r['dtype']}_best_us"] = d.get(f"{r['dtype']}_best_us", 0.0) + min(best, r["cublas_us"])
    print("\n# batch 1, one decoder layer's 4 linears (us): cuBLAS -> chosen (best seen); fp8/bf16 of chosen")
    for key, d in out.items():
        parts = [f"{dt} {d[f'{dt}_cublas_us']:.1f} -> {d[f'{dt}_chosen_us']:.1f} ({d[f'{dt}_best_us']:.1f})"
                 for dt in ("bf16", "fp8") if f"{dt}_cublas_us" in d]
        ratio = ""
        if "bf16_chosen_us" in d and "fp8_chosen_us" in d:
            d["fp8_over_bf16"] = d["fp8_chosen_us"] / d["bf16_chosen_us"]
            d["fp8_over_bf16_cublas"] = d["fp8_chosen_us"] / d["bf16_cublas_us"]
            ratio = f" | fp8/bf16 {d['fp8_over_bf16']:.2f}x (vs bf16 cuBLAS {d['fp8_over_bf16_cublas']:.2f}x)"
        print(f"{key:<9} " + " | ".join(parts) + ratio)
    return out


# ---- --fp8-gemv: kernels/fp8_gemv.py's tilings -------------------------------------------------

def gemv_families(m: int) -> list[tuple]:
    """(mode, block_n, block_k, unroll, warps, stages) worth timing at M rows (FMA modes up to 4)."""
    A, R, D = gemv.MODE_ACC, gemv.MODE_ROWSUM, gemv.MODE_DOT16
    dots = [(D, 128, 128, 1, 4, 3), (D, 256, 128, 1, 4, 3), (D, 256, 64, 2, 4, 3), (D, 256, 64, 1, 4, 4),
            (D, 512, 64, 1, 8, 3), (D, 256, 128, 1, 4, 2), (D, 512, 128, 1, 8, 2), (D, 128, 128, 1, 4, 5)]
    if m == 1:
        return [(A, 16, 512, 1, 4, 1), (A, 16, 512, 2, 4, 1), (A, 32, 256, 2, 4, 1), (A, 64, 128, 2, 4, 1),
                (A, 32, 512, 1, 8, 1), (R, 512, 32, 2, 4, 1), (R, 256, 64, 2, 4, 1), (R, 512, 32, 2, 8, 1),
                (A, 32, 256, 1, 4, 3), (A, 64, 128, 2, 4, 4), (A, 16, 512, 1, 4, 4)] + dots
    if m == 2:
        return [(A, 32, 256, 1, 4, 1), (A, 64, 128, 1, 4, 1), (R, 256, 32, 2, 4, 1), (R, 256, 64, 2, 8, 1),
                (A, 32, 256, 1, 4, 3)] + dots
    return [(R, 128, 32, 2, 4, 1), (R, 128, 64, 2, 4, 1), (A, 64, 128, 1, 8, 1)] + dots


def gemv_families_f2(m: int) -> list[tuple]:
    """Round 2 (after RESULTS run 41): the winners' neighbours: pipelining depth, narrower programs,
    finer split targets."""
    A, D = gemv.MODE_ACC, gemv.MODE_DOT16
    if m == 1:
        return [(A, 16, 512, 1, 4, 1), (A, 16, 512, 1, 4, 2), (A, 16, 512, 1, 4, 3), (A, 16, 512, 1, 4, 4),
                (A, 32, 256, 1, 4, 1), (A, 32, 256, 1, 4, 3), (A, 8, 512, 1, 2, 1), (A, 16, 256, 1, 2, 1),
                (A, 8, 512, 1, 4, 1)]
    return [(D, 128, 128, 1, 4, 3), (D, 128, 128, 1, 4, 4), (D, 128, 128, 1, 4, 2), (D, 128, 64, 2, 4, 3),
            (D, 64, 128, 1, 4, 3), (D, 128, 256, 1, 4, 3), (A, 32, 256, 1, 4, 3)]


GEMV_SETS = {"f1": (gemv_families, (1, 2, 4), (2, 4, 8)), "f2": (gemv_families_f2, (0.5, 1, 1.5, 2), (1, 1.5, 2, 3))}
GEMV_SET = "f1"


def gemv_candidates(m: int, n: int, k: int, num_sms: int) -> list:
    """Every family of the chosen set at a few split-K targets (programs per SM; the big-tile dot16 fits
    1-2 per SM)."""
    families, dot_per_sm, fma_per_sm = GEMV_SETS[GEMV_SET]
    return gemv_split_variants(families(m), lambda fam: dot_per_sm if fam[0] == gemv.MODE_DOT16 else fma_per_sm,
                               n, k, num_sms)


def gemv_split_variants(families: list[tuple], per_sm_of, n: int, k: int, num_sms: int) -> list:
    """Each GEMV family (mode, block_n, block_k, unroll, warps, stages) at each split-K target
    `per_sm_of(family)` gives (programs per SM), as `GemvConfig`s for an [n, k] weight, without repeats."""
    out = []
    for fam in families:
        for per_sm in per_sm_of(fam):
            cfg = gemv.gemv_config(n, k, *fam, per_sm, num_sms)
            if cfg not in out:
                out.append(cfg)
    return out


def _warm_gemv(job: tuple) -> str:
    m, k, cfg = job
    try:
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        w, s = quant_reference.quantize_fp8(torch.randn(64, k, device="cuda"))
        gemv.fp8_gemv(x, w, s, None, gemv.GemvConfig(*cfg))
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing pass too
        return f"{cfg}: {_short_error(e)}"


def run_gemv_case(tp: int, proj: str, k: int, n: int, ms: list[int], num_sms: int, rows: list) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(k * 7 + n)
    ws = [quant_reference.quantize_fp8(torch.randn(n, k, device=DEVICE, generator=g)) for _ in range(_copies(k * n))]
    wb = [(torch.randn(n, k, device=DEVICE, dtype=BF16, generator=g) / 64) for _ in range(_copies(2 * k * n))]
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=ACT, generator=g)
        w0, s0 = ws[0]
        ref = quant_reference.skinny_linear(x.float(), w0, s0)
        nbytes = n * k + m * k * 2 + m * n * 2 + 4 * n
        bf16 = time_us([lambda w=w: F.linear(x, w) for w in wb])
        scaled = time_us([lambda w=w, s=s: scaled_mm_linear(x, w, s, own_tiles=False) for w, s in ws])
        pick = pick_skinny_config(m, n, k, w0.dtype, num_sms, card_of(torch.device(DEVICE)))
        today = _try(lambda: time_us([lambda w=w, s=s: skinny_linear_impl(x, w, s, None, pick) for w, s in ws]))
        cands = []
        over = time.time() - T0 > BUDGET_S  # past the budget: only the baselines (the run stays under ~4 min)
        for cfg in ([] if over else gemv_candidates(m, n, k, num_sms)):
            err = _try(lambda c=cfg: _max_err(gemv.fp8_gemv(x, w0, s0, None, c), ref))
            us = _try(lambda c=cfg: time_us([lambda w=w, s=s: gemv.fp8_gemv(x, w, s, None, c) for w, s in ws]))
            cands.append((cfg, us, err))
        ok = [c for c in cands if isinstance(c[1], float) and isinstance(c[2], float) and c[2] < 2e-2]
        best = min(ok, key=lambda c: c[1]) if ok else None
        chosen = today if use_skinny(m, n, k, w0.dtype, x.device) else scaled
        rows.append({"tp": tp, "proj": proj, "K": k, "N": n, "M": m, "bytes": nbytes, "bf16_cublas_us": bf16,
                     "today_chosen_us": chosen,
                     "scaled_mm_us": scaled, "today_pick": [pick.short(), list(pick), today],
                     "candidates": [[c.short(), list(c), us, err] for c, us, err in cands],
                     "best": [best[0].short(), list(best[0]), best[1], nbytes / best[1] / 1e3] if best else None})
        tstr = f"{today:6.1f}" if isinstance(today, float) else str(today)[:40]
        print(f"8b tp{tp} {proj:<7} {k:>5}x{n:<5} M={m} | bf16 {bf16:6.1f} | scaled_mm {scaled:6.1f} | today "
              f"{pick.short()} {tstr} | best " + (f"{best[0].short()} {best[1]:6.1f} us {nbytes / best[1] / 1e3:6,.0f} GB/s "
                                                     f"err {best[2]:.1e}" if best else "none"), flush=True)
        for c, us, err in sorted(cands, key=lambda c: c[1] if isinstance(c[1], float) else 1e9):
            ustr = f"{us:7.1f} us {nbytes / us / 1e3:6,.0f} GB/s" if isinstance(us, float) else f"FAIL {us}"
            estr = f"{err:.1e}" if isinstance(err, float) else f"FAIL {err}"
            print(f"    {c.short():<34} {ustr} err {estr}", flush=True)
    del ws, wb
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def gemv_summary(rows: list) -> dict:
    """Per TP at M = 1 (and 2, 4): one layer's four linears, per path and per tiling family (the same
    family on every shape, its best split), and the best per shape."""
    out = {}
    for r in rows:
        key = f"tp{r['tp']} M={r['M']}"
        d = out.setdefault(key, {"bf16": 0.0, "scaled_mm": 0.0, "today": 0.0, "today_chosen": 0.0,
                                 "best_per_shape": 0.0, "families": {}, "shapes": 0})
        d["shapes"] += 1
        d["bf16"] += r["bf16_cublas_us"]
        d["scaled_mm"] += r["scaled_mm_us"]
        t = r["today_pick"][2]
        d["today"] += t if isinstance(t, float) else float("nan")
        d["today_chosen"] += r["today_chosen_us"] if isinstance(r["today_chosen_us"], float) else float("nan")
        d["best_per_shape"] += r["best"][2] if r["best"] else float("nan")
        fam_best: dict = {}
        for short, cfg, us, err in r["candidates"]:
            if not (isinstance(us, float) and isinstance(err, float) and err < 2e-2):
                continue
            fam = gemv.GemvConfig(*cfg)._replace(split_k=0).short()
            fam_best[fam] = min(fam_best.get(fam, 1e9), us)
        for fam, us in fam_best.items():
            d["families"].setdefault(fam, []).append(us)
    print("\n# one layer's four linears (us): bf16 cuBLAS | _scaled_mm | today's skinny pick | today's path "
          "(use_skinny) | best GEMV per shape")
    for key, d in out.items():
        fams = {f: sum(v) for f, v in d["families"].items() if len(v) == d["shapes"]}
        d["families"] = fams
        top = sorted(fams.items(), key=lambda kv: kv[1])[:3]
        print(f"{key:<9} {d['bf16']:7.1f} | {d['scaled_mm']:7.1f} | {d['today']:7.1f} | {d['today_chosen']:7.1f} | "
              f"{d['best_per_shape']:7.1f}"
              f"  (fp8 best / bf16 {d['best_per_shape'] / d['bf16']:.2f}x) | best families: "
              + ", ".join(f"{f} {v:.1f}" for f, v in top))
    return out


def main_gemv(args, num_sms: int, bw: float) -> None:
    t0 = time.time()
    ms = [int(v) for v in args.ms.split(",")]
    tps = [int(v) for v in args.tp.split(",")]
    cases = [(tp, proj, k, n) for tp in tps for proj, k, n in rank_shapes("8b", tp)]
    if args.jobs > 1:
        jobs = []
        for _, _, k, n in cases:
            for m in ms:
                for cfg in gemv_candidates(m, n, k, num_sms):
                    step = cfg.block_k * cfg.unroll
                    jobs.append((gemv.block_m_for(m, cfg.mode), 4096 if k % step == 0 else k,
                                 tuple(cfg._replace(split_k=min(cfg.split_k, 2)))))
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        jobs = list(dict.fromkeys(jobs))
        try:
            with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
                errs = [e for e in pool.map(_warm_gemv, jobs, timeout=120) if e]
        except Exception as e:  # noqa: BLE001 - the timing pass compiles whatever is missing
            errs = [f"prewarm failed: {type(e).__name__} {e}"]
        print(f"# prewarm: {len(jobs)} variants in {time.time() - t0:.0f} s" + (f"; {len(errs)} failed: {errs[:3]}" if errs else ""),
              flush=True)
    rows: list = []
    for tp, proj, k, n in cases:
        run_gemv_case(tp, proj, k, n, ms, num_sms, rows)
        if args.json:
            _write(args.json, {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": rows, "partial": True})
    report = {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": rows, "summary": gemv_summary(rows),
              "wall_s": time.time() - t0}
    print(f"# wall {time.time() - t0:.0f} s")
    if args.json:
        _write(args.json, report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8-gemv", action="store_true", help="kernels/fp8_gemv.py's tilings at the 8B shapes")
    ap.add_argument("--gemv-set", default="f1", choices=sorted(GEMV_SETS), help="--fp8-gemv: which tilings")
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--budget-s", type=float, default=170.0, help="after this, time only cuBLAS and the pick")
    ap.add_argument("--jobs", type=int, default=12, help="processes that compile the variants first (1: none)")
    args = ap.parse_args()
    global BUDGET_S
    if args.fp8_gemv:
        num_sms = _num_sms(0)
        bw = copy_bandwidth_gbs(1 << 30)
        print(f"# {torch.cuda.get_device_name(0)}, {num_sms} SMs, copy {bw:,.0f} GB/s; triton {triton.__version__}, "
              f"torch {torch.__version__}", flush=True)
        if args.tp == "1,2,4":
            args.tp = "1,2"
        if args.ms == "1,2,4,8,16":
            args.ms = "1,2,4"
        BUDGET_S = args.budget_s
        global GEMV_SET
        GEMV_SET = args.gemv_set
        main_gemv(args, num_sms, bw)
        return
    BUDGET_S = args.budget_s
    t0 = time.time()
    num_sms = _num_sms(0)
    bw = copy_bandwidth_gbs(1 << 30)
    print(f"# {torch.cuda.get_device_name(0)}, {num_sms} SMs, copy {bw:,.0f} GB/s; triton {triton.__version__}, "
          f"torch {torch.__version__}", flush=True)
    ms = [int(v) for v in args.ms.split(",")]
    cases = [(model, tp, proj, k, n, dtype) for model in args.models.split(",") for tp in (int(v) for v in args.tp.split(","))
             for proj, k, n in rank_shapes(model, tp) for dtype in args.dtypes.split(",")]
    if args.jobs > 1:
        jobs = []
        for _, _, _, k, n, dtype in cases:
            itemsize = 2 if dtype == "bf16" else 1
            wdtype = BF16 if itemsize == 2 else torch.float8_e4m3fn
            for m in ms:
                pick = pick_skinny_config(m, n, k, wdtype, num_sms, card_of(torch.device(DEVICE)))
                for cfg in candidates(m, n, k, itemsize, num_sms) + [pick]:
                    k_warm = 4096 if k % cfg.block_k == 0 else k
                    jobs.append((m_bucket(m), itemsize, k_warm, cfg._replace(split_k=min(cfg.split_k, 2))))
        prewarm(jobs, args.jobs)
    rows: list = []
    for i, (model, tp, proj, k, n, dtype) in enumerate(cases):
        run_case(model, tp, proj, k, n, dtype, ms, num_sms, rows)
        if args.json:  # after every case, so a run cut short still leaves its rows
            _write(args.json, {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": rows,
                               "partial": True})
        if i + 1 == len(cases) or cases[i + 1][:2] != (model, tp):
            print(f"# {model} tp{tp} done at {time.time() - t0:.0f} s", flush=True)
    report = {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": rows, "summary": summary(rows),
              "wall_s": time.time() - t0}
    print(f"# wall {time.time() - t0:.0f} s")
    if args.json:
        _write(args.json, report)


def _write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
