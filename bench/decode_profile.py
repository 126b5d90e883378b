"""What one decode step's CUDA graph spends its time on, kernel by kernel, on rank 0 of TP ranks.

Issue 25's decode figures leave ~49 us per layer above the weight-bandwidth floor at TP=4 (8B and
70B alike), ~29 us at TP=1, and two all-reduces of ~10 us each explain only part of it. This
script loads the model shape with random bf16 weights in one process per GPU (the same
`ModelRunner` each engine rank builds, custom all-reduce as the engine sets it up), points the
batch-1 decode graph at a 128-token sequence (`--batch`: the graph of 2, 4 or 8 such sequences), and replays it:

- untraced, timed with CUDA events (max over ranks): the graph alone, no host work between steps
  (the engine's ms/token minus this is host time per step);
- under torch.profiler (CUDA activity) on rank 0 while every rank replays: each kernel of each
  replay (kernels are matched to their `cudaGraphLaunch` by correlation id), summed per step by
  kernel name and by kind (GEMM, all-reduce, attention, norm, ...), plus the idle time between
  kernels inside the step (launch gaps of the graph's nodes).

The printed table is per step and per layer; the chrome trace is written beside the JSON. With
programmatic dependent launch on (`kernels/pdl.py`, the default on sm_90) a kernel is timed from its
early launch, its wait for the previous kernel included, so the per-kernel sums exceed the span (run 49);
`OPEN_LMI_PDL=0` gives a per-kernel attribution of the step without that overlap.

  python bench/decode_profile.py --tp 1,4                    # Llama-3-8B shape, on 4 GPUs (~1 min)
  python bench/decode_profile.py --shape llama-3-70b --tp 4  # the 70B shape
  python bench/decode_profile.py --tp 1 --quantize bf16,gptq,fp8  # quantized weights (tests/support QUANT_VARIANTS)
  python bench/decode_profile.py --tp 1 --quantize fp8 --tiles "card; default; gemv1=0,16,512,1,4,4,2"
      # decode-tile variants of kernels/skinny_linear.py's tables (bench/tiles.py), one profile each
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402

import bench.parallel  # noqa: E402, F401 - adds the 70B shape to SHAPES
import bench.tiles  # noqa: E402
from bench.ceilings import time_ms  # noqa: E402
from bench.studies.profile_workload import busy_and_gaps, family  # noqa: E402
from dummy_model import QUANT_VARIANTS, SHAPES, dummy_dir, make_dummy_model_dir  # noqa: E402

# The all-reduce's kernels (NCCL's, torch symm_mem's one-/two-shot, their barriers) before the
# families of bench/studies/profile_workload.py (GEMM, attention, norm, rotary, KV write, ...).
_ALL_REDUCE = re.compile(r"one_shot|two_shot|all_reduce|allreduce|nccl|barrier|symm_mem")


def kind_of(name: str) -> str:
    return "all-reduce" if _ALL_REDUCE.search(name.lower()) else family(name)


def step_kernels(trace: dict, replays: int) -> tuple[list[list[dict]], str]:
    """The trace's kernels grouped by the graph launch that ran them (launches in time order), and
    how they were grouped.

    Kernels replayed from a CUDA graph carry the correlation id of their `cudaGraphLaunch` runtime
    call; kernels no graph launch owns (a barrier's) are left out. Where the trace links none (a
    profiler that drops graph correlations), every kernel of the window is one group standing for
    `replays` steps ("window": its gaps then include the host's between replays)."""
    events = trace.get("traceEvents", [])
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")
                and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    steps: dict[int, list[dict]] = defaultdict(list)
    for k in kernels:
        if k.get("args", {}).get("correlation") in launches:
            steps[k["args"]["correlation"]].append(k)
    if steps:
        return [sorted(steps[c], key=lambda k: k["ts"]) for c in sorted(steps, key=launches.get)], "graph launch"
    if not kernels:
        raise ValueError("the trace holds no kernels")
    return [sorted(kernels, key=lambda k: k["ts"])] + [[] for _ in range(replays - 1)], "window"


def summarize(steps: list[list[dict]]) -> dict:
    """Per-step means over `steps` (empty groups count as steps): us by kernel name and by kind,
    calls, busy time (the union of kernel intervals), span (first start to last end) and gaps."""
    n = len(steps)
    if not any(steps):
        raise ValueError("no kernels to summarize")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # [us, calls] summed over steps
    busy = span = 0.0
    for kernels in filter(None, steps):
        for k in kernels:
            by_name[k["name"]][0] += k["dur"]
            by_name[k["name"]][1] += 1
        step_busy, _, first, last = busy_and_gaps([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
        busy += step_busy
        span += last - first
    names = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, (us, calls) in names:
        by_kind[kind_of(name)][0] += us / n
        by_kind[kind_of(name)][1] += calls / n
    return {"steps": n, "kernels_per_step": sum(len(k) for k in steps) / n, "busy_us": busy / n,
            "span_us": span / n, "gap_us": (span - busy) / n,
            "by_name": [{"name": name, "kind": kind_of(name), "us": us / n, "calls": calls / n}
                        for name, (us, calls) in names],
            "by_kind": {k: {"us": v[0], "calls": v[1]} for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])}}


def _rank(rank: int, world: int, init_file: str, model_dir: str, custom: bool, seq_len: int, replays: int,
          traced: int, out_file: str, quantization: str | None = None, batch: int = 1, tiles: str = "card") -> None:
    import torch.distributed as dist

    from serving.engine_config import EngineConfig
    from serving.executor import parallel
    from serving.executor.model_runner import ModelRunner
    from serving.executor.rank_process import die_with_parent

    die_with_parent(os.getppid())  # a parent killed on a timeout takes its ranks along
    bench.tiles.apply(tiles)  # before any decode graph is captured
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if world > 1:
        parallel.init_tensor_parallel(rank, world, f"file://{init_file}", "nccl", device=device,
                                      custom_all_reduce=custom)
    config = EngineConfig.from_options(model_dir, tensor_parallel_size=world, load_format="dummy", dtype="bfloat16",
                                       max_num_seqs=8, max_model_len=4096, num_gpu_blocks_override=1024,
                                       skip_tokenizer_init=True, disable_custom_all_reduce=not custom,
                                       quantization=quantization)
    runner = ModelRunner(config, model_dir, device=device, rank=rank, world_size=world)
    graphs = runner.graph_runner
    assert graphs is not None and batch in graphs.graphs, f"no batch-{batch} decode graph was captured"
    blocks = -(-seq_len // runner.block_size)
    # `batch` sequences of seq_len tokens, each in its own blocks: their last tokens are decoded, their K/V
    # written to slot seq_len - 1 of their blocks.
    for b in range(batch):
        graphs.input_ids[b] = 1000 + b
        graphs.positions[b] = seq_len - 1
        graphs.slot_mapping[b] = b * blocks * runner.block_size + seq_len - 1
        graphs.seq_lens[b] = seq_len
        graphs.block_tables[b, :blocks] = torch.arange(b * blocks, (b + 1) * blocks, dtype=torch.int32, device=device)
    graph = graphs.graphs[batch]
    # The path one decode token's sum takes (the custom all-reduce may have refused to start).
    # (In Llama layers the sums go through all_reduce_rms_norm: "fused" where the fused kernel takes them.)
    path = parallel.all_reduce_rms_norm_path(torch.empty(1, runner.model_args.hidden_size, dtype=runner.dtype,
                                                         device=device))

    def sync_all() -> None:
        torch.cuda.synchronize()
        if world > 1:
            dist.barrier()
            torch.cuda.synchronize()

    sync_all()
    chunk = 10  # back-to-back replays per timed call (median of replays // chunk calls)
    ms = time_ms(lambda: [graph.replay() for _ in range(chunk)], iters=max(1, replays // chunk), warmup=2)
    step_us = torch.tensor([ms * 1e3 / chunk], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(step_us, op=dist.ReduceOp.MAX)
    sync_all()
    from torch.profiler import ProfilerActivity, profile

    prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if rank == 0 else nullcontext()
    with prof_ctx as prof:
        sync_all()  # every rank waits for rank 0's profiler to start
        for _ in range(traced):
            graph.replay()
        torch.cuda.synchronize()
    sync_all()
    if rank == 0:
        trace_file = Path(out_file).with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace_file))
        steps, grouping = step_kernels(json.loads(trace_file.read_text()), traced)
        summary = {"grouping": grouping, **summarize(steps)}
        layers = runner.model_args.num_hidden_layers
        # What a decode step reads of this rank's weights: all but the embedding table (one row).
        # Quantized layers may hold their packed words and scales as buffers (rotary tables count too: small).
        tensors = {id(t): t for n, t in [*runner.model.named_parameters(), *runner.model.named_buffers()]
                   if "embed" not in n}
        read = sum(t.numel() * t.element_size() for t in tensors.values())
        Path(out_file).write_text(json.dumps({"tp": world, "batch": batch, "all_reduce_path": path,
                                              "layers": layers, "seq_len": seq_len, "weight_bytes_read": read,
                                              "graph_step_us": float(step_us.item()), **summary}))
    runner.close()
    if world > 1:
        parallel.destroy_tensor_parallel()


def profile_degree(shape: str, tp: int, custom: bool, model_root: str, out_dir: Path, seq_len: int = 128,
                   replays: int = 200, traced: int = 20, quantize: str = "bf16", batch: int = 1,
                   tiles: str = "card") -> dict:
    """Spawn `tp` ranks, profile rank 0's decode graph of `batch` sequences (1, 2, 4 or 8; weights as the
    `QUANT_VARIANTS` variant `quantize`; decode tiles as `bench/tiles.py`'s variant `tiles`); the summary
    dict (see `summarize`)."""
    import torch.multiprocessing as mp

    model_dir = str(make_dummy_model_dir(shape, dummy_dir(model_root, shape, quantize), quantize=quantize))
    tag = re.sub(r"[^\w.,=-]+", "_", tiles.strip())[:60]
    out_file = out_dir / (f"decode_profile_{shape}_{quantize}_tp{tp}_b{batch}{'' if custom or tp == 1 else '_nccl'}"
                          f"{'' if tag == 'card' else '_' + tag}.json")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(tp, os.path.join(tmp, "init"), model_dir, custom, seq_len, replays, traced,
                              str(out_file), QUANT_VARIANTS[quantize][1], batch, tiles), nprocs=tp, join=True)
    return {"shape": shape, "quantize": quantize, "tiles": tiles.strip(), **json.loads(out_file.read_text())}


def print_profile(result: dict, top: int = 14) -> None:
    layers = result["layers"]
    ar = {"none": "one GPU"}.get(result["all_reduce_path"], f"all-reduce: {result['all_reduce_path']}")
    print(f"\n== decode step profile, {result['shape']} {result.get('quantize', 'bf16')} TP={result['tp']} ({ar}), "
          f"batch {result.get('batch', 1)}, {result['seq_len']} tokens of context, rank 0, {result['steps']} traced "
          f"replays (kernels grouped by {result['grouping']}), tiles: {result.get('tiles', 'card')}")
    print(f"graph alone (untraced, max over ranks): {result['graph_step_us']:.0f} us/step; traced: span "
          f"{result['span_us']:.0f} us = kernels {result['busy_us']:.0f} + gaps {result['gap_us']:.0f} "
          f"({result['kernels_per_step']:.0f} kernels; gap {result['gap_us'] / max(1, result['kernels_per_step']):.2f} "
          f"us each)")
    print(f"{'kind':<20} {'calls/step':>10} {'us/step':>8} {'us/layer':>8} {'of span':>7}")
    for kind, v in result["by_kind"].items():
        print(f"{kind:<20} {v['calls']:>10.1f} {v['us']:>8.0f} {v['us'] / layers:>8.1f} "
              f"{100 * v['us'] / result['span_us']:>6.1f}%")
    print(f"{'gaps between kernels':<20} {'':>10} {result['gap_us']:>8.0f} {result['gap_us'] / layers:>8.1f} "
          f"{100 * result['gap_us'] / result['span_us']:>6.1f}%")
    gemm_us = result["by_kind"].get("gemm", {"us": 0.0})["us"]
    if gemm_us:
        print(f"GEMMs: {result['weight_bytes_read'] / 1e9:.2f} GB of weights on this rank in {gemm_us:.0f} us = "
              f"{result['weight_bytes_read'] / gemm_us / 1e3:.0f} GB/s")
    rest = result["span_us"] - result["by_kind"].get("gemm", {"us": 0.0})["us"]
    print(f"beside the GEMMs (the floor's weight reads): {rest:.0f} us/step = {rest / layers:.1f} us/layer")
    print(f"top kernels: {'calls/step':>10} {'us/step':>8} {'us/call':>8}  kind / name")
    for k in result["by_name"][:top]:
        print(f"{'':<12} {k['calls']:>10.1f} {k['us']:>8.1f} {k['us'] / k['calls']:>8.2f}  {k['kind']}: {k['name'][:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--tp", default="1,4", help="degrees, each in its own processes")
    ap.add_argument("--custom-ar", default="on", help="'on', 'off' (NCCL) or 'on,off' for TP > 1")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, choices=(1, 2, 4, 8), help="sequences decoded together")
    ap.add_argument("--quantize", default="bf16", help=f"comma-separated variants of {sorted(QUANT_VARIANTS)}")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/decode_profile"))
    ap.add_argument("--out", default="", help="also write every summary to this JSON file")
    ap.add_argument("--tiles", default="card",
                    help="';'-separated decode-tile variants (bench/tiles.py), each profiled")
    args = ap.parse_args()
    variants = [v.strip() for v in args.tiles.split(";") if v.strip()]
    for v in variants:
        bench.tiles.parse(v)  # a bad variant fails here, before any model is built
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for tp in [int(t) for t in args.tp.split(",") if t]:
        if tp > torch.cuda.device_count():
            print(f"TP={tp}: only {torch.cuda.device_count()} GPUs, skipped")
            continue
        for quantize in args.quantize.split(","):
            for mode, tiles in itertools.product(args.custom_ar.split(",") if tp > 1 else ["on"], variants):
                results.append(profile_degree(args.shape, tp, mode == "on", args.model_root, out_dir, args.seq_len,
                                              quantize=quantize, batch=args.batch, tiles=tiles))
                print_profile(results[-1])
    if len(variants) > 1:
        print("\n== graph alone per tile variant (us a step)")
        for r in results:
            print(f"{r['quantize']:>5} TP={r['tp']} batch {r['batch']} {r['all_reduce_path']:>8}  "
                  f"{r['graph_step_us']:7.0f}  {r['tiles']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
