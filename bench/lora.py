"""Multi-LoRA cost on a real shape (random bf16 weights): adapters vs the base model, one call.

Builds the shape with `load_format="dummy"`, writes `--num-adapters` random PEFT adapters of rank
`--rank` on all seven projections (q/k/v/o/gate/up/down), then measures, each engine started once:
- the base model (`enable_lora=False`): the reference workload's tokens/s, and batch-1 decode
  ms/token ((t(1+N tokens) - t(1 token)) / N, 128-token prompt, as bench/latency.py);
- LoRA on (`max_loras` = all adapters resident): the same workload with every request on a
  random adapter, and batch-1 decode on one adapter.
Bars (issue 14): workload >= 0.75x the base tokens/s; batch-1 <= 1.15x the base ms/token.
`--variant split,stream` runs the LoRA case once per `serving.executor.lora.LORA_VARIANT`
(one engine each; `--batch1-only` skips the workload) to compare them end to end in one call.

  python bench/lora.py --shape llama-3-8b --num-adapters 16 --rank 16 --out /tmp/lora.json
  python bench/lora.py --variant split,stream --batch1-only
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402

from dummy_model import dummy_dir, make_dummy_model_dir, shape_info  # noqa: E402
from random_adapter import write_random_adapter  # noqa: E402
from bench.workload import reference_workload  # noqa: E402

def timed_generate(llm, prompts: list[list[int]], params, loras=None) -> tuple[float, int]:
    """-> (seconds, output tokens) of one generate call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def batch1_ms(llm, new_tokens: int, lora=None) -> float:
    """Steady batch-1 decode ms/token: (t(1 + N tokens) - t(1 token)) / N, median of 3 each."""
    from serving import SamplingParams

    prompt = [list(range(1000, 1128))]

    def t(n: int) -> float:
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
        return sorted(timed_generate(llm, prompt, sp, lora)[0] for _ in range(3))[1]

    t(8)  # warm-up
    return (t(1 + new_tokens) - t(1)) / new_tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--adapter-root", default="/tmp/open-lmi-bench-adapters")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".bench_models" / "tokenizer"))
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--variant", default="stream",
                    help="comma-separated LORA_VARIANT values, one LoRA engine each: stream (the default), split")
    ap.add_argument("--batch1-only", action="store_true", help="skip the reference workload")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from serving import LLM, SamplingParams
    from serving.executor import lora as lora_exec
    from serving.lora_request import LoRARequest

    tok_dir = args.tokenizer_dir if Path(args.tokenizer_dir).is_dir() else None
    model_dir = make_dummy_model_dir(args.shape, dummy_dir(args.model_root, args.shape, "bf16"), tok_dir)
    t0 = time.perf_counter()
    adapters = [LoRARequest(f"a{k}", k + 1, str(write_random_adapter(
        shape_info(args.shape), Path(args.adapter_root) / f"a{k}", args.rank, k))) for k in range(args.num_adapters)]
    print(f"{len(adapters)} adapters of rank {args.rank} written in {time.perf_counter() - t0:.1f} s", flush=True)
    prompts, out_lens = reference_workload(args.num_seqs)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in out_lens]
    rng = random.Random(1)
    per_request = [rng.choice(adapters) for _ in prompts]
    options = dict(load_format="dummy", dtype="bfloat16", max_num_seqs=256, max_model_len=args.max_model_len,
                   max_num_batched_tokens=16384, gpu_memory_utilization=0.9)
    rows: dict[str, dict] = {}
    variants = args.variant.split(",")
    assert all(v in lora_exec.VARIANTS for v in variants), (variants, lora_exec.VARIANTS)
    cases = ["base"] + ["lora" if variants == ["stream"] else f"lora:{v}" for v in variants]
    for case in cases:
        t0 = time.perf_counter()
        is_lora = case != "base"
        lora_exec.LORA_VARIANT = case.partition(":")[2] or variants[0]  # read when the graphs are captured
        lora_opts = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
                         max_cpu_loras=len(adapters)) if is_lora else {}
        llm = LLM(str(model_dir), **options, **lora_opts)
        row: dict = {"startup_s": time.perf_counter() - t0}
        if is_lora:
            t0 = time.perf_counter()  # register and load every adapter into its slot (one request each)
            timed_generate(llm, [[1, 2, 3, 4, 5]] * len(adapters), SamplingParams(max_tokens=2), adapters)
            row["adapters_load_s"] = time.perf_counter() - t0
        else:
            timed_generate(llm, [[1, 2, 3, 4, 5]], SamplingParams(max_tokens=8))  # warm-up
        dt, produced = (float("nan"), 0) if args.batch1_only else timed_generate(
            llm, prompts, params, per_request if is_lora else None)
        row.update(workload_s=dt, tokens=produced, tok_s=produced / dt)
        row["batch1_ms"] = batch1_ms(llm, args.new_tokens, adapters[0] if is_lora else None)
        rows[case] = row
        print(f"[{case}] {produced} tokens in {dt:.2f} s = {produced / dt:,.0f} tok/s; batch-1 "
              f"{row['batch1_ms']:.2f} ms/token; start {row['startup_s']:.1f} s", flush=True)
        llm.shutdown() if hasattr(llm, "shutdown") else None
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = rows["base"]
    print(f"\n{'case':14} {'tok/s':>9} {'batch-1 ms/token':>17}")
    for case, r in rows.items():
        print(f"{case:14} {r['tok_s']:>9,.0f} {r['batch1_ms']:>17.2f}")
    for case in cases[1:]:
        r = rows[case]
        print(f"{case} / base: workload {r['tok_s'] / base['tok_s']:.3f}x tokens/s (bar >= 0.75), batch-1 "
              f"{r['batch1_ms'] / base['batch1_ms']:.3f}x ms/token (bar <= 1.15)")
    lora = rows[cases[1]]
    ratio_tok, ratio_ms = lora["tok_s"] / base["tok_s"], lora["batch1_ms"] / base["batch1_ms"]
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape,
                                              "num_adapters": len(adapters), "rank": args.rank, "rows": rows,
                                              "variants": variants, "tok_s_ratio": ratio_tok,
                                              "batch1_ratio": ratio_ms}, indent=2))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
