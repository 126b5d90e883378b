"""GPU memory sizing for an LMI deployment: weights, KV cache, instance type, TENSOR_PARALLEL_DEGREE.

In: a Hugging Face ``config.json`` (or a parameter count), dtype, batch size, sequence length.
Out: a ``SizingReport`` with weight bytes, GQA-correct KV bytes per token
(``2 x layers x kv_heads x head_dim x bytes``) beside the seed article's hidden-size formula
(``2 x bytes x layers x hidden``, which overestimates for GQA models), the total, and a suggestion.
CLI: ``python -m sdk.sizing --config config.json --dtype fp16 --batch 4 --seq-len 4096``.
Quantized weights (``--quantize gptq|awq|fp8``, ``option.quantize``): the linear layers' weights
at ``bits`` per weight plus a float16 scale and zero point per ``group_size`` input rows (as the
engine holds them: GPTQ/AWQ int4 group 128 = 0.53 bytes per weight; fp8 = 1 byte plus one float32
scale per output channel); embeddings, the LM head and norms stay in ``dtype``.
Units: GB = 1e9 bytes (as the article), GiB = 2**30 (as GPU memory is sold).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sdk import model_types

GB = 1e9
GIB = 2**30

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "int8": 1, "int4": 0.5, "awq": 0.5, "gptq": 0.5,
}

# SageMaker GPU instances: (GPUs, usable GiB per GPU as nvidia-smi reports it, GPU), cheapest first.
# Marketing sizes: T4 16 GB, A10G/L4 24 GB, L40S 48 GB, A100 40/80 GB, H100 80 GB, H200 141 GB.
INSTANCES: dict[str, tuple[int, float, str]] = {
    "ml.g4dn.xlarge": (1, 15.0, "T4"),
    "ml.g5.xlarge": (1, 22.5, "A10G"),
    "ml.g6.xlarge": (1, 22.5, "L4"),
    "ml.g6e.xlarge": (1, 45.0, "L40S"),
    "ml.g5.12xlarge": (4, 22.5, "A10G"),
    "ml.g6.12xlarge": (4, 22.5, "L4"),
    "ml.g6e.12xlarge": (4, 45.0, "L40S"),
    "ml.g5.48xlarge": (8, 22.5, "A10G"),
    "ml.g6e.48xlarge": (8, 45.0, "L40S"),
    "ml.p4d.24xlarge": (8, 40.0, "A100"),
    "ml.p4de.24xlarge": (8, 80.0, "A100"),
    "ml.p5.48xlarge": (8, 79.6, "H100"),
    "ml.p5e.48xlarge": (8, 139.8, "H200"),
}
# Same GPU as the one-GPU entry above; more vCPUs and host RAM (the seed uses ml.g5.4xlarge).
SAME_GPU = {"ml.g5.xlarge": "ml.g5.2xlarge, ml.g5.4xlarge, ml.g5.8xlarge, ml.g5.16xlarge"}

# Phi-3-mini-4k-instruct's config.json (the seed's model), so the seed check needs no download.
PHI3_MINI_4K: dict[str, Any] = {
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


_GPT2_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_inner": "intermediate_size"}


@dataclass(frozen=True)
class ModelShape:
    """The few config.json numbers that decide memory."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 1  # MLPs a layer (MoE: experts, each `intermediate_size` wide)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert
    mlp_matrices: int = 3  # gate, up, down; 2 for a plain MLP (StarCoder2, Phi-2, GPT-2 ...)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the LM under text_config
        # GPT-2's own names for the same numbers
        cfg = {**{ours: cfg[theirs] for theirs, ours in _GPT2_NAMES.items() if theirs in cfg}, **cfg}
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1)
        # Qwen-MoE configs give the experts' width apart (their `intermediate_size` is a dense layer's)
        expert_width = cfg.get("moe_intermediate_size") if num_experts > 1 else None
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(expert_width or cfg.get("intermediate_size") or 4 * hidden),
            vocab_size=int(cfg.get("vocab_size", 32000)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=num_experts,
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            mlp_matrices=model_types.mlp_matrices(str(cfg.get("model_type", ""))),
        )

    def mlp_width(self) -> int:
        """The summed intermediate width of a layer's MLPs (every expert, and a shared one)."""
        return self.intermediate_size * self.num_experts + self.shared_intermediate_size

    def linear_params(self) -> int:
        """Weights of the decoder layers' linear projections (what GPTQ / AWQ / FP8 quantize)."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return self.num_layers * (q_o + k_v + self.mlp_matrices * self.hidden_size * self.mlp_width())

    def num_params(self) -> int:
        """Parameter count of a LLaMA-style decoder (gated MLP, RMSNorm, no biases)."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = self.mlp_matrices * self.hidden_size * self.mlp_width()
        router = self.hidden_size * self.num_experts if self.num_experts > 1 else 0
        norms = 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * (q_o + k_v + mlp + router + norms) + embed + lm_head + self.hidden_size


