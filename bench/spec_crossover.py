"""Where speculation stops paying as the batch grows: a verify step's cost against a plain decode step's.

For each batch size B, B sequences decode together (random prompts, greedy, random bf16 weights): the
median wall time of a plain decode step, and of a verify step of k+1 rows per sequence (benchmark-only
forced acceptance with a proposer that always drafts k tokens, as `bench/speculative.py`). A verify step
yields 1 + a tokens per sequence where a is the accepted drafts per step, so speculation pays while
a > ratio - 1: the printed break-even. Decode steps grow compute-bound with B, so the ratio climbs and the
break-even passes what prompt lookup accepts (0.7-1.0 tokens per step at k = 2-6 on the embedded model,
bench/RESULTS.md): that batch size is the crossover for `disable_by_batch_size`.

  python3 bench/spec_crossover.py --model-root /tmp/open-lmi-bench-models --batches 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from speculative import K, NGRAM, AnyProposer, _sync, accept_all, build, greedy, random_prompt, release


def step_ms(llm, batch: int, steps: int, prompt_len: int, device: str) -> float:  # noqa: ANN001
    """Median wall ms of `steps` synchronous steps with `batch` sequences all decoding."""
    engine = llm.llm_engine
    engine.async_scheduling = False
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", None, greedy((steps + 4) * (K + 1)),
                           prompt_token_ids=random_prompt(prompt_len, 7000 + i))
    while any(seq.num_computed_tokens < len(seq.prompt_token_ids) for seq in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # the prompts' chunks
    engine.step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.async_scheduling = True
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    args.max_num_seqs = max(batches)
    plain = {}
    off = build(args, None)
    for b in batches:
        plain[b] = step_ms(off, b, args.steps, args.prompt_len, args.device)
    release(off, args.device)
    on = build(args, {**NGRAM, "disable_by_batch_size": max(batches) + 1})
    spec = on.llm_engine.speculator
    spec._proposer = AnyProposer()  # benchmark hooks: always k drafts, every draft accepted
    spec.config = dataclasses.replace(spec.config, acceptance_floor=0.0)
    accept_all(on, True)
    print(f"{args.shape} on {args.device}, k={K}: plain decode step vs verify step (k+1 rows a sequence)")
    print(f"{'batch':>6}{'plain ms':>10}{'verify ms':>11}{'ratio':>8}{'break-even accepted/step':>26}")
    for b in batches:
        verify = step_ms(on, b, args.steps, args.prompt_len, args.device)
        ratio = verify / plain[b]
        print(f"{b:>6}{plain[b]:>10.3f}{verify:>11.3f}{ratio:>8.3f}{ratio - 1:>26.2f}", flush=True)
    release(on, args.device)


if __name__ == "__main__":
    main()
