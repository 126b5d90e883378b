"""Quantized checkpoints: `option.quantize` and config.json's `quantization_config` -> one `QuantConfig`.

In: the user's option (`none`, `gptq`, `awq`, `fp8`, vLLM's `*_marlin` spellings) and the
checkpoint's `quantization_config` (or AutoGPTQ's separate `quantize_config.json`). Out: a frozen
`QuantConfig` (None for an unquantized model), parsed once at model load and handed to
`build_model`; the executor's linear methods (`serving/executor/quant/`) read it. Every problem
raises `QuantizationError` naming the field (or both sides of an option/checkpoint mismatch).
No torch here: the config layer and the sizing tools import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from serving.checkpoint.model_config import read_json_object

QuantMethod = Literal["gptq", "awq", "fp8", "compressed-tensors"]  # the last: pack-quantized int weights

# option.quantize spellings -> our method (None = unquantized). vLLM's kernel-specific names
# choose a kernel there; here they name the checkpoint format, the kernel is ours either way.
QUANTIZE_OPTIONS: dict[str, QuantMethod | None] = {
    "none": None,
    "gptq": "gptq", "gptq_marlin": "gptq", "marlin": "gptq",
    "awq": "awq", "awq_marlin": "awq",
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",  # llm-compressor checkpoints, int (pack-quantized) or fp8
}
# LMI options other backends accept that this engine cannot run: refused with this reason.
_UNSUPPORTED_OPTIONS = {
    "squeezellm": "SqueezeLLM checkpoints are not supported",
    "deepspeedfp": "DeepSpeed FP quantization is not supported",
    "bitsandbytes": "bitsandbytes checkpoints are not supported",
    "bitsandbytes8": "bitsandbytes checkpoints are not supported",
    "bitsandbytes4": "bitsandbytes checkpoints are not supported",
    "smoothquant": "SmoothQuant is not supported",
    "llmint8": "LLM.int8 is not supported",
}
QUANTIZE_ACCEPTS = "none|gptq|awq|fp8|compressed-tensors (or gptq_marlin|marlin|awq_marlin)"


class QuantizationError(ValueError):
    """A quantization option or checkpoint config we cannot run; the message names the field."""


def parse_quantize_option(text: str) -> str:
    """`option.quantize` -> its canonical spelling (none/gptq/awq/fp8); ValueError otherwise."""
    value = text.strip().lower()
    if value in _UNSUPPORTED_OPTIONS:
        raise ValueError(_UNSUPPORTED_OPTIONS[value])
    if value not in QUANTIZE_OPTIONS:
        raise ValueError("")
    return QUANTIZE_OPTIONS[value] or "none"


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's linear layers are quantized (HF field meanings).

    gptq / awq: `bits`-bit integer weights in groups of `group_size` input rows (None: one group
    per output channel), `sym` / `zero_point` as the format says; GPTQ's `desc_act` rows carry a
    `g_idx`; `zero_offset` is 1 for GPTQ v1 checkpoints (they store zero - 1), else 0.
    fp8: e4m3 weights with `weight_scale` per tensor or per channel (`from_checkpoint`), or
    bf16/fp16 weights quantized at load (`from_checkpoint` False).
    `skip_modules`: module name pieces left unquantized (AWQ `modules_to_not_convert`, fp8
    `ignored_layers`, compressed-tensors `ignore`).
    """

    method: QuantMethod
    bits: int = 4
    group_size: int | None = 128
    desc_act: bool = False
    sym: bool = True
    zero_offset: int = 0
    from_checkpoint: bool = True
    skip_modules: tuple[str, ...] = ()
    source: str = "config.json quantization_config"

    @property
    def pack_factor(self) -> int:
        """Integer values per int32 word."""
        return 32 // self.bits

    def skips(self, module: str) -> bool:
        """True when the module named `module` (HF name, e.g. model.layers.0.mlp.down_proj) stays unquantized."""
        for piece in self.skip_modules:
            if piece.startswith("re:"):
                import re

                if re.match(piece[3:], module):
                    return True
            elif module == piece or f".{piece}." in f".{module}." or module.endswith(f".{piece}"):
                return True
        return False

    def describe(self) -> str:
        """One line for the start-up log, e.g. 'gptq int4, group 128, desc_act, asym (v1 zeros)'."""
        if self.method == "fp8":
            return "fp8 e4m3 weights" + ("" if self.from_checkpoint else ", quantized at load (option.quantize=fp8)")
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        parts = [f"{self.method} int{self.bits}", group]
        if self.desc_act:
            parts.append("desc_act (g_idx)")
        parts.append("sym" if self.sym else "asym")
        if self.method == "gptq":
            parts.append("v1 zeros (+1)" if self.zero_offset else "v2 zeros")
        return ", ".join(parts)


