"""Cold start: what a fresh process pays on its first reference workload, and which kernels compile.

Each shape runs in its own fresh Python process (`--child`), with Triton's cache directory
emptied first unless `--keep-cache` (so "cold" means: nothing compiled on this machine yet,
unless the product itself fills the cache during start-up). In that process:
  constructor (LLM(...) to ready) -> reference workload (first run) -> the same again (second run,
  which finds every prompt in the prefix cache) -> the same after emptying the prefix cache (third)
and every Triton specialisation compiled (or loaded from the disk cache) is recorded with the
phase it happened in, its kernel name and its specialisation key, through
`triton.knobs.runtime.jit_cache_hook` (called once per new in-process specialisation).
Prints a table; `--out` writes JSON with the compile list.

  python bench/cold_start.py --shapes llama-3.2-1b,llama-3-8b --out /tmp/cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support


def _child(args: argparse.Namespace) -> dict:
    import torch
    import triton
    from triton import knobs

    from dummy_model import make_dummy_model_dir
    from bench.offline import run_ours
    from bench.workload import reference_workload, workload_floor_s
    from bench.ceilings import copy_bandwidth_gbs, matmul_tflops

    phase = ["constructor"]
    compiles: list[dict] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002, ANN001
        compiles.append({"phase": phase[0], "kernel": fn.name, "t": time.perf_counter(),
                         "constants": {str(k): str(v) for k, v in (compile.get("constants") or {}).items()},
                         "key": str(key)[:400]})
        return False

    knobs.runtime.jit_cache_hook = hook
    tok_dir = args.tokenizer_dir if Path(args.tokenizer_dir).is_dir() else None
    model_dir = make_dummy_model_dir(args.shape, Path(args.model_root) / args.shape, tok_dir)
    prompts, out_lens = reference_workload(args.num_seqs)
    from serving import LLM

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=256, max_model_len=4096,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9)
    startup = time.perf_counter() - t0
    row: dict = {"shape": args.shape, "startup_s": startup, "triton": triton.__version__,
                 "device": torch.cuda.get_device_name()}
    engine = llm.llm_engine
    for name in ("first", "second", "third"):
        # The second run finds the first's prompts in the prefix cache (on by default); the third
        # runs after emptying it, so first vs third isolates what a fresh process pays.
        if name == "third":
            assert llm.reset_prefix_cache()
        phase[0] = name
        hits0 = engine.block_manager.num_prefix_hits
        dt, produced = run_ours(llm, prompts, out_lens)
        row[f"{name}_s"], row[f"{name}_tok_s"] = dt, produced / dt
        row[f"{name}_prefix_hit_tokens"] = engine.block_manager.num_prefix_hits - hits0
    phase[0] = "after"
    bw, tf = copy_bandwidth_gbs(), matmul_tflops()
    floor = workload_floor_s(args.shape, [len(p) for p in prompts], out_lens, tf * 1e12, bw * 1e9)
    row["floor_s"] = floor["floor_s"]
    row["first_of_floor"] = floor["floor_s"] / row["first_s"]
    row["second_of_floor"] = floor["floor_s"] / row["second_s"]
    row["third_of_floor"] = floor["floor_s"] / row["third_s"]
    row["first_over_second"] = row["first_tok_s"] / row["second_tok_s"]
    row["first_over_third"] = row["first_tok_s"] / row["third_tok_s"]
    row["compiles"] = [c for c in compiles if c["phase"] != "after"]
    for ph in ("constructor", "first", "second", "third"):
        row[f"compiles_{ph}"] = sum(c["phase"] == ph for c in compiles)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".bench_models" / "tokenizer"))
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--keep-cache", action="store_true", help="do not empty Triton's cache dir first")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    rows = []
    for shape in args.shapes.split(","):
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
        cmd = [sys.executable, __file__, "--child", "--shape", shape, "--model-root", args.model_root,
               "--tokenizer-dir", args.tokenizer_dir, "--num-seqs", str(args.num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"[{shape}] child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(line[7:])
        row["cache"] = "kept" if args.keep_cache else "emptied"
        rows.append(row)
        by_kernel: dict[str, int] = {}
        for c in row["compiles"]:
            if c["phase"] != "constructor":
                by_kernel[f"{c['phase']}:{c['kernel']}"] = by_kernel.get(f"{c['phase']}:{c['kernel']}", 0) + 1
        print(f"[{shape}] compiled during user work: {by_kernel or 'nothing'}", flush=True)
        for c in row["compiles"]:
            if c["phase"] != "constructor":
                print(f"   {c['phase']:6s} {c['kernel']}: {c['constants']} {c['key'][:200]}", flush=True)
    print("\nshape | Triton cache | start-up s | compiles ctor/1st/2nd/3rd | 1st tok/s | 2nd (prefix hits) | "
          "3rd, cache reset | 1st/2nd | 1st/3rd | of floor 1st/2nd/3rd")
    for r in rows:
        print(f"{r['shape']} | {r['cache']} | {r['startup_s']:.1f} | {r['compiles_constructor']}/{r['compiles_first']}/"
              f"{r['compiles_second']}/{r['compiles_third']} | {r['first_tok_s']:,.0f} | {r['second_tok_s']:,.0f} "
              f"({r['second_prefix_hit_tokens']:,}) | {r['third_tok_s']:,.0f} | {r['first_over_second']:.2f} | "
              f"{r['first_over_third']:.2f} | {r['first_of_floor']:.1%}/{r['second_of_floor']:.1%}/"
              f"{r['third_of_floor']:.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