QUANTIZATIONS = ("gptq", "awq", "fp8")


def quantized_weight_bytes(shape: ModelShape, quantization: str, dtype: str = "fp16", bits: int = 4,
                           group_size: int | None = 128) -> float:
    """Weight bytes with the linear layers quantized (the rest in ``dtype``), as the engine holds them.

    gptq / awq: ``bits`` per weight + a 2-byte scale and a 2-byte zero point per output column and
    group of ``group_size`` input rows (None: one group, per output channel); fp8: 1 byte per
    weight + a 4-byte scale per output column. (GPTQ's act-order ``g_idx``, 4 bytes per input row,
    is under 0.1 % and left out.)
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; one of {', '.join(QUANTIZATIONS)}")
    linear = shape.linear_params()
    rest = (shape.num_params() - linear) * DTYPE_BYTES[dtype]
    h = shape.hidden_size
    out_cols = shape.num_layers * (shape.num_heads * shape.head_dim + 2 * shape.num_kv_heads * shape.head_dim + h
                                   + (shape.mlp_matrices - 1) * shape.mlp_width()
                                   + h * (shape.num_experts + bool(shape.shared_intermediate_size)))
    if quantization == "fp8":
        return linear + 4 * out_cols + rest
    if bits not in (4, 8) or (quantization == "awq" and bits != 4):
        raise ValueError(f"{quantization} weights are {'4 or 8' if quantization == 'gptq' else '4'} bits, got {bits}")
    scales_zeros = linear * 4 / group_size if group_size else 4 * out_cols
    return linear * bits / 8 + scales_zeros + rest


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """GQA-correct KV cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def seed_kv_bytes_per_token(num_layers: int, hidden_size: int, dtype_bytes: float) -> float:
    """The seed article's formula: 2 (K and V) x bytes x layers x hidden size (exact only without GQA)."""
    return 2 * dtype_bytes * num_layers * hidden_size


@dataclass(frozen=True)
class SeedEstimate:
    """The article's hand arithmetic, rounded where it rounds (per-token GB to 2 significant digits)."""

    weights_gb: float
    kv_bytes_per_token: float
    kv_gb_per_token_rounded: float
    kv_cache_gb: float
    total_gb: float


def seed_estimate(params_billion: float, num_layers: int, hidden_size: int, dtype_bytes: float,
                  seq_len: int, batch: int) -> SeedEstimate:
    """Reproduce seed 004: 3.8 x 2 = 7.6 GB; 524,288 B/token; 4096 x 4 x 0.00052 GB = 8.52 GB; 16.1 GB."""
    per_token = seed_kv_bytes_per_token(num_layers, hidden_size, dtype_bytes)
    per_token_gb = float(f"{per_token / GB:.2g}")  # 0.000524288 -> 0.00052, as the article writes it
    kv_gb = seq_len * batch * per_token_gb
    weights_gb = params_billion * dtype_bytes
    return SeedEstimate(weights_gb, per_token, per_token_gb, kv_gb, weights_gb + kv_gb)


