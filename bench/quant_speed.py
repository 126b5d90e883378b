"""Quantized linear speed at the Llama-3-8B projections, old kernels against new, then end to end.

One command (one H100/H200):

  python3 bench/quant_speed.py [--sweep] [--workload] [--json PATH]

1. Per-kernel table, M = 1, 16, 64, 256, 2048 over q/o (4096 x 4096), k/v (4096 x 1024), gate/up
   (4096 x 14336), down (14336 x 4096) and the fused qkv / gate_up the engine runs: µs of bf16
   `F.linear`; "old" is what serving ran before issue 27's kernels, "new" what it runs now: int4 g128
   old `kernels.int4_matmul` (GPTQ layout: GEMV, tiles to 64 rows, dequantise + cuBLAS above), new
   `kernels.int4_kchunk_linear` (the k-chunk layout repacked at load, `pick_kchunk_config` per M, as
   `serving/executor/quant/gptq.py` calls it); FP8 old `scaled_mm_linear` (quantise + `_scaled_mm`),
   new `kernels.fp8_linear`; each new kernel's GB/s and TFLOP/s against the copy and bf16 matmul
   ceilings measured in the same run, and its relative error against the torch reference.
   Timings replay a CUDA graph of calls rotating over >= 256 MB of weight copies (weights from HBM).
2. Batch-1 decode ms/token of the 8B shape, bf16 / GPTQ int4 g128 / FP8, through the offline API
   (`bench/latency.py`, random weights, one process); `--workload` adds the reference workload's
   tokens/s for the three (`bench/offline.py`).
3. `--sweep` (last): candidate tilings of the new FP8 kernel at o and gate_up per M (default and best
   three); the int4 tilings have their own sweep, `bench/int4_sweep.py` (`--large` above 64 rows).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402

import kernels  # noqa: E402
from bench.ceilings import copy_bandwidth_gbs, matmul_tflops  # noqa: E402
from bench.quant_kernels import _copies, int4_weights, time_us, write_report  # noqa: E402
from kernels import quant_reference  # noqa: E402
from kernels.fp8_matmul import scaled_mm_linear  # noqa: E402
from kernels.int4_matmul import quant_linear_impl  # noqa: E402
from kernels.skinny_linear import MAX_M, card_of, pick_skinny_config, skinny_linear_impl  # noqa: E402
from bench.skinny_sweep import candidates as skinny_candidates  # noqa: E402

BF16 = torch.bfloat16
GROUP = 128
MS = (1, 16, 64, 256, 2048)
# (name, K, N); the last four are what the engine runs (fused q|k|v and gate|up).
PROJECTIONS = [("q,o", 4096, 4096), ("k,v", 4096, 1024), ("gate,up", 4096, 14336), ("down", 14336, 4096),
               ("qkv", 4096, 6144), ("gate_up", 4096, 28672)]
ENGINE = ("qkv", "q,o", "gate_up", "down")  # one decoder layer: qkv, o, gate_up, down
SWEPT = ("q,o", "gate_up")  # the narrowest and the widest engine shapes (split-K matters, then not)
NUM_LAYERS = 32


def int4_bytes(m: int, k: int, n: int) -> int:
    return k * n // 2 + 2 * (k // GROUP) * n * 2 + m * k * 2 + m * n * 2


def fp8_bytes(m: int, k: int, n: int) -> int:
    return k * n + 4 * n + m * k * 2 + m * n * 2


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _try(fn):
    """Time fn, or the error's first words (a kernel that fails to compile is reported, not fatal)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the bench reports every failure and goes on
        return f"{type(e).__name__}: {str(e)[:160]}"


