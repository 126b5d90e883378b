"""bf16 weights through the word-loading GEMV (`kernels/fp8_gemv.py`, two bf16 a word) against cuBLAS, one GPU.

  python3 bench/gemv_bf16.py [--shapes 8b:1,8b:2,8b:4,70b:4] [--ms 1,2,4] [--json PATH] [--jobs 12]

Per-rank decode shapes of Llama-3-8B / 70B at a TP degree (each rank's fused qkv, o, fused gate_up and
down), M rows of bf16 activations:
- per shape: cuBLAS (`F.linear`) µs and every candidate tiling's µs (a CUDA graph of calls rotating over
  >= 256 MB of weight copies: weights from HBM), the best's GB/s, its max error against fp32;
- per (model, TP, M): one decoder layer's four linears summed, cuBLAS vs the best family (one tiling
  for all four shapes, its best split target) vs the best tiling per shape;
- the layer chain: a CUDA graph of whole layers (qkv, o, gate_up, down in turn, each layer its own
  weights), cuBLAS vs the best family with programmatic dependent launch on and off (`kernels/pdl.py`):
  what a decode step's linears cost when each kernel follows another, not itself.
Decides where `kernels/skinny_linear.py` sends bf16 decode rows (its `_BF16_GEMV_TABLE`).
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

from bench.ceilings import copy_bandwidth_gbs  # noqa: E402
from bench.quant_kernels import _copies, time_us  # noqa: E402
from bench.skinny_sweep import gemv_split_variants, rank_shapes  # noqa: E402
from kernels import fp8_gemv as gemv  # noqa: E402
from kernels import pdl  # noqa: E402
from kernels.int4_matmul import _num_sms  # noqa: E402

BF16 = torch.bfloat16
A, R = gemv.MODE_ACC, gemv.MODE_ROWSUM


def families(m: int) -> list[tuple]:
    """(mode, block_n, block_k (elements), unroll, warps, stages) at M rows; 16 bytes a thread along K."""
    if m == 1:
        return [(A, 16, 256, 1, 4, 1), (A, 16, 256, 1, 4, 2), (A, 16, 256, 1, 4, 3), (A, 16, 256, 1, 4, 4),
                (A, 16, 512, 1, 4, 1), (A, 16, 512, 1, 4, 3), (A, 32, 256, 1, 4, 1), (A, 32, 256, 1, 4, 3),
                (A, 8, 512, 1, 4, 1), (A, 8, 256, 1, 2, 1), (A, 16, 256, 2, 4, 1), (R, 256, 16, 2, 4, 1),
                (R, 512, 16, 2, 8, 1)]
    if m == 2:
        return [(A, 32, 128, 1, 4, 1), (A, 32, 128, 1, 4, 3), (A, 16, 256, 1, 4, 3), (A, 16, 256, 1, 4, 1),
                (R, 256, 16, 2, 4, 1)]
    return [(R, 128, 16, 2, 4, 1), (R, 128, 32, 2, 4, 1), (A, 64, 64, 1, 8, 1), (A, 16, 256, 1, 4, 3)]


def candidates(m: int, n: int, k: int, num_sms: int) -> list:
    return gemv_split_variants(families(m), lambda fam: (1, 2, 4), n, k, num_sms)


def _warm(job: tuple) -> str:
    m, k, cfg = job
    try:
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        gemv.fp8_gemv(x, torch.randn(64, k, device="cuda", dtype=BF16), None, None, gemv.GemvConfig(*cfg))
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - the timing pass reports it too
        return f"{cfg}: {type(e).__name__}: {str(e)[:200]}"


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def run_shape(model: str, tp: int, proj: str, k: int, n: int, ms: list[int], num_sms: int, rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    ws = [torch.randn(n, k, device="cuda", dtype=BF16, generator=g) / 64 for _ in range(_copies(2 * k * n))]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=BF16, generator=g)
        ref = x.float() @ ws[0].float().t()
        nbytes = 2 * n * k + 2 * m * (k + n)
        cublas = time_us([lambda w=w: F.linear(x, w) for w in ws])
        cands = []
        for cfg in candidates(m, n, k, num_sms):
            try:
                err = _err(gemv.fp8_gemv(x, ws[0], None, None, cfg), ref)
                us = time_us([lambda w=w, c=cfg: gemv.fp8_gemv(x, w, None, None, c) for w in ws])
            except Exception as e:  # noqa: BLE001 - listed, not fatal
                print(f"    {cfg.short()} FAIL {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            cands.append((cfg, us, err))
        ok = [c for c in cands if c[2] < 1e-2]
        best = min(ok, key=lambda c: c[1]) if ok else None
        rows.append({"model": model, "tp": tp, "proj": proj, "K": k, "N": n, "M": m, "bytes": nbytes,
                     "cublas_us": cublas, "candidates": [[c.short(), list(c), us, err] for c, us, err in cands],
                     "best": [best[0].short(), list(best[0]), best[1]] if best else None})
        print(f"{model} tp{tp} {proj:<7} {k:>5}x{n:<5} M={m} | cuBLAS {cublas:6.1f} us {nbytes / cublas / 1e3:6,.0f} GB/s"
              + (f" | best {best[0].short()} {best[1]:6.1f} us {nbytes / best[1] / 1e3:6,.0f} GB/s err {best[2]:.1e}"
                 if best else " | none"), flush=True)
    del ws
    torch.cuda.empty_cache()


def family_of(cfg_list: list) -> str:
    return gemv.GemvConfig(*cfg_list)._replace(split_k=0).short()


def summarise(rows: list) -> dict:
    """Per (model, TP, M): the layer's four linears, cuBLAS vs the best family vs the best per shape."""
    out = {}
    for r in rows:
        d = out.setdefault(f"{r['model']} tp{r['tp']} M={r['M']}", {"cublas": 0.0, "best_per_shape": 0.0,
                                                                     "families": {}, "shapes": 0, "rows": []})
        d["shapes"] += 1
        d["rows"].append(r)
        d["cublas"] += r["cublas_us"]
        d["best_per_shape"] += r["best"][2] if r["best"] else float("nan")
        per_fam: dict = {}
        for short, cfg, us, err in r["candidates"]:
            if err < 1e-2:
                per_fam[family_of(cfg)] = min(per_fam.get(family_of(cfg), 1e9), us)
        for fam, us in per_fam.items():
            d["families"].setdefault(fam, []).append(us)
    print("\n# one layer's four linears (us): cuBLAS | best family | best per shape")
    for key, d in out.items():
        fams = {f: sum(v) for f, v in d["families"].items() if len(v) == d["shapes"]}
        top = sorted(fams.items(), key=lambda kv: kv[1])[:3]
        d["families"] = fams
        d["best_family"] = top[0] if top else None
        print(f"{key:<16} {d['cublas']:7.1f} | {top[0][1] if top else float('nan'):7.1f} | {d['best_per_shape']:7.1f}"
              f"   top: " + ", ".join(f"{f} {v:.1f}" for f, v in top), flush=True)
    return out


