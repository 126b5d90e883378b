"""Where the warm reference workload's wall time goes on the GPU: busy vs idle, kernels by total.

Runs the reference workload once to warm up, once unprofiled (the tokens/s that counts), and once
under torch.profiler (CUDA activity only, so the host pays little extra). From the profiled run's
kernel intervals on the device it reports: wall time, GPU busy time (the union of kernel
intervals), idle time split by gap length, and the kernels ranked by total time, grouped into
families (GEMM, attention, sampling, ...). If busy ≈ wall the run is GPU-bound and the kernel
table says what to make faster; large idle time means the host is the limit.

  python bench/studies/profile_workload.py --shape llama-3.2-1b [--out /tmp/prof.json]
  python bench/studies/profile_workload.py --shape llama-3-8b --makespan 0,256    # the scheduler's makespan_step_tokens A/B

With `--makespan`, the same engine runs the unprofiled and profiled runs once per value (the scheduler's
`makespan_step_tokens`; 0: FCFS), and the report also counts the steps each value took.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

from dummy_model import add_dummy_model_args, dummy_llm  # noqa: E402
from bench.workload import reference_workload  # noqa: E402

FAMILIES = (  # (family, substrings of the kernel name), first match wins
    ("decode attention", ("paged_decode",)),
    ("mixed attention", ("mixed_attention",)),
    ("prefill attention", ("prefill_attention",)),
    ("sampling", ("sample", "gumbel", "softmax", "argmax", "exponential", "topk", "sort")),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "cublas", "matmul", "ampere", "xmma", "splitk")),
    ("norm", ("rms_norm",)),
    ("activation", ("silu", "act_and_mul")),
    ("rotary", ("rotary",)),
    ("kv write", ("cache", "reshape_and")),
    ("lora", ("lora",)),
    ("copies", ("copy", "memcpy", "memset", "fill", "cat", "index", "gather", "scatter")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, dict[str, float], float, float]:
    """-> (busy µs = union of intervals, idle µs by gap length, first start, last end)."""
    intervals.sort()
    busy = 0.0
    gaps = {"<10us": 0.0, "10-100us": 0.0, "100us-1ms": 0.0, ">1ms": 0.0}
    cur_s, cur_e = intervals[0]
    first = cur_s
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gap = s - cur_e
            key = "<10us" if gap < 10 else "10-100us" if gap < 100 else "100us-1ms" if gap < 1000 else ">1ms"
            gaps[key] += gap
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy, gaps, first, cur_e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_dummy_model_args(ap)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--gaps", type=int, default=12, help="list this many of the longest idle gaps")
    ap.add_argument("--makespan", default="", help="comma-separated makespan_step_tokens values to profile")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from serving import SamplingParams

    llm = dummy_llm(args.shape, args.model_root, quantize=args.quantize)
    prompts, out_lens = reference_workload(args.num_seqs)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in out_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run() -> float:
        llm.reset_prefix_cache()  # the workload repeats its prompts: every run computes them
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run()  # warm-up (compiles, caches)
    engine = llm.llm_engine
    reports = []
    for value in args.makespan.split(",") if args.makespan else [None]:
        if value is not None:
            engine.scheduler.makespan_target = int(value)
        steps0 = engine.num_steps
        plain_s = run()
        steps = engine.num_steps - steps0
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            prof_s = run()
        label = f"{args.shape}" + (f", makespan_step_tokens={value}" if value is not None else "")
        reports.append(report(label, prof, plain_s, prof_s, steps, sum(out_lens), args))
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name(),
                                              "runs": reports}, indent=2))
    llm.shutdown()


def report(label: str, prof, plain_s: float, prof_s: float, steps: int, tokens: int, args) -> dict:
    """Print one profiled run's busy time, idle gaps, families and top kernels; return them."""
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    busy, gaps, first, last = busy_and_gaps([(e.time_range.start, e.time_range.end) for e in kernels])
    span = last - first
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_family: dict[str, float] = defaultdict(float)
    for e in kernels:
        d = e.time_range.end - e.time_range.start
        by_name[e.name][0] += d
        by_name[e.name][1] += 1
        by_family[family(e.name)] += d
    print(f"\n== {label}: {tokens} output tokens in {steps} steps; unprofiled {plain_s:.2f} s "
          f"({tokens / plain_s:,.0f} tok/s), profiled {prof_s:.2f} s")
    print(f"device span {span / 1e6:.2f} s: busy {busy / 1e6:.2f} s ({busy / span:.1%}), idle "
          + ", ".join(f"{k} {v / 1e6:.2f} s" for k, v in gaps.items()) + f"; {len(kernels):,} kernels")
    print(f"{'family':20} {'s':>7} {'of busy':>8}")
    for fam, t in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"{fam:20} {t / 1e6:7.3f} {t / busy:8.1%}")
    print(f"\nlongest idle gaps (ms into the run, gap us, kernel before -> kernel after):")
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    end_so_far, gap_list = ordered[0].time_range.end, []
    for prev_i, e in enumerate(ordered[1:]):
        if e.time_range.start > end_so_far:
            gap_list.append((e.time_range.start - end_so_far, end_so_far - first, ordered[prev_i].name, e.name))
        end_so_far = max(end_so_far, e.time_range.end)
    for gap, at, before, after in sorted(gap_list, reverse=True)[: args.gaps]:
        print(f"  {at / 1e3:9.1f} {gap:8.0f}  {before[:40]} -> {after[:40]}")
    print(f"\n{'kernel':70} {'s':>7} {'calls':>7} {'us/call':>8}")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]
    for name, (t, n) in top:
        print(f"{name[:70]:70} {t / 1e6:7.3f} {n:7d} {t / n:8.1f}")
    return {"label": label, "plain_s": plain_s, "profiled_s": prof_s, "steps": steps, "span_s": span / 1e6,
            "busy_s": busy / 1e6, "idle_s": {k: v / 1e6 for k, v in gaps.items()},
            "families_s": {k: v / 1e6 for k, v in by_family.items()},
            "top": [{"name": n, "s": t / 1e6, "calls": c} for n, (t, c) in top]}


if __name__ == "__main__":
    main()
