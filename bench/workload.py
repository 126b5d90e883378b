"""The reference offline workload (nano-vllm's bench.py) and its hardware floor.

`reference_workload()` reproduces perf.md exactly: random.seed(0); 256 prompts of
randint(100, 1024) ids in [0, 10000]; then 256 output lengths randint(100, 1024).
`workload_floor_s()` = max(FLOPs / peak, (decode steps x weight bytes + KV bytes read) / bandwidth),
with decode steps = the longest output (every sequence decodes concurrently).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the random-weight model builder
from dummy_model import shape_info, weight_bytes  # noqa: E402


def reference_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024):
    """-> (prompt token id lists, output lengths)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    out_lens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, out_lens


def workload_floor_s(shape: str, prompt_lens: list[int], out_lens: list[int], peak_flops: float, bw_bytes_s: float,
                     dtype_bytes: int = 2) -> dict[str, float]:
    """The floor and its two terms, in seconds, for one model shape."""
    c = shape_info(shape)
    h, n_layers, d = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    heads, kv_heads, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    wbytes = weight_bytes(shape, dtype_bytes)
    lm_head_params = vocab * h
    body_params = wbytes / dtype_bytes - lm_head_params * (1 if c["tie_word_embeddings"] else 2) - h
    total_tokens = sum(prompt_lens) + sum(out_lens)
    flops = 2 * body_params * total_tokens + 2 * lm_head_params * (sum(out_lens) + len(out_lens))
    kv_per_token = 2 * n_layers * kv_heads * d * dtype_bytes
    kv_read = 0
    attn_flops = 0
    for p, o in zip(prompt_lens, out_lens):
        # prefill: causal p^2/2 pairs; decode step t reads p + t cached tokens
        attn_flops += 4 * n_layers * heads * d * (p * p / 2)
        ctx_sum = o * p + o * (o - 1) / 2
        attn_flops += 4 * n_layers * heads * d * ctx_sum
        kv_read += kv_per_token * ctx_sum
    flops += attn_flops
    decode_steps = max(out_lens)
    bytes_moved = decode_steps * wbytes + kv_read
    t_flops, t_bytes = flops / peak_flops, bytes_moved / bw_bytes_s
    return {"floor_s": max(t_flops, t_bytes), "flops_s": t_flops, "bytes_s": t_bytes, "flops": flops,
            "bytes": bytes_moved}