def best_config_for(d: dict, r: dict, fam: str) -> gemv.GemvConfig:
    """The split of family `fam` that was fastest on row r's shape."""
    opts = [(us, cfg) for short, cfg, us, err in r["candidates"] if err < 1e-2 and family_of(cfg) == fam]
    return gemv.GemvConfig(*min(opts)[1])


def layer_chain(model: str, tp: int, m: int, d: dict) -> dict:
    """µs per layer of a graph of whole layers: cuBLAS vs the best family, PDL on and off."""
    fam = d["best_family"][0]
    shapes = [(r["proj"], r["K"], r["N"], best_config_for(d, r, fam)) for r in d["rows"]]
    layer_bytes = sum(2 * k * n for _, k, n, _ in shapes)
    layers = max(2, -(-(512 << 20) // layer_bytes))
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [[torch.randn(n, k, device="cuda", dtype=BF16, generator=g) / 64 for _, k, n, _ in shapes]
          for _ in range(layers)]
    xs = {k: torch.randn(m, k, device="cuda", dtype=BF16, generator=g) for _, k, _, _ in shapes}

    def calls(kind: str) -> list:
        out = []
        for lw in ws:
            for (_, k, n, cfg), w in zip(shapes, lw):
                x = xs[k]
                out.append((lambda x=x, w=w: F.linear(x, w)) if kind == "cublas"
                           else (lambda x=x, w=w, c=cfg: gemv.fp8_gemv(x, w, None, None, c)))
        return out

    res = {"family": fam, "layers": layers, "layer_bytes": layer_bytes}
    res["cublas_us"] = time_us(calls("cublas")) * len(shapes)
    saved = os.environ.get(pdl.ENV)
    for flag in ("1", "0"):
        os.environ[pdl.ENV] = flag
        pdl._enabled_on.cache_clear()
        res[f"gemv_pdl{flag}_us"] = time_us(calls("gemv")) * len(shapes)
    if saved is None:
        os.environ.pop(pdl.ENV)
    else:
        os.environ[pdl.ENV] = saved
    pdl._enabled_on.cache_clear()
    print(f"chain {model} tp{tp} M={m}: per layer cuBLAS {res['cublas_us']:.1f} us "
          f"({layer_bytes / res['cublas_us'] / 1e3:,.0f} GB/s) | {fam} PDL {res['gemv_pdl1_us']:.1f} "
          f"({layer_bytes / res['gemv_pdl1_us'] / 1e3:,.0f} GB/s), no PDL {res['gemv_pdl0_us']:.1f}", flush=True)
    del ws
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b:1,8b:2,8b:4,70b:4", help="model:TP pairs")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling the variants first (1: none)")
    args = ap.parse_args()
    t0 = time.time()
    num_sms = _num_sms(0)
    bw = copy_bandwidth_gbs(1 << 30)
    print(f"# {torch.cuda.get_device_name(0)}, {num_sms} SMs, copy {bw:,.0f} GB/s", flush=True)
    ms = [int(v) for v in args.ms.split(",")]
    pairs = [(s.split(":")[0], int(s.split(":")[1])) for s in args.shapes.split(",")]
    cases = [(model, tp, proj, k, n) for model, tp in pairs for proj, k, n in rank_shapes(model, tp)]
    if args.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        jobs = list(dict.fromkeys(
            (gemv.block_m_for(m, cfg.mode), 4096 if k % (cfg.block_k * cfg.unroll) == 0 else k,
             tuple(cfg._replace(split_k=min(cfg.split_k, 2))))
            for _, _, _, k, n in cases for m in ms for cfg in candidates(m, n, k, num_sms)))
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            errs = [e for e in pool.map(_warm, jobs, timeout=300) if e]
        print(f"# prewarm: {len(jobs)} variants in {time.time() - t0:.0f} s" + (f"; failed: {errs[:3]}" if errs else ""),
              flush=True)
    rows: list = []
    for case in cases:
        run_shape(*case, ms, num_sms, rows)
    summary = summarise(rows)
    chains = {}
    for key, d in summary.items():
        if d["best_family"]:
            model, tp, m = key.split()[0], int(key.split()[1][2:]), int(key.split("M=")[1])
            chains[key] = layer_chain(model, tp, m, d)
    for d in summary.values():
        d.pop("rows")
    report = {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": rows, "summary": summary,
              "chains": chains, "wall_s": time.time() - t0}
    print(f"# wall {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
