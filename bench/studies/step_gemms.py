"""A decoder layer's GEMMs against the step's token count: where adding prompt tokens stops being free.

For each shape and each M (tokens in a step), times one layer's four bf16 linears (qkv, o, gate_up,
down: `F.linear` on weights of the real shapes, as the model runs them) inside a CUDA graph over
`--layers` layers of distinct weights (more than L2 holds, so every replay reads them from memory),
and prints µs per layer beside the layer's bound, max(weight bytes / copy bandwidth, FLOPs / matmul
rate), both measured in the same run. A step's M is worth filling with prompt tokens up to where
the time starts to rise with M; the ratio to the bound shows how tile sizes treat each M.

  python bench/studies/step_gemms.py --shapes llama-3.2-1b,llama-3-8b --m 128,192,256,288,320,384,512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs, graphed, matmul_tflops, time_ms  # noqa: E402
from dummy_model import shape_info  # noqa: E402


def layer_linears(shape: str) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one decoder layer's linears."""
    c = shape_info(shape)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    return [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * i, h), ("down", h, i)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--m", default="64,128,160,192,224,256,272,288,320,352,384,448,512")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    bw, tf = copy_bandwidth_gbs() * 1e9, matmul_tflops() * 1e12
    print(f"ceilings: copy {bw / 1e9:,.0f} GB/s, bf16 matmul {tf / 1e12:,.0f} TFLOP/s")
    dev, dt = "cuda", torch.bfloat16
    for shape in args.shapes.split(","):
        linears = layer_linears(shape)
        weights = [[torch.randn(o, i, device=dev, dtype=dt) * 0.02 for _, o, i in linears] for _ in range(args.layers)]
        params = sum(o * i for _, o, i in linears)
        print(f"\n{shape}: {params / 1e6:.1f}M linear weights a layer; µs a layer (of bound), per linear µs")
        print(f"{'M':>5} {'layer us':>9} {'bound us':>9} {'of bound':>9} {'us/token':>9}  " +
              " ".join(f"{n:>8}" for n, _, _ in linears))
        for m in [int(x) for x in args.m.split(",")]:
            xs = {i: torch.randn(m, i, device=dev, dtype=dt) for _, _, i in linears}
            per = []
            for j, (_, o, i) in enumerate(linears):
                fn = graphed(lambda j=j, i=i: [F.linear(xs[i], w[j]) for w in weights])
                per.append(time_ms(fn, iters=20) * 1e3 / args.layers)
            total = sum(per)
            bound = max(2 * params / bw, 2 * params * m / tf) * 1e6
            print(f"{m:>5} {total:9.1f} {bound:9.1f} {bound / total:9.1%} {total / m:9.3f}  " +
                  " ".join(f"{p:8.1f}" for p in per), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
