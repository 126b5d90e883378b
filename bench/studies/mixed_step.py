"""How long a step takes when a prompt chunk joins running decodes (what a stream's inter-token gap is then).

Random weights of `--shape`. `--decodes` sequences decode; then, for each chunk size N, a fresh
prompt of N tokens (random ids: no prefix-cache hit) is added and the step that computes it is
timed, against the pure decode steps around it. Synchronous scheduling, so each `step()` is one
whole step (host + GPU). Prints the median of `--repeats` per N.

  python bench/studies/mixed_step.py --shape llama-3-8b --decodes 16 --sizes 0,128,256,512,1024,2048
  python bench/studies/mixed_step.py --decodes 16 --sizes 0 --profile 256   # + torch.profiler of one such step
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

from dummy_model import dummy_dir, make_dummy_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--sizes", default="0,128,256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="profile one step with this many prompt tokens")
    args = ap.parse_args()
    import torch

    from serving import LLM, SamplingParams

    model_dir = make_dummy_model_dir(args.shape, dummy_dir(args.model_root, args.shape))
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=256, max_model_len=4096,
              max_num_batched_tokens=2048, skip_tokenizer_init=True, async_scheduling=False)
    engine = llm.llm_engine
    rng = random.Random(0)
    long = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.6, detokenize=False)
    for i in range(args.decodes):
        engine.add_request(f"d{i}", None, long, prompt_token_ids=[rng.randint(0, 10000) for _ in range(200)])
    while any(s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()

    from serving.executor.model_runner import ModelRunner

    launches: list[float] = []  # host ms of each ModelRunner.execute (inputs + launches, no wait)
    execute = ModelRunner.execute

    def timed_execute(self, plan):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        try:
            return execute(self, plan)
        finally:
            launches.append((time.perf_counter() - t) * 1e3)

    ModelRunner.execute = timed_execute  # type: ignore[method-assign]

    def timed_step() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        times, host = [], []
        for r in range(args.repeats):
            timed_step()  # a pure decode step between samples
            if n:
                engine.add_request(f"p{n}-{r}", None, SamplingParams(max_tokens=1, detokenize=False),
                                   prompt_token_ids=[rng.randint(0, 10000) for _ in range(n)])
            launches.clear()
            times.append(timed_step())
            host.append(sum(launches))
        rows.append((n, statistics.median(times), min(times), max(times)))
        print(f"{args.decodes} decodes + {n:5d} prompt tokens: median {rows[-1][1]:6.2f} ms "
              f"(min {rows[-1][2]:.2f}, max {rows[-1][3]:.2f}); host launch median {statistics.median(host):.2f} ms",
              flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        timed_step()
        engine.add_request("prof", None, SamplingParams(max_tokens=1, detokenize=False),
                           prompt_token_ids=[rng.randint(0, 10000) for _ in range(args.profile)])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = timed_step()
        print(f"profiled step ({args.decodes} decodes + {args.profile} prompt tokens): {ms:.2f} ms")
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=55))
        print(table.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=55))
    base = rows[0][1] if rows[0][0] == 0 else None
    if base:
        print("ratio to a pure decode step: " + ", ".join(f"{n}: {m / base:.2f}x" for n, m, _, _ in rows))
    llm.shutdown()


if __name__ == "__main__":
    main()