@dataclass(frozen=True)
class SizingReport:
    """Everything the calculator derives, in bytes unless the name says otherwise."""

    dtype: str
    batch: int
    seq_len: int
    num_params: int
    weight_bytes: float
    kv_bytes_per_token: float
    seed_kv_bytes_per_token: float
    seed_overestimate: float  # seed formula / GQA-correct formula
    kv_cache_bytes: float
    seed_kv_cache_bytes: float
    overhead_bytes: float
    total_bytes: float
    instance_type: str | None
    tensor_parallel_degree: int | None
    gpu_memory_utilization: float
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tp_candidates(shape: ModelShape | None, num_gpus: int) -> list[int]:
    """TP degrees that split the attention heads evenly (as vLLM requires), up to the GPU count."""
    degrees = [d for d in (1, 2, 4, 8) if d <= num_gpus]
    if shape is None:
        return degrees
    return [d for d in degrees if shape.num_heads % d == 0 and (shape.num_kv_heads % d == 0 or d % shape.num_kv_heads == 0)]


def suggest(total_bytes: float, shape: ModelShape | None, gpu_memory_utilization: float = 0.9,
            per_gpu_overhead_bytes: float = 1.0 * GIB) -> tuple[str | None, int | None]:
    """Cheapest listed instance whose GPUs hold ``total_bytes`` split over the smallest valid TP degree."""
    for name, (num_gpus, gib, _gpu) in INSTANCES.items():
        budget = gib * GIB * gpu_memory_utilization - per_gpu_overhead_bytes
        for tp in _tp_candidates(shape, num_gpus):
            if total_bytes / tp <= budget:
                return name, tp
    return None, None


def size(*, shape: ModelShape | None = None, num_params: int | None = None, dtype: str = "fp16",
         batch: int = 1, seq_len: int = 4096, kv_dtype: str | None = None, seed_hidden_size: int | None = None,
         gpu_memory_utilization: float = 0.9, overhead_bytes: float = 0.0, quantization: str | None = None,
         bits: int = 4, group_size: int | None = 128) -> SizingReport:
    """Size one deployment. Give ``shape`` (from config.json), ``num_params``, or both (params win).

    ``seed_hidden_size`` replaces the config's hidden size in the seed formula (the article used 4096).
    ``quantization`` (gptq / awq / fp8, as ``option.quantize``) sizes the linear layers' weights as
    ``quantized_weight_bytes`` does (needs ``shape``); ``dtype`` is then the rest's and the KV cache's.
    """
    if shape is None and num_params is None:
        raise ValueError("need a model shape (config.json) or a parameter count")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(DTYPE_BYTES)}")
    wbytes = DTYPE_BYTES[dtype]
    kbytes = DTYPE_BYTES[kv_dtype or (dtype if wbytes >= 2 else "fp16")]
    params = num_params if num_params is not None else shape.num_params()  # type: ignore[union-attr]
    weight_bytes = params * wbytes
    if quantization is not None:
        if shape is None:
            raise ValueError("sizing quantized weights needs the model shape (config.json)")
        weight_bytes = quantized_weight_bytes(shape, quantization, dtype, bits, group_size) * params / shape.num_params()
    tokens = batch * seq_len
    if shape is not None:
        per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kbytes)
        seed_per_token = seed_kv_bytes_per_token(shape.num_layers, seed_hidden_size or shape.hidden_size, kbytes)
    else:
        per_token = seed_per_token = 0.0
    total = weight_bytes + per_token * tokens + overhead_bytes
    instance, tp = suggest(total, shape, gpu_memory_utilization)
    note = ""
    if instance in SAME_GPU:
        note = f"same GPU, more CPU/RAM: {SAME_GPU[instance]}"
    return SizingReport(
        dtype=dtype if quantization is None else f"{quantization}+{dtype}", batch=batch, seq_len=seq_len, num_params=int(params), weight_bytes=weight_bytes,
        kv_bytes_per_token=per_token, seed_kv_bytes_per_token=seed_per_token,
        seed_overestimate=(seed_per_token / per_token) if per_token else 0.0,
        kv_cache_bytes=per_token * tokens, seed_kv_cache_bytes=seed_per_token * tokens,
        overhead_bytes=overhead_bytes, total_bytes=total, instance_type=instance, tensor_parallel_degree=tp,
        gpu_memory_utilization=gpu_memory_utilization, note=note,
    )


