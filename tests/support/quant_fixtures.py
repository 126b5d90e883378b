"""Quantized test checkpoints, packed here from the published formats (independently of serving/).

`quantize_rtn` rounds a float weight to `bits`-bit integers per group (asymmetric or symmetric;
act-order permutes which rows form a group, as GPTQ's desc_act does). The packers write each
format's tensors from those integers, word by word as the formats document them:
- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K/pf, N]: row k at bits 4*(k % 8) of word k // 8
  (int4); qzeros int32 [G, N/pf] packed along N the same way; v1 (`checkpoint_format: gptq`)
  stores zero - 1; scales fp16 [G, N]; g_idx int32 [K].
- AWQ GEMM (AutoAWQ): qweight int32 [K, N/8]: nibble j of word c holds column 8c + ORDER[j],
  ORDER = 0 2 4 6 1 3 5 7; qzeros [G, N/8] the same; scales fp16 [G, N]; real zeros.
- FP8 (AutoFP8 / vLLM `fp8`): weight float8_e4m3fn [N, K], weight_scale fp32 per tensor ([]) or
  per channel ([N, 1]), input_scale fp32 [].
`write_quantized(src, dst, fmt)` writes a quantized copy of the HF dir `src` plus, in `dst/oracle`,
the same model with the dequantised weights in fp32 (what the outputs must equal).
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class IntQuant:
    """One weight as integers: w[k, n] ~ (q[k, n] - zeros[g, n]) * scales[g, n], g = g_idx[k]."""

    q: torch.Tensor  # [K, N] int64, in [0, 2**bits)
    zeros: torch.Tensor  # [G, N] int64
    scales: torch.Tensor  # [G, N] fp16
    g_idx: torch.Tensor  # [K] int32

    def dequantize(self) -> torch.Tensor:
        """The format's formula, in fp32: [K, N]."""
        g = self.g_idx.long()
        return (self.q - self.zeros[g]).float() * self.scales.float()[g]


