"""What a batch-1 decode step spends outside its CUDA graph (GPU): the kernels between two graph
replays and the time the GPU sits idle there.

`bench/decode_profile.py` times the decode graph alone; a token costs ~0.2-0.26 ms more than the
graph (bench/RESULTS.md runs 35, 41). This runs the offline engine on random weights (one prompt,
batch-1 decode) under torch.profiler, maps every GPU activity to the host call that launched it
(`cudaGraphLaunch` or a plain launch / copy), splits the timeline at each graph replay and prints,
per step: the period between replays, the graph's span, the other GPU work by name (mean us a
step) and the idle time.

  python bench/studies/decode_timeline.py [--shape llama-3-8b] [--quantize bf16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(trace: Path) -> tuple[list[dict], dict[int, str], dict[int, float]]:
    """(GPU activities sorted by start, correlation id -> the host API call that launched it, and when
    the host made that call)."""
    events = json.loads(trace.read_text())["traceEvents"]
    launcher, call_ts = {}, {}
    gpu = []
    for e in events:
        if e.get("ph") != "X":
            continue
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None:
            launcher[corr] = e["name"]
            call_ts[corr] = e["ts"]
        elif e.get("cat") in GPU_CATS:
            gpu.append(e)
    gpu.sort(key=lambda e: e["ts"])
    return gpu, launcher, call_ts


def split_steps(gpu: list[dict], launcher: dict[int, str], call_ts: dict[int, float]) -> list[dict]:
    """One record per graph replay: its span, and the non-graph work and idle time until the next replay."""
    replays: list[list[dict]] = []
    for e in gpu:
        corr = e["args"].get("correlation")
        if launcher.get(corr) == "cudaGraphLaunch":
            if replays and replays[-1][0]["args"]["correlation"] == corr:
                replays[-1].append(e)
            else:
                replays.append([e])
    steps = []
    for cur, nxt in zip(replays, replays[1:]):
        start, end = cur[0]["ts"], max(e["ts"] + e["dur"] for e in cur)
        stop = nxt[0]["ts"]
        others = [e for e in gpu if end <= e["ts"] < stop and launcher.get(e["args"].get("correlation"))
                  != "cudaGraphLaunch"]
        busy, edge = 0.0, end
        for e in others:  # union of busy intervals after the graph
            s, f = max(e["ts"], edge), e["ts"] + e["dur"]
            if f > s:
                busy += f - s
                edge = f
        corr = cur[0]["args"]["correlation"]
        steps.append({"period": stop - start, "graph": end - start, "graph_kernels": len(cur),
                      "lead": start - call_ts.get(corr, start),
                      "after_busy": busy, "after_idle": stop - end - busy,
                      "others": [(e["name"][:70], e["dur"], launcher.get(e["args"].get("correlation"), "?"))
                                 for e in others]})
    return steps


def main() -> None:
    import torch

    from dummy_model import dummy_llm
    from serving import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--quantize", default="bf16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--skip", type=int, default=4, help="first replays left out (prefill, warm-up)")
    args = ap.parse_args()
    llm = dummy_llm(args.shape, args.model_root, max_num_seqs=8, quantize=args.quantize)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.tokens, detokenize=False)
    llm.generate([prompt], [sp], use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], [sp], use_tqdm=False)
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    gpu, launcher, call_ts = load_events(trace)
    steps = split_steps(gpu, launcher, call_ts)[args.skip:-2]
    if not steps:
        from collections import Counter
        raise SystemExit(f"no decode graph replays found in the trace; host calls: {Counter(launcher.values())}")
    n = len(steps)
    mean = {k: sum(s[k] for s in steps) / n for k in ("period", "graph", "after_busy", "after_idle", "graph_kernels", "lead")}
    print(f"# {torch.cuda.get_device_name()}  {args.shape} {args.quantize}: {n} decode steps")
    print(f"period {mean['period']:.1f} us | graph span {mean['graph']:.1f} ({mean['graph_kernels']:.0f} kernels) | "
          f"after the graph: busy {mean['after_busy']:.1f}, idle {mean['after_idle']:.1f} us | "
          f"graph start - host launch call {mean['lead']:.1f} us")
    per_name: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in steps:
        for name, dur, via in s["others"]:
            per_name[(name, via)].append(dur)
    print("| GPU work after the graph | launched by | per step | us each | us a step |")
    print("|---|---|---|---|---|")
    for (name, via), durs in sorted(per_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {via} | {len(durs) / n:.2f} | {sum(durs) / len(durs):.1f} | {sum(durs) / n:.1f} |")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