def checkpoint_quant_dict(model_dir: str | Path, config: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint's quantization description and where it came from (None when unquantized)."""
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise QuantizationError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
        return qc, "config.json quantization_config"
    path = Path(model_dir) / "quantize_config.json"  # AutoGPTQ's file, on older hub checkpoints
    if path.is_file():
        d = read_json_object(path)
        return {"quant_method": "gptq", **d}, "quantize_config.json"
    return None, ""


def resolve_quantization(
    model_dir: str | Path, config: dict[str, Any], option: str | None, torch_dtype: str | None = None
) -> QuantConfig | None:
    """The one `QuantConfig` of this model, or None; checks `option` (option.quantize) agrees.

    An fp8 option on an unquantized checkpoint means: quantize the weights at load.
    """
    wanted = QUANTIZE_OPTIONS.get((option or "none").strip().lower(), "?")
    if wanted == "?":
        raise QuantizationError(f"option.quantize={option!r} is invalid: accepts {QUANTIZE_ACCEPTS}")
    qc, source = checkpoint_quant_dict(model_dir, config)
    if qc is None:
        if wanted is None:
            return None
        if wanted == "fp8":
            return QuantConfig("fp8", bits=8, group_size=None, from_checkpoint=False, source="option.quantize=fp8")
        raise QuantizationError(
            f"option.quantize={option} but the checkpoint in {model_dir} is not quantized (config.json has no "
            f"quantization_config): give a {wanted.upper()} checkpoint, or unset option.quantize")
    quant = _parse(qc, source)
    same_family = wanted == "compressed-tensors" and str(qc.get("quant_method")).lower() == "compressed-tensors"
    if wanted is not None and wanted != quant.method and not same_family:
        raise QuantizationError(
            f"option.quantize={option} does not match the checkpoint: its {source} says quant_method="
            f"{qc.get('quant_method')!r} ({quant.method}); unset option.quantize or set it to {quant.method}")
    return quant


def _parse(qc: dict[str, Any], source: str) -> QuantConfig:
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _parse_gptq(qc, source)
    if method == "awq":
        return _parse_awq(qc, source)
    if method == "fp8":
        return _parse_fp8(qc, source)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, source)
    raise QuantizationError(
        f"{source}: quant_method={qc.get('quant_method')!r} is not supported (supported: gptq, awq, fp8, "
        "compressed-tensors)")


def _field(qc: dict[str, Any], source: str, name: str, default: object, kinds: tuple[type, ...]) -> Any:
    value = qc.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise QuantizationError(f"{source}: {name}={value!r} is invalid (expected {'/'.join(k.__name__ for k in kinds)})")
    return value


def _group_size(qc: dict[str, Any], source: str) -> int | None:
    g = _field(qc, source, "group_size", 128, (int,))
    if g == -1 or g == 0:
        return None  # per output channel
    if g < 1 or g & (g - 1) or g < 16:
        raise QuantizationError(f"{source}: group_size={g} is not supported (supported: -1 (per-channel), "
                                "or a power of two >= 16: 32, 64, 128, ...)")
    return g


def _parse_gptq(qc: dict[str, Any], source: str) -> QuantConfig:
    bits = _field(qc, source, "bits", 4, (int,))
    if bits not in (4, 8):
        raise QuantizationError(f"{source}: bits={bits} is not supported for GPTQ (supported: 4, 8)")
    fmt = str(_field(qc, source, "checkpoint_format", "gptq", (str,))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"{source}: checkpoint_format={fmt!r} is not supported (supported: gptq, gptq_v2)")
    if _field(qc, source, "lm_head", False, (bool,)):
        raise QuantizationError(f"{source}: lm_head=true (a quantized LM head) is not supported")
    return QuantConfig(
        "gptq", bits=bits, group_size=_group_size(qc, source),
        desc_act=_field(qc, source, "desc_act", False, (bool,)), sym=_field(qc, source, "sym", True, (bool,)),
        zero_offset=1 if fmt == "gptq" else 0,
        skip_modules=tuple(_field(qc, source, "modules_to_not_convert", [], (list,))), source=source)


def _parse_awq(qc: dict[str, Any], source: str) -> QuantConfig:
    bits = _field(qc, source, "bits", qc.get("w_bit", 4), (int,))
    if bits != 4:
        raise QuantizationError(f"{source}: bits={bits} is not supported for AWQ (supported: 4)")
    version = str(_field(qc, source, "version", "gemm", (str,))).lower()
    if version != "gemm":
        raise QuantizationError(f"{source}: version={version!r} is not supported (supported: gemm, AWQ's default)")
    zero_point = _field(qc, source, "zero_point", True, (bool,))
    group = _group_size({"group_size": qc.get("group_size", qc.get("q_group_size", 128))}, source)
    return QuantConfig("awq", bits=4, group_size=group, sym=not zero_point,
                       skip_modules=tuple(_field(qc, source, "modules_to_not_convert", [], (list,))), source=source)


