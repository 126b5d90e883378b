"""Does warming L2 with the next weight during latency-bound kernels shorten a decode step? (GPU)

A synthetic decode step on one GPU: each layer runs the four linears of one tensor-parallel rank
(qkv, o, gate_up, down at the per-rank shapes of an 8B / 70B model) with a stand-in for each
latency-bound phase between them (`torch.cuda._sleep`: rotary + attention after qkv, the
all-reduce + norm after o and after down, SiLU-mul after gate_up; their lengths from the TP
profiles in bench/RESULTS.md runs 28 and 35). Every layer has its own weights, so nothing stays
in L2 from one step to the next. Variants, one CUDA graph each, replayed:

- `gemms`: the linears alone (no stand-ins): the floor this trick can approach;
- `plain`: linears + stand-ins, as serving runs today;
- `same:<mode>:<MB>`: `kernels.l2_prefetch` of the next linear's first MB, launched on the same
  stream just before the stand-in;
- `side:<mode>:<MB>`: the same prefetch launched on a second stream (forked after the linear
  before it, joined before the linear it warms), so its launch overlaps the stand-in.

    python3 bench/l2_prefetch.py [--cases 8b:1,8b:2,8b:4,70b:4] [--mb 8,16,32] [--m 1]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {  # hidden, intermediate, query heads, KV heads, head dim, layers
    "8b": (4096, 14336, 32, 8, 128, 32),
    "70b": (8192, 28672, 64, 8, 128, 80),
}
PHASES_US = {"qkv": 9.0, "o": 5.0, "gate_up": 1.2, "down": 5.0}  # the latency-bound time after each linear


def layer_shapes(name: str, tp: int) -> dict[str, tuple[int, int]]:
    h, inter, qh, kvh, hd, _ = SHAPES[name]
    return {"qkv": ((qh // tp + 2 * max(kvh // tp, 1)) * hd, h),
            "o": (h, qh // tp * hd), "gate_up": (2 * inter // tp, h), "down": (h, inter // tp)}


def cycles_per_us() -> float:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(50):
            torch.cuda._sleep(20000)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 20000 * 50 * 5 / (start.elapsed_time(end) * 1000)


def run_case(name: str, tp: int, m: int, variants: list[str], cyc: float, reps: int) -> dict[str, float]:
    from kernels.l2_prefetch import l2_prefetch

    shapes = layer_shapes(name, tp)
    layers = SHAPES[name][5]
    order = ["qkv", "o", "gate_up", "down"]
    weights = [[torch.empty(shapes[k], dtype=torch.bfloat16, device="cuda").normal_() for k in order]
               for _ in range(layers)]
    x_in = {k: torch.randn(m, shapes[k][1], dtype=torch.bfloat16, device="cuda") for k in order}
    side = torch.cuda.Stream()
    for key, w in zip(order, weights[0]):  # cuBLAS handles and Triton compiles happen outside capture
        F.linear(x_in[key], w)
        for mode in (0, 1):
            l2_prefetch(w, 1 << 20, mode)
    torch.cuda.synchronize()
    out: dict[str, float] = {}
    for variant in variants:
        kind, mode, mb = (variant.split(":") + ["", ""])[:3]
        nbytes = int(float(mb or 0) * (1 << 20))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            main = torch.cuda.current_stream()
            for li in range(layers):
                for wi, key in enumerate(order):
                    F.linear(x_in[key], weights[li][wi])
                    if kind == "gemms":
                        continue
                    nxt = weights[li][wi + 1] if wi + 1 < 4 else weights[(li + 1) % layers][0]
                    if kind == "same":
                        l2_prefetch(nxt, nbytes, int(mode))
                    elif kind == "side":
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            l2_prefetch(nxt, nbytes, int(mode))
                    torch.cuda._sleep(int(PHASES_US[key] * cyc))
                    if kind == "side":
                        main.wait_stream(side)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        out[variant] = start.elapsed_time(end) / reps
        del g
    del weights
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="8b:1,8b:2,8b:4,70b:4")
    ap.add_argument("--mb", default="4,8,16,32")
    ap.add_argument("--modes", default="0,1")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cyc = cycles_per_us()
    print(f"# {torch.cuda.get_device_name()}  sleep cycles/us {cyc:.0f}  M={args.m}")
    variants = ["gemms", "plain"]
    for kind in ("same", "side"):
        for mode in args.modes.split(","):
            variants += [f"{kind}:{mode}:{mb}" for mb in args.mb.split(",")]
    stand_in = sum(PHASES_US.values())
    for case in args.cases.split(","):
        name, tp = case.split(":")
        res = run_case(name, int(tp), args.m, variants, cyc, args.reps)
        layers = SHAPES[name][5]
        base = res["plain"]
        print(f"\n## {name} TP={tp} (per-rank shapes {layer_shapes(name, int(tp))}), {layers} layers, "
              f"stand-ins {stand_in:.1f} us a layer")
        print("| variant | ms/step | us/layer | vs plain |")
        print("|---|---|---|---|")
        for v, ms in res.items():
            print(f"| {v} | {ms:.3f} | {ms * 1000 / layers:.1f} | {ms / base:.3f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