def make_weights(k: int, n: int):
    """Rotating copies: bf16 [N, K]; int4 (GPTQ qweight, k-chunks, scales, zeros); fp8 (weight, scale)."""
    w16 = [torch.randn(n, k, device="cuda", dtype=BF16) / 64 for _ in range(_copies(k * n * 2))]
    w4 = [(q, kernels.repack_int4_kchunk(q), s, z) for q, s, z in int4_weights(k, n, GROUP, _copies(k * n // 2))]
    w8 = [kernels.quantize_fp8(w) for w in (w16 * 8)[: _copies(k * n)]]
    return w16, w4, w8


def sweep(num_sms: int, report: dict) -> None:
    print("\n# sweep of the new FP8 kernel: default and best three per shape and M (µs)", flush=True)
    for name, k, n in PROJECTIONS:
        if name not in SWEPT:
            continue
        _, _, w8 = make_weights(k, n)
        for m in MS:
            if m > MAX_M:
                continue
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            rows = [(cfg, _try(lambda c=cfg: time_us([lambda w=w: skinny_linear_impl(x, w[0], w[1], None, c)
                                                      for w in w8])))
                    for cfg in skinny_candidates(m, n, k, 1, num_sms)]
            default = pick_skinny_config(m, n, k, torch.float8_e4m3fn, num_sms, card_of(x.device))
            timed = sorted((r for r in rows if isinstance(r[1], float)), key=lambda r: r[1])
            fails = [r for r in rows if not isinstance(r[1], float)]
            d = next((t for c, t in rows if c == default), None)
            if d is None:
                d = _try(lambda: time_us([lambda w=w: skinny_linear_impl(x, w[0], w[1], None, default) for w in w8]))
            d_s = f"{d:.1f}" if isinstance(d, float) else d
            print(f"fp8 {name} K={k} N={n} M={m}: default {tuple(default)} {d_s}; best "
                  + "; ".join(f"{tuple(c)} {t:.1f}" for c, t in timed[:3])
                  + (f"; {len(fails)} failed, e.g. {tuple(fails[0][0])}: {fails[0][1]}" if fails else ""), flush=True)
            report.setdefault("sweep", []).append({"kind": "fp8", "name": name, "K": k, "N": n, "M": m,
                                                   "default": [list(default), d],
                                                   "best": [[list(c), t] for c, t in timed[:5]],
                                                   "failed": [[list(c), t] for c, t in fails[:3]]})
        del w8
        torch.cuda.empty_cache()


def table(bw: float, tflops: float, report: dict) -> None:
    print(f"\n# per kernel: µs (int4 g128; fp8 per-channel); new kernels' GB/s and TFLOP/s against copy "
          f"{bw:,.0f} GB/s and bf16 matmul {tflops:,.0f} TFLOP/s; err = new vs torch reference", flush=True)
    head = (f"{'proj':>8} {'K x N':>12} {'M':>5} {'bf16':>8} {'int4 old':>9} {'int4 new':>9} {'new/bf16':>8} "
            f"{'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5} {'err':>8} | {'fp8 old':>8} {'fp8 new':>8} "
            f"{'new/bf16':>8} {'GB/s':>7} {'%copy':>6} {'err':>8}")
    print(head)
    per_token = {key: 0.0 for key in ("bf16", "int4_old", "int4_new", "fp8_old", "fp8_new")}
    for name, k, n in PROJECTIONS:
        w16, w4, w8 = make_weights(k, n)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            t16 = time_us([lambda w=w: F.linear(x, w) for w in w16])
            t4o = _try(lambda: time_us([lambda w=w: quant_linear_impl(x, w[0], w[2], w[3], None, 4, GROUP) for w in w4]))
            t4n = _try(lambda: time_us([lambda w=w: kernels.int4_kchunk_linear(x, w[1], w[2], w[3], GROUP) for w in w4]))
            t8o = _try(lambda: time_us([lambda w=w: scaled_mm_linear(x, w[0], w[1], own_tiles=False) for w in w8]))
            t8n = _try(lambda: time_us([lambda w=w: kernels.fp8_linear(x, w[0], w[1]) for w in w8]))
            q, p, s, z = w4[0]
            e4 = _try(lambda: _rel(kernels.int4_kchunk_linear(x, p, s, z, GROUP),
                                   quant_reference.quant_linear(x, q, s, z, None, 4, GROUP)))
            e8 = _try(lambda: _rel(kernels.fp8_linear(x, *w8[0]), quant_reference.fp8_linear(x, *w8[0])))
            row = {"proj": name, "K": k, "N": n, "M": m, "bf16_us": t16, "int4_old_us": t4o, "int4_new_us": t4n,
                   "fp8_old_us": t8o, "fp8_new_us": t8n, "int4_err": e4, "fp8_err": e8}
            report.setdefault("table", []).append(row)

            def f(v, spec):
                return format(v, spec) if isinstance(v, float) else "FAIL"

            ok4, ok8 = isinstance(t4n, float), isinstance(t8n, float)
            gb4 = int4_bytes(m, k, n) / t4n / 1e3 if ok4 else None
            tf4 = 2 * m * k * n / t4n / 1e6 if ok4 else None
            gb8 = fp8_bytes(m, k, n) / t8n / 1e3 if ok8 else None
            print(f"{name:>8} {k:>5} x {n:<5} {m:>5} {t16:>8.1f} {f(t4o, '9.1f'):>9} {f(t4n, '9.1f'):>9} "
                  f"{f(t4n / t16 if ok4 else None, '8.2f'):>8} {f(gb4, '7,.0f'):>7} "
                  f"{f(gb4 / bw if ok4 else None, '6.0%'):>6} {f(tf4, '8.1f'):>8} "
                  f"{f(tf4 / tflops if ok4 else None, '5.0%'):>5} {f(e4, '8.1e'):>8} | {f(t8o, '8.1f'):>8} "
                  f"{f(t8n, '8.1f'):>8} {f(t8n / t16 if ok8 else None, '8.2f'):>8} {f(gb8, '7,.0f'):>7} "
                  f"{f(gb8 / bw if ok8 else None, '6.0%'):>6} {f(e8, '8.1e'):>8}", flush=True)
            for key, v in (("int4_old", t4o), ("int4_new", t4n), ("fp8_old", t8o), ("fp8_new", t8n)):
                if not isinstance(v, float):
                    print(f"    {key}: {v}", flush=True)
            if m == 1 and name in ENGINE:
                for key, v in (("bf16", t16), ("int4_old", t4o), ("int4_new", t4n), ("fp8_old", t8o), ("fp8_new", t8n)):
                    per_token[key] += (v if isinstance(v, float) else float("nan")) * NUM_LAYERS / 1e3
        del w16, w4, w8
        torch.cuda.empty_cache()
    floor4 = sum(int4_bytes(1, k, n) for name, k, n in PROJECTIONS if name in ENGINE) * NUM_LAYERS / bw / 1e6
    floor8 = sum(fp8_bytes(1, k, n) for name, k, n in PROJECTIONS if name in ENGINE) * NUM_LAYERS / bw / 1e6
    b = per_token["bf16"]
    print(f"\nbatch-1 linear layers of one 8B token (qkv, o, gate_up, down x 32 layers, no LM head), ms: "
          f"bf16 {b:.3f}; int4 old {per_token['int4_old']:.3f} ({per_token['int4_old'] / b:.2f}x), new "
          f"{per_token['int4_new']:.3f} ({per_token['int4_new'] / b:.2f}x, int4 floor {floor4:.3f} = "
          f"{floor4 / per_token['int4_new']:.0%}); fp8 old {per_token['fp8_old']:.3f} ({per_token['fp8_old'] / b:.2f}x), "
          f"new {per_token['fp8_new']:.3f} ({per_token['fp8_new'] / b:.2f}x, fp8 floor {floor8:.3f} = "
          f"{floor8 / per_token['fp8_new']:.0%})", flush=True)
    report["per_token_ms"] = per_token | {"int4_floor": floor4, "fp8_floor": floor8}


def end_to_end(workload: bool, json_path: str) -> None:
    """The offline API in child processes (each engine gets the whole GPU), printing as they go."""
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    runs = [["bench/latency.py", "--shapes", "llama-3-8b", "--quantize", "bf16,gptq,fp8", "--new-tokens", "128"]
            + (["--out", f"{stem}.latency.json"] if json_path else [])]
    if workload:
        runs.append(["bench/offline.py", "--shapes", "llama-3-8b", "--quantize", "bf16,gptq,fp8",
                     "--gpu-memory-utilization", "0.85"]
                    + (["--out", f"{stem}.offline.json"] if json_path else []))
    for cmd in runs:
        print(f"\n# {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, *cmd], cwd=ROOT).returncode
        print(f"# exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time candidate tilings of the new kernels first")
    ap.add_argument("--workload", action="store_true", help="also the reference workload tokens/s (bench/offline.py)")
    ap.add_argument("--no-e2e", action="store_true", help="kernels only: skip the offline-API measurements")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    bw, tflops = copy_bandwidth_gbs(), matmul_tflops()
    report: dict = {"device": torch.cuda.get_device_name(0), "copy_gbs": bw, "matmul_tflops": tflops}
    table(bw, tflops, report)
    print(f"# kernel table: {time.perf_counter() - t0:.0f} s", flush=True)
    write_report(args.json, report)
    if not args.no_e2e:
        torch.cuda.empty_cache()
        end_to_end(args.workload, args.json)
    if args.sweep:  # last: the figures above are the ones to report
        sweep(num_sms, report)
        print(f"# sweep done: {time.perf_counter() - t0:.0f} s", flush=True)
        write_report(args.json, report)
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