def format_report(r: SizingReport) -> str:
    """Human-readable table."""
    tokens = r.batch * r.seq_len
    lines = [
        f"parameters            {r.num_params / 1e9:.3f} B",
        f"weights ({r.dtype:>5})       {r.weight_bytes / GB:8.2f} GB  ({r.weight_bytes / GIB:.2f} GiB)",
    ]
    if r.kv_bytes_per_token:
        lines += [
            f"KV bytes/token (GQA)  {r.kv_bytes_per_token:12,.0f}   2 x layers x kv_heads x head_dim x bytes",
            f"KV bytes/token (seed) {r.seed_kv_bytes_per_token:12,.0f}   2 x bytes x layers x hidden"
            f"  ({r.seed_overestimate:.2f}x the GQA-correct figure)",
            f"KV cache, {tokens:,} tokens  {r.kv_cache_bytes / GB:8.2f} GB"
            f"  (seed formula: {r.seed_kv_cache_bytes / GB:.2f} GB)",
        ]
    else:
        lines.append("KV cache              not sized: give --config for layers / kv heads / head_dim")
    lines.append(f"total                 {r.total_bytes / GB:8.2f} GB  ({r.total_bytes / GIB:.2f} GiB)")
    if r.instance_type:
        gpus, gib, gpu = INSTANCES[r.instance_type]
        lines.append(f"suggested instance    {r.instance_type} ({gpus} x {gpu} {gib:g} GiB, "
                     f"gpu_memory_utilization {r.gpu_memory_utilization})")
        lines.append(f"TENSOR_PARALLEL_DEGREE={r.tensor_parallel_degree}"
                     + (f"  (\"max\" would use all {gpus})" if gpus != r.tensor_parallel_degree else ""))
        if r.note:
            lines.append(r.note)
    else:
        lines.append("no listed instance holds this; lower batch x seq-len or quantize")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdk.sizing", description="LMI GPU memory sizing")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", type=Path, help="a model's config.json (or its directory)")
    src.add_argument("--phi3-mini", action="store_true", help="use Phi-3-mini-4k's config (the seed's model)")
    parser.add_argument("--params", type=float, help="parameter count, e.g. 3.8e9 (overrides the config's)")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="quantized linear layers (option.quantize); --dtype is then the rest's")
    parser.add_argument("--bits", type=int, default=4, help="gptq/awq bits per weight (4; gptq also 8)")
    parser.add_argument("--group-size", type=int, default=128, help="gptq/awq group size (-1: per channel)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--seed-hidden-size", type=int, help="hidden size used in the seed formula (article: 4096)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    shape = None
    if args.config is not None:
        path = args.config / "config.json" if args.config.is_dir() else args.config
        shape = ModelShape.from_config(json.loads(path.read_text()))
    elif args.phi3_mini:
        shape = ModelShape.from_config(PHI3_MINI_4K)
    if shape is None and args.params is None:
        parser.error("give --config, --phi3-mini or --params")
    report = size(shape=shape, num_params=int(args.params) if args.params else None, dtype=args.dtype,
                  batch=args.batch, seq_len=args.seq_len, kv_dtype=args.kv_dtype,
                  seed_hidden_size=args.seed_hidden_size, gpu_memory_utilization=args.gpu_memory_utilization,
                  quantization=args.quantize, bits=args.bits,
                  group_size=None if args.group_size in (-1, 0) else args.group_size)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(format_report(report))
    if shape is not None:
        params_b = (args.params or shape.num_params()) / 1e9
        seed = seed_estimate(float(f"{params_b:.2g}"), shape.num_layers, args.seed_hidden_size or shape.hidden_size,
                             DTYPE_BYTES[args.dtype], args.seq_len, args.batch)
        print(f"seed arithmetic       {float(f'{params_b:.2g}'):g} x {DTYPE_BYTES[args.dtype]:g} = {seed.weights_gb:.1f} GB weights; "
              f"{seed.kv_bytes_per_token:,.0f} B/token ~ {seed.kv_gb_per_token_rounded} GB; "
              f"{args.seq_len} x {args.batch} x {seed.kv_gb_per_token_rounded} = {seed.kv_cache_gb:.2f} GB; "
              f"total {seed.total_gb:.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
