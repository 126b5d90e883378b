"""Mean accepted tokens per verify step of n-gram speculation on the embedded model (real weights, CPU).

    python3 bench/spec_acceptance.py [--ks 2 4 6] [--max-tokens 48]

Input-grounded prompts (edit this code, answer quoting this passage, extract fields as JSON), greedy,
one at a time; prints per k: verify steps, draft tokens, accepted tokens, accepted per verify step,
tokens per engine step, and the acceptance per draft position (issue 29's CPU figure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.llm import LLM  # noqa: E402
from serving.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "Edit this code: rename the function `total` to `sum_prices` and keep everything else.\n\n"
    "def total(prices):\n    result = 0\n    for price in prices:\n        result += price\n    return result\n\n"
    "Edited code:\n",
    "Passage: The Amazon rainforest covers much of the Amazon basin of South America. The basin spans seven "
    "million square kilometres, of which five and a half million are covered by the rainforest.\n"
    "Question: How much of the basin is covered by the rainforest? Answer by quoting the passage.\nAnswer:",
    "Extract the fields as JSON with keys name, age, city and email.\n"
    "Text: Our new customer is Maria Lopez, 42 years old, living in Madrid; write to maria.lopez@example.com.\n"
    "JSON:",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for k in args.ks:
        llm = LLM(None, device="cpu", dtype="float32", kv_cache_memory_gb=0.1, max_model_len=1024,
                  speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                      "prompt_lookup_min": 1, "acceptance_floor": 0.0})
        tokens = 0
        for prompt in PROMPTS:  # one at a time: batch 1
            tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        s = llm.llm_engine.stats()
        drafts = s["spec_decode_num_drafts"]
        accepted = s["spec_decode_num_accepted_tokens"]
        print(json.dumps({
            "k": k, "verify_steps": drafts, "draft_tokens": s["spec_decode_num_draft_tokens"],
            "accepted_tokens": accepted, "mean_accepted_per_verify": round(accepted / max(drafts, 1), 3),
            "output_tokens": tokens, "tokens_per_step": round(tokens / s["num_steps"], 3),
            "accepted_per_position": [s[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(k)],
        }), flush=True)
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
