"""Host-side profile of the offline engine on the reference workload (where the step time goes).

cProfile around one `generate` of the reference workload (random weights); GPU time shows up
as time inside the one host sync per step (`tolist` in the sampler). Prints the top functions
by own time and by cumulative time.

  python bench/studies/profile_offline.py --shape llama-3.2-1b
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

from dummy_model import add_dummy_model_args, dummy_llm  # noqa: E402
from bench.workload import reference_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_dummy_model_args(ap)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from serving import SamplingParams

    llm = dummy_llm(args.shape, args.model_root, quantize=args.quantize)
    prompts, out_lens = reference_workload(args.num_seqs)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in out_lens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    prof.disable()
    dt = time.perf_counter() - t0
    print(f"{args.shape}: {sum(out_lens)} tokens in {dt:.2f} s under cProfile = {sum(out_lens) / dt:,.0f} tok/s")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
