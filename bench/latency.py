"""Batch-1 decode latency (ms per output token) against the bandwidth floor, per model shape.

Floor = weight bytes / measured copy bandwidth (8B bf16: ~16 GB / ~4.3 TB/s = ~3.8 ms). Our
figure is the steady decode cost: (time of a 1+N-token request - time of a 1-token request) / N,
through the offline API with random weights, so it includes every per-step engine overhead.

  python bench/latency.py --shapes llama-3.2-1b,llama-3-8b
  python bench/latency.py --shapes llama-3-8b --quantize bf16,gptq    # int4 g128 vs bf16, same call
  python bench/latency.py --shapes llama-3-8b --quantize bf16,gptq --batch 1,4,8    # also 4 and 8 at once

`--batch N`: N requests of the same length run together, so each decode step has N rows; the figure
is then ms per step (each request gets one token a step).

With several `--quantize` variants (tests/support/dummy_model.py QUANT_VARIANTS) each row also gives its
ms/token as a fraction of the same shape's bf16 row, and its floor counts the variant's bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs  # noqa: E402
from dummy_model import QUANT_VARIANTS, dummy_dir, make_dummy_model_dir, weight_bytes  # noqa: E402


def _time_request(llm, prompt: list[int], max_tokens: int, reps: int = 3, batch: int = 1) -> float:
    # `batch` requests of the same length at once: every decode step then runs `batch` rows
    from serving import SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
    prompts = [{"prompt_token_ids": [(t + 7 * i) % 30000 for t in prompt]} for i in range(batch)]
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate(prompts, [sp] * batch, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in out)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".bench_models" / "tokenizer"))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantize", default="bf16", help=f"comma-separated variants of {sorted(QUANT_VARIANTS)}")
    ap.add_argument("--batch", default="1", help="comma-separated numbers of requests decoded together")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    from serving import LLM

    bw = copy_bandwidth_gbs()
    print(f"ceiling: copy {bw:,.0f} GB/s", flush=True)
    prompt = list(range(1000, 1000 + args.prompt_len))
    tok_dir = args.tokenizer_dir if Path(args.tokenizer_dir).is_dir() else None
    rows = {}
    for shape, variant in [(s, q) for s in args.shapes.split(",") for q in args.quantize.split(",")]:
        model_dir = make_dummy_model_dir(shape, dummy_dir(args.model_root, shape, variant), tok_dir, variant)
        llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=max(8, *batches),
                  max_model_len=2048,
                  gpu_memory_utilization=0.5, enforce_eager=args.enforce_eager,
                  quantization=QUANT_VARIANTS[variant][1], skip_tokenizer_init=tok_dir is None)
        for batch in batches:
            _time_request(llm, prompt, 8, reps=1, batch=batch)  # warm-up
            t1 = _time_request(llm, prompt, 1, batch=batch)
            tn = _time_request(llm, prompt, 1 + args.new_tokens, batch=batch)
            ms = (tn - t1) / args.new_tokens * 1e3
            floor_ms = weight_bytes(shape, quantize=variant) / (bw * 1e9) * 1e3
            base = shape if batch == 1 else f"{shape} x{batch}"
            key = base if variant == "bf16" else f"{base}/{variant}"
            rows[key] = {"ms_per_token": ms, "floor_ms": floor_ms, "frac_floor": floor_ms / ms, "ttft_ms": t1 * 1e3,
                         "batch": batch}
            if variant != "bf16" and base in rows:
                rows[key]["vs_bf16"] = ms / rows[base]["ms_per_token"]
            print(f"[{key}] {ms:.2f} ms/step, floor {floor_ms:.2f} ms -> {floor_ms / ms:.1%}; "
                  f"1-token request {t1 * 1e3:.1f} ms"
                  + (f"; {rows[key]['vs_bf16']:.2f}x the bf16 ms/step" if "vs_bf16" in rows[key] else ""), flush=True)
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'shape':20} {'ms/step':>9} {'floor ms':>9} {'of floor':>9} {'prefill+1 ms':>13} {'vs bf16':>8}")
    for shape, r in rows.items():
        vs = f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-"
        print(f"{shape:20} {r['ms_per_token']:>9.2f} {r['floor_ms']:>9.2f} {r['frac_floor']:>9.1%} "
              f"{r['ttft_ms']:>13.1f} {vs:>8}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": bw, "shapes": rows},
                                             indent=2))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
