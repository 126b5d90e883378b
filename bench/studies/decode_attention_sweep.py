"""Paged decode attention launch shapes on the GPU: KV read bandwidth per (BLOCK_N, warps, stages).

The reference workload's decode steps spend 35-42 % of the GPU time in stage 1 of
`kernels/paged_decode_attention.py` (bench/studies/profile_workload.py). This times it on the Llama
head shapes (32 query heads, 8 KV heads; head_dim 64 = 1B, 128 = 8B) at decode batches of the
workload (256 and 64 sequences; contexts uniform in [100, 2000], blocks of 16 scattered at
random over a cache as large as the engine's), for each candidate launch shape, against the copy
bandwidth measured in the same run, and prints the best shape per case.

  python bench/studies/decode_attention_sweep.py [--out /tmp/sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs, time_ms  # noqa: E402
from kernels.paged_decode_attention import _default_num_splits, paged_decode_attention_impl  # noqa: E402

BLOCK = 16


def make_case(num_seqs: int, head_dim: int, cache_tokens: int, seed: int = 0, page: int = BLOCK,
              head_major: bool = False):
    """Random bf16 K/V over `cache_tokens` slots, and `num_seqs` contexts scattered over its pages.

    The cache is `[blocks, page, 8, head_dim]` (the engine's, token-major), or with `head_major` a view
    of that shape over `[blocks, 8, page, head_dim]` storage (each KV head's page contiguous)."""
    rng = random.Random(seed)
    lens = [rng.randint(100, 2000) for _ in range(num_seqs)]
    num_blocks = cache_tokens // page
    need = sum(-(-n // page) for n in lens)
    assert need <= num_blocks, (need, num_blocks)
    perm = torch.randperm(num_blocks)[:need].tolist()
    width = max(-(-n // page) for n in lens)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    i = 0
    for s, n in enumerate(lens):
        nb = -(-n // page)
        tables[s, :nb] = torch.tensor(perm[i : i + nb])
        i += nb
    if head_major:
        k = torch.randn(num_blocks, 8, page, head_dim, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3)
    else:
        k = torch.randn(num_blocks, page, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)  # same strides as k
    q = torch.randn(num_seqs, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * sum(lens) * 8 * head_dim * 2
    return q, k, v, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:,.0f} GB/s", flush=True)
    shapes = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))
    results = []
    for head_dim, num_seqs in itertools.product((64, 128), (256, 64)):
        q, k, v, tables, lens, kv_bytes = make_case(num_seqs, head_dim, cache_tokens=1 << 21)
        splits = _default_num_splits(q, 8, tables.shape[1] * BLOCK, 64)
        rows = []
        for block_n, warps, stages in shapes:
            def fn(bn=block_n, w=warps, st=stages):
                return paged_decode_attention_impl(q, k, v, tables, lens, head_dim**-0.5, block_n=bn,
                                                   num_splits=splits, num_warps=w, num_stages=st)
            try:
                ms = time_ms(fn, iters=30, warmup=3)
            except Exception as exc:  # a shape this GPU cannot launch (shared memory): skip it
                print(f"  d={head_dim} S={num_seqs} {block_n}/{warps}/{stages}: {type(exc).__name__}", flush=True)
                continue
            rows.append({"block_n": block_n, "warps": warps, "stages": stages, "us": ms * 1e3,
                         "gbs": kv_bytes / (ms * 1e-3) / 1e9})
        rows.sort(key=lambda r: r["us"])
        cur = next(r for r in rows if (r["block_n"], r["warps"], r["stages"]) == (64, 4, 2))
        best = rows[0]
        print(f"head_dim {head_dim}, {num_seqs} seqs, {splits} split(s), KV {kv_bytes / 1e9:.2f} GB: current 64/4/2 "
              f"{cur['us']:.0f} us = {cur['gbs'] / bw:.1%} of copy; best {best['block_n']}/{best['warps']}/"
              f"{best['stages']} {best['us']:.0f} us = {best['gbs'] / bw:.1%}; next: "
              + ", ".join(f"{r['block_n']}/{r['warps']}/{r['stages']} {r['us']:.0f}" for r in rows[1:5]), flush=True)
        results.append({"head_dim": head_dim, "num_seqs": num_seqs, "splits": splits, "kv_bytes": kv_bytes,
                        "rows": rows})
        del q, k, v
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_gbs": bw, "device": torch.cuda.get_device_name(),
                                              "cases": results}, indent=2))


if __name__ == "__main__":
    main()