def quantize_rtn(weight: torch.Tensor, bits: int, group: int | None, sym: bool, act_order: bool,
                 seed: int = 0) -> IntQuant:
    """Round-to-nearest quantization of an HF weight [N, K] (fp32)."""
    w = weight.t().float()  # [K, N]
    k_rows = w.shape[0]
    group = group or k_rows
    rank = torch.arange(k_rows)
    if act_order:  # a random "activation order": groups are runs of it, scattered over rows
        order = torch.randperm(k_rows, generator=torch.Generator().manual_seed(seed))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(k_rows)
    g_idx = (rank // group).to(torch.int32)
    num_groups = k_rows // group
    maxq = 2**bits - 1
    scales = torch.empty(num_groups, w.shape[1])
    zeros = torch.empty(num_groups, w.shape[1], dtype=torch.int64)
    for gi in range(num_groups):
        rows = w[g_idx == gi]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if sym:
            amax = torch.maximum(-lo, hi)
            scales[gi] = (2 * amax / maxq).clamp(min=1e-8)
            zeros[gi] = (maxq + 1) // 2
        else:
            scales[gi] = ((hi - lo) / maxq).clamp(min=1e-8)
            zeros[gi] = torch.round(-lo / scales[gi]).long().clamp(0, maxq)
    scales = scales.half()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).long()
    return IntQuant(q, zeros, scales, g_idx)


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """[..., pf] unsigned values -> [...] int32 words whose bits [bits*j, bits*j + bits) hold value j."""
    shifts = (bits * np.arange(values.shape[-1])).astype(np.uint64)
    words = ((values.astype(np.uint64) & np.uint64((1 << bits) - 1)) << shifts).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] -> int32 [K / pf, N]: word (i, n) holds rows pf*i .. pf*i + pf - 1 of column n."""
    pf = 32 // bits
    v = q.numpy().reshape(q.shape[0] // pf, pf, q.shape[1]).transpose(0, 2, 1)  # [K / pf, N, pf]
    return torch.from_numpy(_words(v, bits).copy())


def pack_cols(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, N] -> int32 [R, N / pf]: word (r, c) holds column pf*c + order[j] at slot j."""
    pf = 32 // bits
    v = q.numpy().reshape(q.shape[0], q.shape[1] // pf, pf)[:, :, list(order or range(pf))]
    return torch.from_numpy(_words(v, bits).copy())


def gptq_tensors(iq: IntQuant, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    zeros = iq.zeros - 1 if v1 else iq.zeros  # v1 stores zero - 1 (wrapping -1 to all ones)
    return {"qweight": pack_rows(iq.q, bits), "qzeros": pack_cols(zeros, bits), "scales": iq.scales,
            "g_idx": iq.g_idx}


def awq_tensors(iq: IntQuant) -> dict[str, torch.Tensor]:
    return {"qweight": pack_cols(iq.q, 4, AWQ_ORDER), "qzeros": pack_cols(iq.zeros, 4, AWQ_ORDER),
            "scales": iq.scales}


def compressed_tensors_from_awq(iq: IntQuant, group: int) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors compressed-tensors' own AutoAWQ converter makes of our AWQ tensors."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converter = AutoAWQConverter(bits=4, group_size=group, zero_point=True)
    out = converter.process({f"m.{k}": v for k, v in awq_tensors(iq).items()})
    return {k.removeprefix("m."): v for k, v in out.items()}


def compressed_tensors_config(group: int) -> dict[str, object]:
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    config = AutoAWQConverter(bits=4, group_size=group, zero_point=True)._build_quant_config()
    return json.loads(json.dumps(config.model_dump(exclude_none=True), default=str))


def fp8_tensors(weight: torch.Tensor, per_channel: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors, dequantised fp32 [N, K]) of an HF weight [N, K]."""
    amax = weight.abs().amax(1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (amax / 448.0).float()
    w8 = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    tensors = {"weight": w8, "weight_scale": scale, "input_scale": torch.tensor(0.05)}
    return tensors, w8.float() * scale


@dataclass(frozen=True)
class Format:
    """How to quantize a test checkpoint."""

    method: str  # gptq | awq | fp8 | compressed-tensors (pack-quantized, made from AWQ by compressed-tensors)
    bits: int = 4
    group: int | None = 32
    sym: bool = False
    desc_act: bool = False
    v1: bool = True
    per_channel: bool = False  # fp8 scales

    def quantization_config(self) -> dict[str, object]:
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group or -1,
                    "desc_act": self.desc_act, "sym": self.sym, "lm_head": False,
                    "checkpoint_format": "gptq" if self.v1 else "gptq_v2"}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group or -1, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        if self.method == "compressed-tensors":
            return compressed_tensors_config(self.group)
        return {"quant_method": "fp8", "activation_scheme": "static"}


def write_quantized(src: Path, dst: Path, fmt: Format, seed: int = 0) -> Path:
    """A quantized copy of HF dir `src` at `dst`; `dst / "oracle"` holds the dequantised fp32 model."""
    dst.mkdir(parents=True, exist_ok=True)
    oracle = dst / "oracle"
    oracle.mkdir(exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantized, dense = {}, {}
    for name, t in sorted(tensors.items()):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            quantized[name] = dense[name] = t
            continue
        if fmt.method == "fp8":
            parts, w = fp8_tensors(t.float(), fmt.per_channel)
        else:
            # q/k/v (and gate/up) read one input, so GPTQ's act order is the same for them
            proj = module.rpartition(".")[2]
            same_input = module.rpartition(".")[0] + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
            iq = quantize_rtn(t.float(), fmt.bits, fmt.group, fmt.sym, fmt.desc_act, seed + zlib.crc32(same_input.encode()))
            if fmt.method == "compressed-tensors":
                parts = compressed_tensors_from_awq(iq, fmt.group)
            else:
                parts = gptq_tensors(iq, fmt.bits, fmt.v1) if fmt.method == "gptq" else awq_tensors(iq)
            w = iq.dequantize().t()
        quantized.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        dense[name] = w.contiguous()
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dense, str(oracle / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    for d in (dst, oracle):
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy(f, d / f.name)
    config["quantization_config"] = fmt.quantization_config()
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
