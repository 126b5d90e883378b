"""GPU: tokens/s of the reference workload with 25 % of rows under a JSON schema vs none (issue 15).

Random-weight Llama-3.2-1B shape (`tests/support/dummy_model.py`), the reference workload
(`bench/workload.py`: 256 prompts), temperature 0.6, ignore_eos. Run A: every row free. Run B: the
same, with every 4th row constrained to a JSON schema (an object with a string field, which stays
open, so constrained rows keep generating as free ones do; a row that completes its object ends
early, hence tokens/s rather than seconds). Both in one process, after a warm-up, on the same LLM,
alternated twice.

    python3 bench/studies/guided_gpu.py [--shape llama-3.2-1b] [--num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402

from dummy_model import make_dummy_model_dir  # noqa: E402
from bench.workload import reference_workload  # noqa: E402

# An object whose one string field stays open (random weights rarely pick the closing quote among
# ~all tokens): constrained rows run to max_tokens as free ones do. (An integer array closes in a
# few dozen steps there, since "]" is one of ~20 allowed tokens.)
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm, prompts, out_lens, guided_every: int) -> tuple[float, int, int]:
    from serving import SamplingParams
    from serving.sampling_params import GuidedDecodingParams

    params = []
    for i, n in enumerate(out_lens):
        g = GuidedDecodingParams(json=SCHEMA) if guided_every and i % guided_every == 0 else None
        params.append(SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False,
                                     guided_decoding=g))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    return dt, produced, stopped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".bench_models" / "tokenizer"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024, help="max input and output length (CPU smoke: small)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from serving import LLM

    model_dir = make_dummy_model_dir(args.shape, Path(args.model_root) / args.shape, Path(args.tokenizer_dir))
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=256, max_model_len=4096 if torch.cuda.is_available() else 1024,
              max_num_batched_tokens=16384, gpu_memory_utilization=0.9,
              **({} if torch.cuda.is_available() else {"async_scheduling": True}))
    prompts, out_lens = reference_workload(args.num_seqs, args.max_len, args.max_len)
    vocab = 49152  # the borrowed tokenizer's ids
    prompts = [[t % vocab for t in p] for p in prompts]
    w = min(16, len(prompts))
    run(llm, prompts[:w], [32] * w, 4)  # warm-up: graphs, the grammar compile, the kernels
    run(llm, prompts, [64] * len(prompts), 0)
    engine = llm.llm_engine
    results = {}
    for name, every in (("free", 0), ("guided_25pct", 4), ("free_again", 0), ("guided_again", 4),
                        ("guided_blocking", 4)):
        if name == "guided_blocking":  # for comparison: masks filled before the step (it waits for the last)
            engine.executor.supports_deferred_masks = False
        steps0, deferred0 = engine.num_steps, engine.num_deferred_mask_steps
        dt, produced, stopped = run(llm, prompts, out_lens, every)
        results[name] = {"seconds": dt, "tokens": produced, "tokens_per_s": produced / dt, "stopped_early": stopped,
                         "steps": engine.num_steps - steps0,
                         "deferred_mask_steps": engine.num_deferred_mask_steps - deferred0}
        print(name, json.dumps(results[name]), flush=True)
    free = (results["free"]["tokens_per_s"] + results["free_again"]["tokens_per_s"]) / 2
    ratio = (results["guided_25pct"]["tokens_per_s"] + results["guided_again"]["tokens_per_s"]) / 2 / free
    blocking = results["guided_blocking"]["tokens_per_s"] / free
    print(f"guided 25% / free tokens/s = {ratio:.3f}; with blocking masks {blocking:.3f} (async_scheduling={engine.async_scheduling}, "
          f"device={torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'})")
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "ratio": ratio, "blocking_ratio": blocking}, indent=1))


if __name__ == "__main__":
    main()
