"""GPU kernel time of engine steps (torch.profiler): where a prefill step and a decode step go.

Runs the reference workload's first prompts through the engine on random weights and profiles
(1) the first step (a full-budget prefill: `--budget` tokens of many prompts), and (2) a
decode step with every prompt running. Prints CUDA time per kernel, top first.

  python bench/studies/profile_kernels.py --shape llama-3.2-1b [--budget 16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

from dummy_model import add_dummy_model_args, dummy_llm  # noqa: E402
from bench.workload import reference_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_dummy_model_args(ap)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from serving import SamplingParams

    llm = dummy_llm(args.shape, args.model_root, args.num_seqs, args.budget, quantize=args.quantize)
    engine = llm.llm_engine
    prompts, _ = reference_workload(args.num_seqs)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", None, params, prompt_token_ids=p)
    for label in ("prefill step", "decode step"):
        if label == "decode step":
            while engine.scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running):
                engine.step()  # finish every prefill
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            engine.step()
            torch.cuda.synchronize()
        print(f"== {args.shape} {label}: {len(engine.scheduler.running)} running")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top,
                                        max_name_column_width=60))
    for rid in list(engine._requests):
        engine.abort_request(rid)


if __name__ == "__main__":
    main()
