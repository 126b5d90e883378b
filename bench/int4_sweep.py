"""Int4 decode sweep: the k-chunk kernels' tilings against bf16 cuBLAS and the general GPTQ kernel.

One command (one H100/H200, about 2-3 minutes, mostly Triton compiles):

  python3 bench/int4_sweep.py [--json PATH] [--quick]

For the 8B engine projections (qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down
14336 x 4096) and M = 1, 2, 4, 16 it prints one line per candidate: µs, effective GB/s (int4 bytes
moved: weights, scales, zeros, x, out) and relative error against the torch reference
(`quant_reference.quant_linear` on the checkpoint's GPTQ words, so the load-time repack is checked
too), beside bf16 `F.linear` and the general kernel (`kernels/int4_matmul.py`, what serving runs
today). Candidates: `kernels/int4_kchunk.KChunkConfig` tilings, each at the split-K factors that
reach 1, 2 and 4 programs per SM. Timings replay a CUDA graph of calls rotating over >= 256 MB of
weight copies (`bench/quant_kernels.time_us`). Last: the batch-1 linear layers of one 8B token
(32 layers) for bf16, the general kernel and the best k-chunk tiling per shape.
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
from bench.quant_kernels import _copies, int4_weights, time_us  # noqa: E402
from bench.quant_speed import _rel, _try  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels.int4_kchunk import KChunkConfig, int4_kchunk_linear_impl, pick_kchunk_config  # noqa: E402
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
    return out[:3] if quick else out


def with_splits(cfg: KChunkConfig, m: int, n: int, k: int, num_sms: int, quick: bool) -> list[KChunkConfig]:
    tiles = triton.cdiv(n, cfg.block_n) * (1 if cfg.block_m < 16 else triton.cdiv(m, cfg.block_m))
    k_tiles = triton.cdiv(k, cfg.block_k)
    splits = {_split_for(tiles, k_tiles, p * num_sms) for p in ((2,) if quick else PER_SM)}
    return [cfg._replace(split_k=s) for s in sorted(splits)]


def run_shape(name: str, k: int, n: int, num_sms: int, quick: bool, report: dict) -> dict:
    """Every M for one projection; returns {M: (bf16 us, general us, best k-chunk (us, config))}."""
    w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(_copies(k * n * 2))]
    w4 = [(q, quant_reference.repack_int4_kchunk(q), s, z) for q, s, z in int4_weights(k, n, GROUP, _copies(k * n // 2))]
    q0, p0, s0, z0 = w4[0]
    best = {}
    for m in MS:
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
        default = pick_kchunk_config(m, n, k, GROUP, num_sms)
        cands = [c for base in base_configs(m, quick) for c in with_splits(base, m, n, k, num_sms, quick)]
        results = []
        for cfg in dict.fromkeys([default, *cands]):
            err = _try(lambda c=cfg: _rel(int4_kchunk_linear_impl(x, p0, s0, z0, GROUP, None, c), ref))
            t = _try(lambda c=cfg: time_us([lambda w=w: int4_kchunk_linear_impl(x, w[1], w[2], w[3], GROUP, None, c)
                                            for w in w4])) if isinstance(err, float) else err
            ok = isinstance(t, float)
            tag = " (default)" if cfg == default else ""
            if ok:
                results.append((t, cfg))
                bad = "  WRONG" if err > 1e-2 else ""
                print(f"  {tuple(cfg)}{tag}: {t:.1f} us {nbytes / t / 1e3:,.0f} GB/s x{t / t16:.2f} bf16 "
                      f"x{t / t_old:.2f} general err {err:.1e}{bad}", flush=True)
            else:
                print(f"  {tuple(cfg)}{tag}: FAIL {t}", flush=True)
            row["kchunk"].append({"config": list(cfg), "us": t if ok else None, "err": err if ok else None,
                                  "gbs": nbytes / t / 1e3 if ok else None, "error": None if ok else t,
                                  "default": cfg == default})
        results.sort(key=lambda r: r[0])
        if results:
            t, c = results[0]
            print(f"  best {tuple(c)} {t:.1f} us = {nbytes / t / 1e3:,.0f} GB/s, x{t / t16:.2f} bf16, "
                  f"x{t / t_old:.2f} general", flush=True)
        best[m] = (t16, t_old, results[0] if results else None)
        report["rows"].append(row)
    del w16, w4
    torch.cuda.empty_cache()
    return best


def _write(path: str, report: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--quick", action="store_true", help="three tilings per M at one split (a smoke run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:,.0f} GB/s", flush=True)
    report: dict = {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "rows": []}
    totals = {m: [0.0, 0.0, 0.0] for m in MS}
    for name, k, n in SHAPES:
        best = run_shape(name, k, n, num_sms, args.quick, report)
        for m, (t16, t_old, b) in best.items():
            totals[m][0] += t16 * NUM_LAYERS / 1e3
            totals[m][1] += t_old * NUM_LAYERS / 1e3
            totals[m][2] += (b[0] if b else float("nan")) * NUM_LAYERS / 1e3
        print(f"# {name} done: {time.perf_counter() - t0:.0f} s", flush=True)
        _write(args.json, report)  # after each shape: a run cut short keeps what it measured
    floor = {m: sum(int4_bytes(m, k, n) for _, k, n in SHAPES) * NUM_LAYERS / bw / 1e6 for m in MS}
    print("\n# linear layers of one 8B decode step (qkv, o, gate_up, down x 32 layers, no LM head), ms")
    for m in MS:
        b16, old, new = totals[m]
        print(f"M={m}: bf16 {b16:.3f}; general {old:.3f} (x{old / b16:.2f}); k-chunk best {new:.3f} "
              f"(x{new / b16:.2f}; int4 floor {floor[m]:.3f} = {floor[m] / new:.0%} of it)", flush=True)
    report["per_step_ms"] = {str(m): {"bf16": totals[m][0], "general": totals[m][1], "kchunk_best": totals[m][2],
                                      "int4_floor": floor[m]} for m in MS}
    _write(args.json, report)
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
