"""Across GPUs: executor overhead, tensor parallelism and model replicas, on random weights.

Parts (each prints a table row; `--parts` picks them):
- `overhead` (1 GPU): the same engine with the in-process executor and with the worker-process
  executor (what TP and replicas use): batch-1 decode ms/token and the reference workload's
  tokens/s; plus the plan's pickled size and pickle+unpickle time per decode step at 256 rows.
- `agree` (2 GPUs; 4 with `--tp-agree 2,4`): greedy tokens of a reduced-layer Llama-3-8B shape in
  fp32, TP=2 (and 4) vs TP=1, from one random checkpoint written to disk (so all read the same weights).
- `tp8b` (2 GPUs; 4 with `--tp8b 1,2,4`): Llama-3-8B shape, bf16: batch-1 decode and reference
  workload, TP=1 and TP=2.
- `tp70b` (2 GPUs; `--tp70b 4` on 4): Llama-3-70B shape, TP=2: loads, batch-1 decode vs the TP-GPU
  floor (weights / (TP x copy bandwidth)), reference workload vs its floor.
  `--custom-ar on,off` runs every TP > 1 engine of these three with the custom all-reduce
  (symmetric memory) and again with NCCL only (`disable_custom_all_reduce`); `unfused` with the
  custom all-reduce but not fused with the residual add + RMSNorm (OPEN_LMI_FUSED_NORM_MAX_KB=0); `--no-workload`
  leaves the reference workload out (decode only: bench/allreduce.py's decode part).
- `replicas` (2 GPUs): two copies (degree 1) of the 8B shape behind a ReplicaSet vs one copy,
  saturating request rate: output tokens/s, TTFT / TPOT percentiles.

  python bench/parallel.py --parts overhead            # one GPU
  python bench/parallel.py --parts agree,tp8b,tp70b,replicas   # two GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

import torch  # noqa: E402

from bench.ceilings import copy_bandwidth_gbs, matmul_tflops  # noqa: E402
from dummy_model import SHAPES, make_dummy_model_dir, weight_bytes  # noqa: E402
from bench.workload import reference_workload, workload_floor_s  # noqa: E402

SHAPES.setdefault("llama-3-70b", dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_scaling=None,
    max_position_embeddings=8192,
))


def engine(model_dir: Path, tp: int = 1, multiprocess: bool = False, devices=None, **options):  # noqa: ANN001, ANN201
    from serving.engine.llm_engine import LLMEngine
    from serving.engine_config import EngineConfig
    from serving.llm import LLM

    opts = dict(load_format="dummy", dtype="bfloat16", max_num_seqs=256, max_model_len=4096,
                max_num_batched_tokens=16384, gpu_memory_utilization=0.85, skip_tokenizer_init=True)
    env = options.pop("env", {})  # read by the rank processes as they start
    opts.update(options)
    config = EngineConfig.from_options(str(model_dir), tensor_parallel_size=tp, **opts)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM.from_engine(LLMEngine(config, devices=devices, multiprocess=multiprocess))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def decode_ms(llm, new_tokens: int = 128) -> float:  # noqa: ANN001
    """Steady batch-1 decode: (t(1+N tokens) - t(1 token)) / N, medians of 3."""
    from serving import SamplingParams

    prompt = [{"prompt_token_ids": list(range(1000, 1128))}]

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            llm.generate(prompt, [sp], use_tqdm=False)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[1]

    run(8)
    return (run(1 + new_tokens) - run(1)) / new_tokens * 1e3


def workload_tps(llm, shape: str) -> tuple[float, float]:  # noqa: ANN001
    """(output tokens/s, seconds) on the reference workload (256 requests, seed 0), second run."""
    from serving import SamplingParams

    prompts, out_lens = reference_workload()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in out_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):  # first run warms; the second is reported
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, dt


def plan_cost() -> dict:
    """Pickled bytes and pickle+unpickle microseconds of a 256-row decode plan."""
    from serving.executor.plan import StepPlan

    plan = StepPlan(1, list(range(256)), [900 + i for i in range(256)], [1] * 256, [True] * 256, 256,
                    {7: [123]}, {i: (899 + i, [5, -1]) for i in range(256)}, [], [3, 4], [])
    data = pickle.dumps(("step", plan), protocol=pickle.HIGHEST_PROTOCOL)
    t0 = time.perf_counter()
    for _ in range(200):
        pickle.loads(pickle.dumps(("step", plan), protocol=pickle.HIGHEST_PROTOCOL))
    return {"bytes": len(data), "us": (time.perf_counter() - t0) / 200 * 1e6}


def part_overhead(args) -> dict:  # noqa: ANN001
    shape = args.shape
    model_dir = make_dummy_model_dir(shape, Path(args.model_root) / shape)
    out = {"plan_256_decodes": plan_cost()}
    for mp in (True, False):  # the worker process first: its memory is all given back when it exits
        llm = engine(model_dir, multiprocess=mp)
        t_first = time.perf_counter()
        ms = decode_ms(llm)
        tps, dt = workload_tps(llm, shape)
        out["multiprocess" if mp else "in_process"] = {"decode_ms": ms, "workload_tok_s": tps, "workload_s": dt,
                                                       "wall_s": time.perf_counter() - t_first}
        llm.llm_engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    return out


def write_random_checkpoint(out_dir: Path, layers: int, seed: int = 0) -> Path:
    """A reduced-layer Llama-3-8B-shaped checkpoint with random fp32 weights (safetensors shards)."""
    from safetensors.torch import save_file

    from serving.executor.models import build_model
    from serving.checkpoint.model_args import ModelArgs

    cfg = {**json.loads((make_dummy_model_dir("llama-3-8b", out_dir)).joinpath("config.json").read_text()),
           "num_hidden_layers": layers, "torch_dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(cfg))
    model = build_model(ModelArgs.from_dict(cfg), torch.float32, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        p.data.normal_(0.0, 0.02, generator=gen) if "norm" not in name else p.data.fill_(1.0)
        tensors[name] = p.detach().cpu().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    del model
    torch.cuda.empty_cache()
    return out_dir


def _degrees(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _engine_modes(tp: int, custom_modes: tuple[str, ...], prefetch: tuple[str, ...] = ("on",)
                  ) -> list[tuple[str, dict]]:
    """(result-key suffix, engine options) per all-reduce mode an engine of degree `tp` runs in, each
    with the L2 weight hints (models/weight_prefetch.py) on (16 MiB or $BENCH_PREFETCH_MB at every
    degree; the engine's default when unset: 4 MiB at TP=2, 16 at TP >= 4; no suffix) and/or off (suffix
    `_nopf`)."""
    if tp == 1:
        base = [("", {})]
    else:
        modes = {"on": ("_custom", {"disable_custom_all_reduce": False}),
                 "off": ("_nccl", {"disable_custom_all_reduce": True}),
                 # the custom all-reduce without the fused all-reduce + add + RMSNorm (its switch: an env var)
                 "unfused": ("_unfused", {"disable_custom_all_reduce": False,
                                          "env": {"OPEN_LMI_FUSED_NORM_MAX_KB": "0"}}),
                 # fused, but the row-parallel GEMVs write their rows and the fused kernel pushes them
                 "nopush": ("_nopush", {"disable_custom_all_reduce": False,
                                        "env": {"OPEN_LMI_PUSH_PARTIALS": "0"}})}
        base = [modes[m] for m in custom_modes]
    out = []
    for pf in prefetch:
        for suffix, opts in base:
            mb = "0" if pf == "off" else os.environ.get("BENCH_PREFETCH_MB", "16")  # on: 16 MiB unless set
            suffix = suffix + ("_nopf" if pf == "off" else "")
            opts = {**opts, "env": {**opts.get("env", {}), "OPEN_LMI_L2_PREFETCH_MB": mb}}
            out.append((suffix, opts))
    return out


def part_agree(args) -> dict:  # noqa: ANN001
    from serving import SamplingParams

    path = write_random_checkpoint(Path(args.model_root) / "llama-3-8b-4l-fp32", layers=4)
    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1064 + 7 * i))} for i in range(8)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32, detokenize=False)
    tps = [tp for tp in _degrees(args.tp_agree) if 1 < tp <= torch.cuda.device_count()]
    out = {}
    # 4,096: every prompt in one step; 48: prompt chunks share steps with the first ones' decodes
    # (mixed-step graphs, with their all-reduces, under TP > 1).
    for budget in _degrees(args.agree_budgets):
        toks = {}
        for tp in (1, *tps):
            for suffix, opts in _engine_modes(tp, args.custom_ar, args.prefetch):
                llm = engine(path, tp=tp, load_format="auto", dtype="float32", max_num_seqs=16,
                             max_num_batched_tokens=budget, gpu_memory_utilization=0.5, **opts)
                toks[f"tp{tp}{suffix}"] = [list(o.outputs[0].token_ids)
                                           for o in llm.generate(prompts, [sp] * len(prompts), use_tqdm=False)]
                llm.llm_engine.shutdown()
                del llm
        for key, seqs in toks.items():
            ref = "tp1" + ("_nopf" if key.endswith("_nopf") else "")  # TP=1 with the same prefetch setting
            if key != ref:
                same = sum(a == b for a, b in zip(toks[ref], seqs))
                out[f"{key}_identical_sequences_budget_{budget}"] = f"{same}/{len(prompts)}"
    return out


def part_tp(args, shape: str, tps: tuple[int, ...]) -> dict:  # noqa: ANN001
    model_dir = make_dummy_model_dir(shape, Path(args.model_root) / shape)
    bw, tflops = copy_bandwidth_gbs(), matmul_tflops()
    torch.cuda.empty_cache()  # the ceilings' buffers: the ranks size their KV caches from free memory
    prompts, out_lens = reference_workload()
    out = {"copy_gbs": bw, "matmul_tflops": tflops}
    for tp in tps:
        for suffix, opts in _engine_modes(tp, args.custom_ar, args.prefetch):
            t0 = time.perf_counter()
            llm = engine(model_dir, tp=tp, **opts)
            load_s = time.perf_counter() - t0
            ms = decode_ms(llm)
            floor_ms = weight_bytes(shape) / (tp * bw * 1e9) * 1e3
            row = {"load_s": load_s, "decode_ms": ms, "decode_floor_ms": floor_ms, "decode_of_floor": floor_ms / ms}
            if args.workload:
                tok_s, dt = workload_tps(llm, shape)
                floor_s = workload_floor_s(shape, [len(p) for p in prompts], out_lens, tflops * 1e12 * tp,
                                           bw * 1e9 * tp)["floor_s"]
                row.update(workload_tok_s=tok_s, workload_s=dt, workload_of_floor=floor_s / dt)
            out[f"tp{tp}{suffix}"] = row
            print(f"   {shape} tp{tp}{suffix}: {json.dumps(row)}", flush=True)
            llm.llm_engine.shutdown()
            del llm
    return out


def part_replicas(args) -> dict:  # noqa: ANN001
    """Open-loop load through EngineLoop / ReplicaSet (the server's engine client), no HTTP."""
    from serving.engine.engine_loop import EngineLoop
    from serving.engine.llm_engine import LLMEngine
    from serving.engine.replicas import ReplicaSet
    from serving.engine_config import EngineConfig
    from serving.sampling_params import SamplingParams

    shape = "llama-3-8b"
    model_dir = make_dummy_model_dir(shape, Path(args.model_root) / shape)
    config = EngineConfig.from_options(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                                       max_model_len=4096, gpu_memory_utilization=0.85, skip_tokenizer_init=True)
    prompts, out_lens = reference_workload()
    results = {}
    for copies in (1, 2):
        loops = [EngineLoop(config, engine_factory=lambda c, d=(f"cuda:{i}",): LLMEngine(c, devices=d, multiprocess=True))
                 for i in range(copies)]
        client = loops[0] if copies == 1 else ReplicaSet(loops)
        client.start()
        client.wait_ready(1800)
        rate = args.rate * copies  # requests/s: enough to saturate each copy
        ttft, tpot, done = [], [], [0]
        lock = threading.Lock()

        def one(i: int) -> None:
            t0 = time.perf_counter()
            sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=out_lens[i], detokenize=False)
            stream = client.add_request(f"r{i}", prompts[i], sp)
            first = None
            n = 0
            for delta in stream:
                if first is None and delta.token_ids:
                    first = time.perf_counter()
                n += len(delta.token_ids)
            end = time.perf_counter()
            with lock:
                ttft.append(first - t0)
                if n > 1:
                    tpot.append((end - first) / (n - 1))
                done[0] += n

        threads = []
        t_start = time.perf_counter()
        for i in range(len(prompts)):
            th = threading.Thread(target=one, args=(i,))
            th.start()
            threads.append(th)
            time.sleep(1.0 / rate)
        for th in threads:
            th.join()
        wall = time.perf_counter() - t_start

        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

        results[f"copies{copies}"] = {"out_tok_s": done[0] / wall, "wall_s": wall,
                                      "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
                                      "tpot_p50_ms": pct(tpot, 0.5), "tpot_p99_ms": pct(tpot, 0.99)}
        if copies > 1:
            results[f"copies{copies}"]["routed"] = client.stats().get("routed_per_copy")
        client.close()
    results["speedup"] = results["copies2"]["out_tok_s"] / results["copies1"]["out_tok_s"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="overhead")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--rate", type=float, default=64.0, help="requests/s per copy in the replicas part")
    ap.add_argument("--tp8b", default="1,2", help="degrees of the tp8b part")
    ap.add_argument("--tp70b", default="2", help="degrees of the tp70b part")
    ap.add_argument("--tp-agree", default="2", help="degrees (> 1) compared with TP=1 in the agree part")
    ap.add_argument("--agree-budgets", default="4096,48", help="token budgets of the agree part's engines")
    ap.add_argument("--custom-ar", default="on", help="on, off, unfused (custom all-reduce, not fused with the "
                    "norm), nopush (fused, the GEMVs not pushing their rows) or a list: TP > 1 engines with / without "
                    "the custom all-reduce")
    ap.add_argument("--prefetch", default="on", help="on (the default), off or on,off: the L2 weight hints of "
                    "decode steps (OPEN_LMI_L2_PREFETCH_MB=16 or $BENCH_PREFETCH_MB for on, 0 for off; result "
                    "keys of off end _nopf)")
    ap.add_argument("--no-workload", dest="workload", action="store_false",
                    help="tp8b / tp70b: batch-1 decode only, no reference workload")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.prefetch = tuple(m.strip() for m in args.prefetch.split(","))
    if not args.prefetch or set(args.prefetch) - {"on", "off"}:
        raise SystemExit(f"--prefetch takes on, off or both, got {args.prefetch!r}")
    args.custom_ar = tuple(m.strip() for m in args.custom_ar.split(","))
    if not args.custom_ar or set(args.custom_ar) - {"on", "off", "unfused", "nopush"}:
        raise SystemExit(f"--custom-ar takes on, off, unfused, nopush or a list of them, got {args.custom_ar!r}")
    print(f"device: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}", flush=True)
    results = {}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        if part == "overhead":
            results[part] = part_overhead(args)
        elif part == "agree":
            results[part] = part_agree(args)
        elif part == "tp8b":
            results[part] = part_tp(args, "llama-3-8b", _degrees(args.tp8b))
        elif part == "tp70b":
            results[part] = part_tp(args, "llama-3-70b", _degrees(args.tp70b))
        elif part == "replicas":
            results[part] = part_replicas(args)
        else:
            raise SystemExit(f"unknown part {part!r}")
        print(f"== {part} ({time.perf_counter() - t0:.0f} s)\n{json.dumps(results[part], indent=1)}", flush=True)
        if args.out:  # after every part: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
