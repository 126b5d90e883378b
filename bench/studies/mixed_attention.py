"""GPU time of one layer's attention for a step of decodes and prompt chunks: the fixed-grid mixed
kernel (what mixed-step graphs launch) against the decode + prefill kernel pair (what eager steps
launch), on random K/V of a model shape's head layout.

  python bench/studies/mixed_attention.py                     # 8B and 1B layouts, the default mixes
  python bench/studies/mixed_attention.py --block-m 16,32,64  # the mixed kernel's tile rows
  python bench/studies/mixed_attention.py --configs 16/64/4/2,16/128/4/3   # tile rows/tile columns/warps/stages

A mix "32x1000+256@0" is 32 decodes at context 1000 and one 256-token prompt chunk with no cached
prefix. The mixed kernel runs on buffers padded as a graph pads them (T = the step's bucket,
S = min(T, 256) slots). Both sides are captured in a CUDA graph and replayed; times are the median
of 10 samples of 20 replays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"llama-3-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64)}
MIXES = ("32x1000+256@0", "64x600+192@300", "16x2000+256@1500", "256x500", "0+2048@0", "0+512@0,512@0,512@0,512@0",
         "128x1000+128@0")


def parse_mix(mix: str) -> list[tuple[int, int]]:
    """-> [(context_len, query_len)] with the decodes first."""
    dec, _, chunks = mix.partition("+")
    out: list[tuple[int, int]] = []
    if "x" in dec:
        n, ctx = dec.split("x")
        out += [(int(ctx), 1)] * int(n)
    for c in filter(None, chunks.split(",")):
        q, ctx = c.split("@")
        out.append((int(ctx), int(q)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(LAYOUTS))
    ap.add_argument("--mixes", default=";".join(MIXES))
    ap.add_argument("--block-m", default="16,32,64")
    ap.add_argument("--configs", default="", help="comma-separated BLOCK_M/BLOCK_N/warps/stages (instead of --block-m)")
    args = ap.parse_args()
    import torch

    import kernels
    from kernels.mixed_attention import mixed_attention_impl
    from serving.executor.mixed_graphs import mixed_buckets

    dev = torch.device("cuda")
    buckets = mixed_buckets(2048)

    def timed(fn) -> float:
        """GPU time of one call: captured in a CUDA graph (as steps run it), 20 replays per sample,
        so the host's launch work is not in the figure."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / 20)
        return statistics.median(times)

    if args.configs:
        configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",")]
    else:
        configs = [(int(m), 64, 4, 2) for m in args.block_m.split(",")]
    names = ["/".join(map(str, c)) for c in configs]
    print(f"{'shape':14} {'mix':32} {'pair us':>8} " + " ".join(f"{n:>11}" for n in names))
    for shape in args.shapes.split(","):
        heads, kv_heads, d = LAYOUTS[shape]
        for mix in args.mixes.split(";"):
            chunks = parse_mix(mix)
            bs = 16
            blocks = [-(-(c + q) // bs) for c, q in chunks]
            k = torch.randn(sum(blocks) + 1, bs, kv_heads, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            width = max(blocks)
            tables = torch.zeros(len(chunks), width, dtype=torch.int32, device=dev)
            perm = torch.randperm(sum(blocks), device=dev).to(torch.int32)
            i = 0
            for s, nb in enumerate(blocks):
                tables[s, :nb] = perm[i:i + nb]
                i += nb
            lens = torch.tensor([c + q for c, q in chunks], dtype=torch.int32, device=dev)
            q_lens = [q for _, q in chunks]
            qsl_list = [0]
            for n in q_lens:
                qsl_list.append(qsl_list[-1] + n)
            n = qsl_list[-1]
            q = torch.randn(n, heads, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            qsl = torch.tensor(qsl_list, dtype=torch.int32, device=dev)
            nd = sum(1 for _, ql in chunks if ql == 1)
            scale = d ** -0.5
            pre = (tables[nd:].clone(), qsl[nd:] - nd, lens[nd:].clone())

            def pair() -> None:
                if nd:
                    kernels.paged_decode_attention(q[:nd], k, v, tables[:nd], lens[:nd], scale, out=out[:nd])
                if nd < len(chunks):
                    kernels.prefill_attention(q[nd:], k, v, *pre, max(q_lens[nd:]), scale, out=out[nd:])

            t = next(b for b in buckets if b >= n)
            slots = min(t, 256)
            assert len(chunks) <= slots
            qp = torch.zeros(t, heads, d, device=dev, dtype=torch.bfloat16)
            qp[:n] = q
            op = torch.empty_like(qp)
            qslp = torch.full((slots + 1,), n, dtype=torch.int32, device=dev)
            qslp[: len(chunks) + 1] = qsl
            lensp = torch.zeros(slots, dtype=torch.int32, device=dev)
            lensp[: len(chunks)] = lens
            tabp = torch.zeros(slots, width, dtype=torch.int32, device=dev)
            tabp[: len(chunks)] = tables
            row = [timed(pair)]
            pair()
            want = out.float().clone()
            for bm, bn, warps, stages in configs:
                row.append(timed(lambda: mixed_attention_impl(qp, k, v, tabp, qslp, lensp, scale, out=op, block_m=bm,
                                                              block_n=bn, num_warps=warps, num_stages=stages)))
                err = (op[:n].float() - want).abs().max().item()
                assert err < 2e-2, (shape, mix, bm, bn, err)
            print(f"{shape:14} {mix:32} {row[0]:>8.1f} " + " ".join(f"{x:>11.1f}" for x in row[1:]), flush=True)


if __name__ == "__main__":
    main()
