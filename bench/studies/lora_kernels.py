"""Multi-LoRA kernel latency per decoder layer, per variant, under a CUDA graph (issue 14).

One Llama-3-8B layer's four adapted projections (qkv 4096 -> 4096|1024|1024, o 4096 -> 4096,
gate_up 4096 -> 14336|14336, down 14336 -> 4096; bf16, random weights), 16 slots of rank 16,
every row on a random slot, run through `serving.executor.lora.LoRALinear` exactly as the
engine does. Per T and per `LORA_VARIANT` (split / stream): capture the layer's four
projections in one CUDA graph, replay it 200 times (20 timed runs of 10), median; the table
shows the base GEMMs alone and the microseconds each variant adds per layer (the batch-1 budget
is ~22 us: 0.70 ms over 32 layers). Each variant's output is checked against the split
variant's before it is timed.

  python bench/studies/lora_kernels.py            # ~1 minute on an H200 (mostly Triton compiles)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kernels  # noqa: E402
from serving.executor import lora as lora_exec  # noqa: E402

# (name, K, packed output slices): Llama-3-8B, one GPU
SHAPES = (("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)),
          ("down", 14336, (4096,)))
VARIANTS = ("split", "stream")  # LORA_VARIANT values


class _Dense(nn.Module):
    """The base projection: y = x · Wᵀ (cuBLAS, as the engine's unquantized layers)."""

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def build_layer(num_slots: int, rank: int, device: torch.device) -> tuple[list[lora_exec.LoRALinear], lora_exec.LoRABatch]:
    """The four wrapped projections of one layer, random adapters in every slot."""
    batch = lora_exec.LoRABatch()
    like = torch.empty(0, dtype=torch.bfloat16, device=device)
    layer = []
    for name, k, sizes in SHAPES:
        parts = [(f"{name}{i}", 0, n) for i, n in enumerate(sizes)]
        m = lora_exec.LoRALinear(_Dense(sum(sizes), k, device), parts, None, k, num_slots, rank, batch, like)
        m.lora_a.normal_(std=k**-0.5)
        m.lora_b.normal_(std=0.01)
        layer.append(m)
    return layer, batch


def time_graph(fn, reps: int = 20, inner: int = 10) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the default stream, as torch advises
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    graph.reset()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--num-slots", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer, batch = build_layer(args.num_slots, args.rank, device)
    token_counts = [int(t) for t in args.tokens.split(",")]
    results: dict[int, dict[str, float]] = {}
    per_projection: dict[str, list[float]] = {}  # T=1: label -> us per projection (base: absolute)
    for t in token_counts:
        xs = [torch.randn(t, k, device=device, dtype=torch.bfloat16) for _, k, _ in SHAPES]
        slots = torch.randint(0, args.num_slots, (t,)).numpy()
        batch.segments = tuple(torch.from_numpy(a).to(device) for a in kernels.lora_segments_host(slots, args.num_slots))
        segments = batch.segments

        def run_layer() -> list[torch.Tensor]:
            return [m(x) for m, x in zip(layer, xs)]

        row: dict[str, float] = {}
        batch.segments = None  # the base projections alone
        row["base"] = time_graph(run_layer)
        batch.segments = segments
        lora_exec.LORA_VARIANT = "split"
        expected = run_layer()
        for label in VARIANTS:
            lora_exec.LORA_VARIANT = label
            got = run_layer()
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)
            row[label] = time_graph(run_layer) - row["base"]
            if t == 1:  # where the time goes: each projection alone
                per_projection[label] = [time_graph(lambda m=m, x=x: m(x)) for m, x in zip(layer, xs)]
        if t == 1:
            batch.segments = None
            per_projection["base"] = [time_graph(lambda m=m, x=x: m(x)) for m, x in zip(layer, xs)]
        results[t] = row
        print(f"T={t:4d}: base {row['base']:7.1f} us/layer; added: "
              + ", ".join(f"{k} {v:+.1f}" for k, v in row.items() if k != "base"), flush=True)

    labels = list(VARIANTS)
    print(f"\n{torch.cuda.get_device_name()}: microseconds per Llama-3-8B layer (4 projections), "
          f"{args.num_slots} slots of rank {args.rank}, CUDA graph, median of 200 replays")
    print(f"{'T':>5} {'base':>8} " + " ".join(f"{'+' + label:>11}" for label in labels))
    for t, row in results.items():
        print(f"{t:>5} {row['base']:>8.1f} " + " ".join(f"{row[label]:>11.1f}" if label in row else f"{'-':>11}"
                                                        for label in labels))
    if per_projection:
        base = per_projection.pop("base")
        print("\nT=1, each projection alone (base us; added us per variant)")
        print(f"{'proj':>8} {'base':>8} " + " ".join(f"{'+' + label:>11}" for label in per_projection))
        for i, (name, _, _) in enumerate(SHAPES):
            print(f"{name:>8} {base[i]:>8.1f} " + " ".join(f"{v[i] - base[i]:>11.1f}" for v in per_projection.values()))
        best = [min(per_projection, key=lambda label: per_projection[label][i]) for i in range(len(SHAPES))]
        print("fastest per projection: " + ", ".join(f"{name} {b}" for (name, _, _), b in zip(SHAPES, best)))
    if 1 in results:
        row = {k: v for k, v in results[1].items() if k != "base"}
        best = min(row, key=row.get)
        print(f"\nT=1 fastest: {best} (+{row[best]:.1f} us/layer = +{row[best] * 32 / 1e3:.2f} ms/token over 32 "
              f"layers; budget +22 us/layer = +0.70 ms/token)")


if __name__ == "__main__":
    main()
