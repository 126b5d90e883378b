"""Paged decode attention at batch 1, as a decode step meets it: one launch per layer, each after another.

At batch 1 the attention of a layer reads a few hundred KiB and its time is latency: the launch,
the chain of dependent loads (sequence length, block table, K/V), the merge of the splits. This
times `kernels/paged_decode_attention.py` in a CUDA graph of `--chain` launches where each launch's
query is the previous launch's output (every launch depends on the one before, as the layers of a
step do; programmatic dependent launch as the engine sets it), for Llama head shapes at batch 1:
8B (8 KV heads, 4 query heads each) on one GPU, and a rank of 8B / 70B at TP = 4 (2 KV heads, 4 or 8
query heads each), at several context lengths, per launch shape: the least split length
(`min_split`), BLOCK_N and warps. The split count is the engine's for a graph of 4,096 positions;
the figure is the median replay over the chain's launches.

  python bench/studies/decode_attention_batch1.py [--contexts 128,256,1024,4096] [--out x.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.ceilings import graphed, time_ms  # noqa: E402
from kernels.paged_decode_attention import _default_num_splits, paged_decode_attention_impl  # noqa: E402

PAGE = 16
GRAPH_CONTEXT = 4096  # the block table's width in a decode graph of max_model_len 4096
SHAPES = {"8b_tp1": (8, 4), "8b_tp4": (2, 4), "70b_tp4": (2, 8)}  # KV heads, query heads per KV head


def chain_us(shape: str, context: int, min_split: int, block_n: int, warps: int, chain: int) -> float:
    kvh, group = SHAPES[shape]
    pages = GRAPH_CONTEXT // PAGE
    k = torch.randn(pages, PAGE, kvh, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).reshape(1, pages)  # scattered pages
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    q0 = torch.randn(1, kvh * group, 128, device="cuda", dtype=torch.bfloat16)
    splits = _default_num_splits(q0, kvh, GRAPH_CONTEXT, block_n)

    def step() -> None:
        q = q0
        for _ in range(chain):
            q = paged_decode_attention_impl(q, k, v, tables, lens, 0.088, block_n=block_n, num_splits=splits,
                                            num_warps=warps, min_split=min_split)

    return time_ms(graphed(step), iters=50, warmup=5) * 1000 / chain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="128,256,512,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--min-splits", default="64,128,256,512")
    ap.add_argument("--block-ns", default="32,64")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    variants = list(itertools.product(ints(a.min_splits), ints(a.block_ns), ints(a.warps)))
    results = []
    print(f"{torch.cuda.get_device_name()}; us per launch, {a.chain} chained launches in a graph")
    for shape in a.shapes.split(","):
        for context in ints(a.contexts):
            row = {(m, b, w): chain_us(shape, context, m, b, w, a.chain) for m, b, w in variants}
            best = min(row, key=row.get)
            results += [dict(shape=shape, context=context, min_split=m, block_n=b, warps=w, us=us)
                        for (m, b, w), us in row.items()]
            cells = " ".join(f"m{m}/b{b}/w{w} {us:.2f}" for (m, b, w), us in row.items())
            print(f"{shape:8s} ctx {context:5d}: best m{best[0]}/b{best[1]}/w{best[2]} {row[best]:.2f} | {cells}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
