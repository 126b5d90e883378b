"""Offline throughput on the reference workload, against the hardware floor and transformers.

One run measures, on the same GPU: the copy-bandwidth and matmul ceilings; our engine
(`serving.LLM`, random bf16 weights via load_format="dummy") on the full reference workload for
each model shape; and, for the ratio, our engine and the transformers continuous-batching peer
(`continuous_batching_context_manager`, attn `paged|sdpa`, random weights from config) on the
same reduced workload (all 256 prompts, output lengths divided by --peer-div: the peer runs at
~1K tok/s, so the full workload would cost minutes of device time). Prints one table.

  python bench/offline.py --shapes llama-3.2-1b,llama-3-8b --peer --out /tmp/offline.json
  python bench/offline.py --shapes llama-3-8b --quantize bf16,gptq,fp8     # quantized vs bf16, same call

`--makespan 0,192` also times the same warm engine (prefix cache emptied before each run) with the scheduler's `makespan_step_tokens` set to each
value (0: FCFS, as before that option existed), after the run with the shipped default; rows `shape@makespan=V`.

`--quantize` runs each variant of tests/support/dummy_model.py QUANT_VARIANTS per shape (int4 g128 GPTQ /
AWQ packed dummy weights, fp8 converted at load) and adds its tokens/s as a ratio to bf16's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs, matmul_tflops  # noqa: E402
from dummy_model import QUANT_VARIANTS, dummy_dir, make_dummy_model_dir, shape_info  # noqa: E402
from bench.workload import reference_workload, workload_floor_s  # noqa: E402


def build_llm(model_dir: Path, args: argparse.Namespace, quantization: str | None = None):
    from serving import LLM

    # the workload's prompts are token ids and nothing is detokenized: no tokenizer files needed
    has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))

    return LLM(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        quantization=quantization,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        skip_tokenizer_init=not has_tokenizer,
    )


def run_ours(llm, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
    """-> (seconds of one generate call, output tokens produced)."""
    from serving import SamplingParams

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in out_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return dt, produced


def run_peer(shape: str, prompts: list[list[int]], out_lens: list[int], timeout_s: float) -> dict:
    """transformers continuous batching on random weights; -> tok/s and what was measured."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in shape_info(shape).items() if k not in ("architectures", "torch_dtype")})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    model.eval()
    gen = GenerationConfig(do_sample=True, temperature=0.6, max_new_tokens=max(out_lens), eos_token_id=-1,
                           pad_token_id=0)
    produced = 0
    finished = 0
    timed_out = False
    with model.continuous_batching_context_manager(generation_config=gen) as manager:
        # one warm-up request, as for ours
        rid = manager.add_request(input_ids=[1, 2, 3, 4], max_new_tokens=4)
        while True:
            r = manager.get_result(timeout=30)
            if r is None or (r.request_id == rid and r.is_finished()):
                break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids, n in zip(prompts, out_lens):
            manager.add_request(input_ids=ids, max_new_tokens=n)
        while finished < len(prompts):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                finished += 1
                produced += len(r.generated_tokens)
            if time.perf_counter() - t0 > timeout_s:
                timed_out = True
                break
        dt = time.perf_counter() - t0
    del model, manager
    gc.collect()
    torch.cuda.empty_cache()
    return {"peer_tok_s": produced / dt, "peer_s": dt, "peer_tokens": produced, "peer_finished": finished,
            "peer_timed_out": timed_out, "transformers": transformers.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".bench_models" / "tokenizer"))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--peer", action="store_true", help="also run the transformers peer")
    ap.add_argument("--peer-div", type=int, default=8, help="divide output lengths by this for the peer ratio")
    ap.add_argument("--peer-timeout", type=float, default=150.0)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--quantize", default="bf16", help=f"comma-separated variants of {sorted(QUANT_VARIANTS)}")
    ap.add_argument("--makespan", default="", help="comma-separated makespan_step_tokens to A/B on the same engine")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    bw = copy_bandwidth_gbs()
    tf = matmul_tflops()
    print(f"ceilings: copy {bw:,.0f} GB/s, bf16 matmul {tf:,.0f} TFLOP/s", flush=True)
    prompts, out_lens = reference_workload(args.num_seqs)
    small_lens = [max(1, n // args.peer_div) for n in out_lens]
    results: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": bw, "matmul_tflops": tf,
                     "torch": torch.__version__, "shapes": {}}
    tok_dir = args.tokenizer_dir if Path(args.tokenizer_dir).is_dir() else None
    for shape, variant in [(s, q) for s in args.shapes.split(",") for q in args.quantize.split(",")]:
        key = shape if variant == "bf16" else f"{shape}/{variant}"
        model_dir = make_dummy_model_dir(shape, dummy_dir(args.model_root, shape, variant), tok_dir, variant)
        floor = workload_floor_s(shape, [len(p) for p in prompts], out_lens, tf * 1e12, bw * 1e9)
        row: dict = {"floor_s": floor["floor_s"], "floor_flops_s": floor["flops_s"], "floor_bytes_s": floor["bytes_s"]}
        t0 = time.perf_counter()
        llm = build_llm(model_dir, args, QUANT_VARIANTS[variant][1])
        row["startup_s"] = time.perf_counter() - t0
        run_ours(llm, [[1, 2, 3, 4, 5]], [8])  # warm-up request
        dt, produced = run_ours(llm, prompts, out_lens)
        row.update(ours_s=dt, ours_tokens=produced, ours_tok_s=produced / dt, frac_floor=floor["floor_s"] / dt)
        if variant != "bf16" and shape in results["shapes"]:
            row["vs_bf16"] = row["ours_tok_s"] / results["shapes"][shape]["ours_tok_s"]
        print(f"[{key}] ours: {produced} tokens in {dt:.2f} s = {produced / dt:,.0f} tok/s, "
              f"{floor['floor_s'] / dt:.1%} of the (bf16) workload floor ({floor['floor_s']:.2f} s)"
              + (f"; {row['vs_bf16']:.2f}x bf16 tok/s" if "vs_bf16" in row else ""), flush=True)
        for value in filter(None, args.makespan.split(",")):
            scheduler = llm.llm_engine.scheduler
            default, scheduler.makespan_target = scheduler.makespan_target, int(value)
            assert llm.reset_prefix_cache()  # the workload repeats its prompts: every run computes them
            dt_v, produced_v = run_ours(llm, prompts, out_lens)
            scheduler.makespan_target = default
            results["shapes"][f"{key}@makespan={value}"] = dict(
                floor_s=floor["floor_s"], ours_s=dt_v, ours_tokens=produced_v, ours_tok_s=produced_v / dt_v,
                frac_floor=floor["floor_s"] / dt_v)
            print(f"[{key}] makespan_step_tokens={value} (shipped {default}): {produced_v / dt_v:,.0f} tok/s, "
                  f"{floor['floor_s'] / dt_v:.1%} of floor", flush=True)
        if args.peer and variant == "bf16":  # the peer runs the unquantized model
            dt_s, produced_s = run_ours(llm, prompts, small_lens)
            row.update(ours_small_tok_s=produced_s / dt_s, ours_small_s=dt_s)
        llm_shutdown = getattr(llm, "shutdown", None)
        if callable(llm_shutdown):
            llm_shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        if args.peer and variant == "bf16":  # the peer runs the unquantized model
            try:
                row.update(run_peer(shape, prompts, small_lens, args.peer_timeout))
                row["ratio_vs_peer"] = row["ours_small_tok_s"] / row["peer_tok_s"]
                print(f"[{shape}] peer: {row['peer_tok_s']:,.0f} tok/s on outputs/{args.peer_div}; "
                      f"ours {row['ours_small_tok_s']:,.0f} tok/s -> {row['ratio_vs_peer']:.1f}x", flush=True)
            except Exception as exc:  # the peer is a guest: report, don't die
                row["peer_error"] = f"{type(exc).__name__}: {exc}"
                print(f"[{shape}] peer failed: {row['peer_error']}", flush=True)
        results["shapes"][key] = row

    print(f"\n{'shape':20} {'ours tok/s':>11} {'floor tok/s':>12} {'of floor':>9} {'peer tok/s':>11} {'ratio':>7} "
          f"{'vs bf16':>8}")
    for shape, r in results["shapes"].items():
        floor_tok_s = sum(out_lens) / r["floor_s"]
        peer = f"{r['peer_tok_s']:,.0f}" if "peer_tok_s" in r else "-"
        ratio = f"{r['ratio_vs_peer']:.1f}x" if "ratio_vs_peer" in r else "-"
        vs = f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-"
        print(f"{shape:20} {r['ours_tok_s']:>11,.0f} {floor_tok_s:>12,.0f} {r['frac_floor']:>9.1%} {peer:>11} {ratio:>7} "
              f"{vs:>8}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
