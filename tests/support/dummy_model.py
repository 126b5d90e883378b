"""Model dirs for random-weight benchmarks: config.json of a real shape + a borrowed tokenizer.

`make_dummy_model_dir("llama-3-8b", out_dir)` writes a Llama-3-8B-shaped config.json and copies
the tokenizer files of `tokenizer_dir` (the script's default: the embedded SmolLM2 model,
converted on the CPU machine) beside it, so the engine starts with `load_format="dummy"` and no checkpoint. The
config keeps the real vocab (128256); prompts must use ids below the tokenizer's size, and
generated ids past it detokenize to nothing. Run as a script to build both shapes:
`python tests/support/dummy_model.py OUT_DIR [TOKENIZER_DIR]`.

Quantized variants (`QUANT_VARIANTS`, the benches' `--quantize`): `gptq` / `awq` write a
`quantization_config` (int4, group 128) into the config, so the dummy load draws packed int4
weights of the real shapes; `fp8` keeps the bf16 config and sets `quantization="fp8"` (weights
converted at load). `gptq-desc-act` draws a random act order (g_idx), which the load sorts away:
it measures the input gather act-order layers add. `bf16` is the unquantized baseline.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SHAPES: dict[str, dict] = {
    # A CPU smoke-test shape (not benchmarked).
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_scaling=None,
        max_position_embeddings=2048,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        max_position_embeddings=131072,
    ),
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_scaling=None,
        max_position_embeddings=8192,
    ),
}
_COMMON = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, rms_norm_eps=1e-5,
    rope_theta=500000.0, hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
    bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
)
# --quantize value -> (quantization_config written into config.json, LLM(quantization=...))
QUANT_VARIANTS: dict[str, tuple[dict | None, str | None]] = {
    "bf16": (None, None),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, "gptq"),
    "gptq-desc-act": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
                       "checkpoint_format": "gptq"}, "gptq"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq"),
    "fp8": (None, "fp8"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def default_tokenizer_dir() -> Path:
    from serving.checkpoint.default_model import default_model_path

    return Path(default_model_path())


def make_dummy_model_dir(shape: str, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                         quantize: str = "bf16") -> Path:
    """Write config.json for `shape` (with `quantize`'s quantization_config) plus tokenizer files into
    out_dir; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**_COMMON, **SHAPES[shape]}
    if QUANT_VARIANTS[quantize][0] is not None:
        config["quantization_config"] = QUANT_VARIANTS[quantize][0]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is None:  # offline benches run with skip_tokenizer_init: no tokenizer needed
        return out
    src = Path(tokenizer_dir)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def add_dummy_model_args(ap) -> None:  # noqa: ANN001 - an argparse.ArgumentParser
    """The profiling scripts' shared options: which shape, and where its model dir goes."""
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--quantize", default="bf16", choices=sorted(QUANT_VARIANTS),
                    help="random weights quantized as this variant (gptq/awq: int4 g128; fp8: converted at load)")


def dummy_llm(shape: str, model_root: str | Path, max_num_seqs: int = 256, max_num_batched_tokens: int = 16384,
              quantize: str = "bf16"):  # noqa: ANN201
    """An offline `LLM` on random weights of `shape` (bf16, or a `QUANT_VARIANTS` variant)."""
    from serving import LLM

    model_dir = make_dummy_model_dir(shape, dummy_dir(model_root, shape, quantize), quantize=quantize)
    max_model_len = min(4096, SHAPES[shape]["max_position_embeddings"])
    return LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=max_num_seqs,
               max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, skip_tokenizer_init=True,
               quantization=QUANT_VARIANTS[quantize][1])


def greedy_batches(llm) -> list[list[int]]:  # noqa: ANN001
    """The tokens of 24 greedy steps for four fixed prompts in one batch, then the first alone (batch 1):
    what the tests of on/off knobs (L2 prefetch, PDL) compare, every decode graph size exercised. Shuts `llm` down."""
    import torch

    from serving import SamplingParams

    prompts = [{"prompt_token_ids": list(range(100 + 13 * i, 140 + 13 * i))} for i in range(4)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, detokenize=False)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [sp] * 4, use_tqdm=False)]
    tokens.append(list(llm.generate([prompts[0]], [sp], use_tqdm=False)[0].outputs[0].token_ids))
    llm.llm_engine.shutdown()
    torch.cuda.empty_cache()
    return tokens


def dummy_dir(model_root: str | Path, shape: str, quantize: str = "bf16") -> Path:
    """Where a shape's (variant's) dummy model dir goes: one dir per config.json."""
    return Path(model_root) / (shape if QUANT_VARIANTS[quantize][0] is None else f"{shape}-{quantize}")


def weight_bytes(shape: str, dtype_bytes: int = 2, quantize: str = "bf16") -> int:
    """Bytes of all weights of a shape (what one batch-1 decode step must read); with `quantize`,
    the linear layers at int4 + fp16 scale and zero per 128 weights (gptq/awq) or 1 byte (fp8)."""
    c = {**_COMMON, **SHAPES[shape]}
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c["head_dim"]
    attn = h * d * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + c["num_attention_heads"] * d * h
    linear = n * (attn + 3 * h * i)
    emb = v * h * (1 if c["tie_word_embeddings"] else 2)
    rest = (n * 2 * h + emb + h) * dtype_bytes
    per_weight = {"bf16": dtype_bytes, "fp8": 1.0}.get(quantize, 0.5 + 4 / 128)
    return int(linear * per_weight + rest)


def shape_info(shape: str) -> dict:
    return {**_COMMON, **SHAPES[shape]}


if __name__ == "__main__":
    root = Path(sys.argv[1])
    tok = sys.argv[2] if len(sys.argv) > 2 else str(default_tokenizer_dir())
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["bf16"]  # e.g. bf16,gptq: one dir per variant
    for name in SHAPES:
        for variant in variants:
            print(make_dummy_model_dir(name, dummy_dir(root, name, variant), tok, quantize=variant))
