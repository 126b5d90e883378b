"""CPU offline throughput: our `LLM.generate` vs transformers `generate` (padded static batch).

Same machine, same run, same weights (the embedded default model, SmolLM2-135M-Instruct, fp32),
same 16 chat-formatted prompts (the first 16 of /work/shared/data/questions-59.json when
present), same greedy decoding and the same stopping rule on both sides. Two workloads:

  eos    : stop at EOS or --max-tokens (how requests really end). transformers keeps computing
           rows that already finished until the whole batch is done; the rolling batch drops
           them at once. Throughput counts the tokens each side actually returns (up to EOS).
  mixed  : EOS ignored, prompt i asks for its own length (a permutation of --max-tokens*k/16,
           k = 1..16). The padded batch runs to the longest; each row returns its own length.
  fixed  : EOS ignored, exactly --fixed-tokens new tokens per prompt: pure per-step efficiency.

Each side is warmed up untimed, then timed once per workload. Prints one table.

  python bench/cpu_offline.py [--max-tokens 256] [--fixed-tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = Path("/work/shared/data/questions-59.json")
_FALLBACK = [
    "Implement a Python function to compute the Fibonacci numbers.",
    "Write a Rust function that performs binary exponentiation.",
    "How do I allocate memory in C?",
    "What are the differences between Javascript and Python?",
    "How do I find invalid indices in Postgres?",
    "How can you implement a LRU (Least Recently Used) cache in Python?",
    "What approach would you use to detect and prevent race conditions in a multithreaded application?",
    "Can you explain how a decision tree algorithm works in machine learning?",
    "How would you design a simple key-value store database from scratch?",
    "How do you handle deadlock situations in concurrent programming?",
    "What is the logic behind the A* search algorithm, and where is it used?",
    "How can you design an efficient autocomplete system?",
    "What approach would you take to design a secure session management system in a web application?",
    "How would you handle collision in a hash table?",
    "How can you implement a load balancer for a distributed system?",
    "Implement a Python class for a doubly linked list.",
]


def load_questions(n: int) -> list[str]:
    qs = json.loads(QUESTIONS.read_text()) if QUESTIONS.is_file() else _FALLBACK
    return [qs[i % len(qs)] for i in range(n)]


def _useful(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first EOS (what a stopping engine returns)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128, help="cap of the eos and mixed workloads")
    ap.add_argument("--fixed-tokens", type=int, default=64, help="length of the fixed workload (0: skip)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving import LLM, SamplingParams
    from serving.checkpoint.default_model import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = load_questions(args.num_prompts)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    prompt_ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    total_in = sum(len(p) for p in prompt_ids)
    width = max(len(p) for p in prompt_ids)

    t0 = time.perf_counter()
    llm = LLM(None, block_size=args.block_size, kv_cache_memory_gb=0.5)
    load_ours = time.perf_counter() - t0
    eos = set(llm.llm_engine.eos_token_ids)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_hf = time.perf_counter() - t0
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    inputs = [{"prompt_token_ids": p} for p in prompt_ids]

    def ours(lens: list[int], ignore_eos: bool) -> tuple[float, list[list[int]], int]:
        steps0 = llm.llm_engine.num_steps
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for n in lens]
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.num_steps - steps0

    def transformers_(lens: list[int], ignore_eos: bool) -> tuple[float, list[list[int]]]:
        kw = dict(do_sample=False, pad_token_id=pad_id, max_new_tokens=max(lens))
        kw["eos_token_id"] = None if ignore_eos else sorted(eos)
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, **kw)
            dt = time.perf_counter() - t
        rows = [r[:n] for r, n in zip(out[:, width:].tolist(), lens)]
        return dt, [r if ignore_eos else _useful(r, eos) for r in rows]

    n = len(prompt_ids)
    ours([4] * n, True)  # warm-up
    transformers_([4] * n, True)
    m = args.max_tokens
    workloads = [
        ("eos", [m] * n, False),
        ("mixed", [m * (1 + (i * 7) % 16) // 16 for i in range(n)], True),
    ] + ([("fixed", [args.fixed_tokens] * n, True)] if args.fixed_tokens else [])
    rows = []
    for name, lens, ignore in workloads:
        o_s, o_tok, steps = ours(lens, ignore)
        h_s, h_tok = transformers_(lens, ignore)
        same = sum(a == b for a, b in zip(o_tok, h_tok))
        n_o, n_h = sum(map(len, o_tok)), sum(map(len, h_tok))
        rows.append((name, max(lens), o_s, n_o, h_s, n_h, same, steps, [len(t) for t in o_tok]))

    print()
    print(f"CPU offline, default model (SmolLM2-135M-Instruct fp32), {len(prompt_ids)} prompts "
          f"({total_in} prompt tokens, {min(map(len, prompt_ids))}-{width} each), greedy; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs ({platform.machine()}); "
          f"load: ours {load_ours:.1f} s, transformers {load_hf:.1f} s")
    print(f"{'workload':<10} {'engine':<32} {'gen s':>8} {'out tokens':>10} {'out tok/s':>10} {'speed-up':>9}")
    for name, cap, o_s, n_o, h_s, n_h, same, steps, lens in rows:
        label = f"{name}({cap})"
        print(f"{label:<10} {'open-lmi LLM.generate (rolling)':<32} {o_s:8.2f} {n_o:10d} {n_o / o_s:10.1f} "
              f"{(n_o / o_s) / (n_h / h_s):8.2f}x")
        print(f"{'':<10} {'transformers generate (padded)':<32} {h_s:8.2f} {n_h:10d} {n_h / h_s:10.1f} {'1.00x':>9}")
        print(f"{'':<10} outputs identical: {same}/{len(lens)}; engine steps {steps}; "
              f"output lengths min/mean/max {min(lens)}/{sum(lens) / len(lens):.0f}/{max(lens)}")


if __name__ == "__main__":
    main()
