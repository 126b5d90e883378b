"""Speculative decoding (issue 29) on random weights at batch 1: what a verify step costs, and ms/token.

    python3 bench/speculative.py --model-root /tmp/m --tokenizer-dir .bench_models/tokenizer [--shape llama-3-8b]

Measures, each against speculation off on the same engine options (one process, one GPU; "uni"
executor so the benchmark switch below reaches the runner):

1. step:        median time of an engine step verifying k=4 drafts vs a plain decode step (both synchronous).
2. all:         ms/token with every draft accepted (`ModelRunner.force_acceptance = "all"`, a benchmark
                switch, never a serving option), n-gram proposals from a prompt that repeats a cycle.
3. none:        ms/token with proposals on every step and none accepted (`force_acceptance = "none"`;
                the acceptance floor off, so it never stops proposing).
4. reference:   batch-1 generations of random prompts (~0 acceptance) with the default n-gram config
                (acceptance floor and batch cut-off on) vs off: the cost a user pays when lookup misses.

Bars (issue 29): step <= 1.25x, all <= 0.35x, none <= 1.05x, reference within 5 % of off.
Prints one JSON object per measurement. `--shape tiny --device cpu` checks the logic on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

from dummy_model import SHAPES, dummy_dir, make_dummy_model_dir  # noqa: E402
from serving.llm import LLM  # noqa: E402
from serving.sampling_params import SamplingParams  # noqa: E402

K = 4


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def build(args, spec: dict | None, async_scheduling: bool | None = None) -> LLM:  # noqa: ANN001
    model_dir = make_dummy_model_dir(args.shape, dummy_dir(args.model_root, args.shape), args.tokenizer_dir)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    options = dict(load_format="dummy", dtype=dtype, max_num_seqs=8, max_model_len=min(4096, SHAPES[args.shape]["max_position_embeddings"]),
                   device=args.device,
                   distributed_executor_backend="uni", speculative_config=spec, skip_tokenizer_init=True)
    if args.device == "cpu":
        options["kv_cache_memory_gb"] = 0.2
    if async_scheduling is not None:
        options["async_scheduling"] = async_scheduling
    return LLM(str(model_dir), **options)


def cycle_prompt(length: int, period: int, seed: int = 0) -> list[int]:
    """`length` ids repeating a random cycle of `period`: n-gram lookup always finds a continuation."""
    import random

    rng = random.Random(seed)
    cyc = [rng.randrange(100, 30000) for _ in range(period)]
    return [cyc[i % period] for i in range(length)]


def random_prompt(length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(length)]


def step_times(llm: LLM, prompt: list[int], steps: int, device: str) -> tuple[list[float], list[float], int]:
    """Per-step wall times of one sequence's decode (after its prefill): verify steps, plain steps, tokens."""
    engine = llm.llm_engine
    engine.add_request("s", None, SamplingParams(temperature=0.0, max_tokens=steps * (K + 1), ignore_eos=True),
                       prompt_token_ids=prompt)
    engine.step()  # the prefill
    verify, plain, tokens = [], [], 0
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        drafts = engine.stats().get("spec_decode_num_drafts", 0)
        _sync(device)
        t0 = time.perf_counter()
        deltas = engine.step()
        _sync(device)
        dt = time.perf_counter() - t0
        tokens += sum(len(d.token_ids) for d in deltas)
        (verify if engine.stats().get("spec_decode_num_drafts", 0) > drafts else plain).append(dt)
    engine.abort_request("s")
    while engine.has_unfinished_requests():
        engine.step()
    return verify, plain, tokens


def ms_per_token(llm: LLM, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    """Batch 1: each prompt alone to `max_tokens`; decode ms per generated token (prefill step excluded)."""
    engine = llm.llm_engine
    before = engine.stats()
    total_s, total_tokens = 0.0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           prompt_token_ids=prompt)
        first = []
        while not first:
            first = [d for d in engine.step() if d.token_ids]
        _sync(device)
        t0 = time.perf_counter()
        n = sum(len(d.token_ids) for d in first)
        while engine.has_unfinished_requests():
            n += sum(len(d.token_ids) for d in engine.step())
        _sync(device)
        total_s += time.perf_counter() - t0
        total_tokens += n - sum(len(d.token_ids) for d in first)
    after = engine.stats()
    counts = {name: after.get("spec_decode_num_" + name, 0) - before.get("spec_decode_num_" + name, 0)
              for name in ("drafts", "draft_tokens", "accepted_tokens")}
    return {"ms_per_token": 1000 * total_s / max(total_tokens, 1), "tokens": total_tokens, **counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reference-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    cyc = cycle_prompt(args.prompt_len, 16)
    rand = [random_prompt(args.prompt_len, s) for s in range(args.reference_prompts)]
    out = {"shape": args.shape, "device": args.device, "k": K}

    off = build(args, None, async_scheduling=False)
    _, plain_steps, _ = step_times(off, cyc, args.steps, args.device)
    off_cycle = ms_per_token(off, [cyc], args.max_tokens, args.device)
    del off
    off_async = build(args, None)
    reference_off = ms_per_token(off_async, rand, args.max_tokens, args.device)
    del off_async

    spec = build(args, {**ngram, "acceptance_floor": 0.0}, async_scheduling=False)
    runner = spec.llm_engine.executor.runner
    runner.force_acceptance = "all"  # the benchmark switch (never a serving option)
    verify_steps, _, _ = step_times(spec, cyc, args.steps, args.device)
    all_accepted = ms_per_token(spec, [cyc], args.max_tokens, args.device)
    runner.force_acceptance = "none"
    none_accepted = ms_per_token(spec, [cyc], args.max_tokens, args.device)
    del spec
    default = build(args, ngram)
    reference_on = ms_per_token(default, rand, args.max_tokens, args.device)
    del default

    plain_ms = 1000 * statistics.median(plain_steps)
    verify_ms = 1000 * statistics.median(verify_steps) if verify_steps else float("nan")
    rows = [
        {"what": "step", "plain_decode_ms": plain_ms, "verify_k4_ms": verify_ms, "ratio": verify_ms / plain_ms,
         "bar": 1.25, "verify_steps": len(verify_steps), "plain_steps": len(plain_steps)},
        {"what": "all_accepted", "off": off_cycle, "on": all_accepted,
         "ratio": all_accepted["ms_per_token"] / off_cycle["ms_per_token"], "bar": 0.35},
        {"what": "none_accepted", "off": off_cycle, "on": none_accepted,
         "ratio": none_accepted["ms_per_token"] / off_cycle["ms_per_token"], "bar": 1.05},
        {"what": "reference", "off": reference_off, "on": reference_on,
         "ratio": reference_on["ms_per_token"] / reference_off["ms_per_token"], "bar": 1.05},
    ]
    for row in rows:
        print(json.dumps({**out, **row}), flush=True)


if __name__ == "__main__":
    main()