def _parse_fp8(qc: dict[str, Any], source: str) -> QuantConfig:
    if qc.get("weight_block_size"):
        raise QuantizationError(f"{source}: weight_block_size={qc['weight_block_size']} (block-wise FP8 scales) is "
                                "not supported; per-tensor and per-channel weight_scale are")
    scheme = str(_field(qc, source, "activation_scheme", "dynamic", (str,))).lower()
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"{source}: activation_scheme={scheme!r} is invalid (expected dynamic or static)")
    fmt = str(_field(qc, source, "fmt", "e4m3", (str,))).lower()
    if fmt != "e4m3":
        raise QuantizationError(f"{source}: fmt={fmt!r} is not supported (supported: e4m3)")
    return QuantConfig("fp8", bits=8, group_size=None, sym=True,
                       skip_modules=tuple(_field(qc, source, "ignored_layers", [], (list,))), source=source)


def _parse_compressed_tensors(qc: dict[str, Any], source: str) -> QuantConfig:
    """compressed-tensors (llm-compressor) checkpoints: one config group of FP8 `float-quantized`
    weights, or of 4/8-bit `pack-quantized` integer weights (W4A16 / W8A16, groups or channels)."""
    fmt = str(qc.get("format", ""))
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(f"{source}: compressed-tensors with {len(groups)} config groups is not supported "
                                "(supported: one group)")
    group = next(iter(groups.values()))
    fmt = str(group.get("format") or fmt)
    w = group.get("weights") or {}
    targets = group.get("targets") or []
    if targets and targets != ["Linear"]:
        raise QuantizationError(f"{source}: compressed-tensors targets={targets} are not supported (supported: Linear)")
    if group.get("input_activations") and fmt == "pack-quantized":
        raise QuantizationError(f"{source}: compressed-tensors quantized input activations with integer weights "
                                "are not supported (supported: weight-only W4A16 / W8A16)")
    ignore = tuple(qc.get("ignore") or ())
    if fmt in ("float-quantized", "naive-quantized") and w.get("type") == "float":
        if w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel"):
            raise QuantizationError(f"{source}: compressed-tensors float weights {{num_bits: {w.get('num_bits')}, "
                                    f"strategy: {w.get('strategy')!r}}} are not supported (supported: 8 bits, "
                                    "tensor or channel)")
        return QuantConfig("fp8", bits=8, group_size=None, sym=True, skip_modules=ignore, source=source)
    if fmt != "pack-quantized" or w.get("type") != "int":
        raise QuantizationError(f"{source}: compressed-tensors format={fmt!r} with {w.get('type')!r} weights is not "
                                "supported (supported: float-quantized FP8, pack-quantized int)")
    bits = w.get("num_bits")
    if bits not in (4, 8):
        raise QuantizationError(f"{source}: compressed-tensors weights num_bits={bits!r} is not supported "
                                "(supported: 4, 8)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"{source}: compressed-tensors weights strategy={strategy!r} is not supported "
                                "(supported: group, channel)")
    group_size = _group_size({"group_size": w.get("group_size")}, source) if strategy == "group" else None
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", False):
        raise QuantizationError(f"{source}: compressed-tensors weights actorder={actorder!r} is not supported")
    return QuantConfig("compressed-tensors", bits=bits, group_size=group_size, desc_act=actorder == "group",
                       sym=bool(w.get("symmetric", True)), skip_modules=ignore, source=source)


def startup_summary(model_id: str | None, option: str | None) -> str:
    """What the start-up log says about the weights' format, before the engine loads them.

    Known now for a local model dir (its config.json); a hub or s3:// model is checked when fetched.
    """
    if model_id is None:  # the embedded default model: fp32 weights
        if option in (None, "none", "fp8"):
            return "unquantized (the embedded default model)" if option != "fp8" else "fp8 e4m3, quantized at load"
        return f"option.quantize={option}, but the embedded default model is not quantized: the start will fail"
    path = Path(model_id)
    if not (path / "config.json").is_file():
        return f"option.quantize={option or 'unset'}; the checkpoint's quantization_config is checked when it is fetched"
    try:
        quant = resolve_quantization(path, read_json_object(path / "config.json"), option)
    except (QuantizationError, ValueError) as exc:
        return f"the model will not load: {exc}"
    return "unquantized" if quant is None else f"{quant.describe()} (from {quant.source})"
