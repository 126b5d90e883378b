"""Per-step cost of guided decoding with 64 constrained rows of 256 (CPU), as the engine pays it.

Host (engine) side, per step: advance 64 matchers by their sampled token (`GuidedDecoder.accept`)
and fill their next-token bitmasks (`GuidedDecoder.fill`, [64, 1536] int32 for SmolLM2's 49152
tokens); the plan then carries the bitmasks (pickle cost measured on a 256-row decode plan).
Device (rank 0) side: `apply_token_masks` on [256, V] float32 logits (here on the CPU).

    .venv/bin/python -m bench.studies.guided_step [--rows 64 --batch 256]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import torch

from bench.studies.grammar_libs import INSTANCE, SCHEMA


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    from serving.checkpoint.default_model import default_model_path
    from serving.engine.guided import GuidedDecoder
    from serving.executor.plan import SampledToken, StepPlan
    from serving.executor.sampler import apply_token_masks
    from serving.sampling_params import GuidedDecodingParams
    from serving.engine.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(str(path))
    vocab = json.load(open(path / "config.json"))["vocab_size"]
    g = GuidedDecoder(tok, vocab, [tok.eos_token_id])
    stream = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)
    spec = GuidedDecodingParams(json=SCHEMA)
    t0 = time.perf_counter()
    g.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = list(range(args.rows))
    pos = {}
    for i in ids:  # staggered: rows sit at different points of the document
        g.add(i, spec)
        pos[i] = i % (len(stream) - 1)
        for t in stream[: pos[i]]:
            g.accept(i, t)
    accept_ms, fill_ms, pickle_ms, apply_ms = [], [], [], []
    logits = torch.randn(args.batch, vocab)
    rows = list(range(0, args.batch, args.batch // args.rows))[: args.rows]
    for _ in range(len(stream) - 1):
        t0 = time.perf_counter()
        for i in ids:
            if pos[i] < len(stream) - 1:
                g.accept(i, stream[pos[i]])
                pos[i] += 1
            else:  # restart a finished row, as a new request would
                g.remove(i)
                g.add(i, spec)
                pos[i] = 0
        t1 = time.perf_counter()
        masks = g.fill(ids)
        t2 = time.perf_counter()
        plan = StepPlan(1, list(range(args.batch)), list(range(args.batch)), [1] * args.batch, [True] * args.batch,
                        args.batch, mask_chunks=rows, masks=masks)
        pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
        t3 = time.perf_counter()
        apply_token_masks(logits, rows, masks)
        t4 = time.perf_counter()
        accept_ms.append((t1 - t0) * 1e3)
        fill_ms.append((t2 - t1) * 1e3)
        pickle_ms.append((t3 - t2) * 1e3)
        apply_ms.append((t4 - t3) * 1e3)
    del SampledToken
    med = statistics.median
    print(f"rows={args.rows} of batch={args.batch}, vocab={vocab}, torch threads={torch.get_num_threads()}, "
          f"schema compile {compile_ms:.1f} ms (cached afterwards)")
    print(f"host per step: accept {med(accept_ms):.3f} ms + fill masks {med(fill_ms):.3f} ms "
          f"= {med(accept_ms) + med(fill_ms):.3f} ms (p90 {sorted(a + f for a, f in zip(accept_ms, fill_ms))[int(0.9 * len(fill_ms))]:.3f} ms); "
          f"plan pickle+unpickle with masks {med(pickle_ms):.3f} ms ({masks.nbytes / 1024:.0f} KiB of masks)")
    print(f"sampler apply_token_masks on CPU [{args.batch}, {vocab}]: {med(apply_ms):.3f} ms")


if __name__ == "__main__":
    main()
