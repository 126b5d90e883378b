"""The table of configuration keys the container understands (LMI names -> our settings).

One row per key: its serving.properties name (env `OPTION_FOO` maps to `option.foo`), vLLM-name
aliases, the `ServingConfig` / `EngineConfig` field it sets, a parser that raises `ValueError`,
and the "accepts" text used in start-up error messages. `serving/server/settings/config.py` applies it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.server.settings.adapter_allowlist import OPTION as ALLOWLIST_OPTION
from serving.server.settings.adapter_allowlist import parse_allowlist
from serving.engine_config import normalize_dtype
from serving.checkpoint.quantization import QUANTIZE_ACCEPTS, parse_quantize_option
from serving.speculative_config import SpeculativeConfig


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable and what it accepts."""


class _FieldDefault:
    """The `Key.default` of a key whose unset value is its target field's own default."""

    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT = _FieldDefault()
"""Unset -> the `ServingConfig` / `EngineConfig` field's default, so each default is written once,
on the dataclass (`config.key_default` reads it). Only a key whose unset value differs from its
field's (the container's choice differs from the offline `LLM`'s, or "auto" is resolved at start)
gives `default=` in the table, with a comment saying why."""


@dataclass(frozen=True)
class Key:
    """One configuration key: where it is read from, how it is parsed, what it sets."""

    name: str
    target: str  # ServingConfig field, or "engine.<EngineConfig field>"
    parse: Callable[[str], object]
    accepts: str
    default: object = FIELD_DEFAULT
    aliases: tuple[str, ...] = ()


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError("")


def _optional_bool(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else _bool(text)


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < lo or (hi is not None and value > hi):
            raise ValueError("")
        return value
    return parse


def _float(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        if value != value or value < lo or value > hi or (lo_open and value == lo):
            raise ValueError("")
        return value
    return parse


def _choice(*options: str, lower: bool = True) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower() if lower else text.strip()
        if value not in options:
            raise ValueError("")
        return value
    return parse


def _str(text: str) -> str:
    return text.strip()


def _tp(text: str) -> int | str:
    value = text.strip().lower()
    if value == "max":
        return "max"
    return _int(1)(value)


def _auto_int(lo: int, hi: int) -> Callable[[str], int | None]:
    """"auto" (None: resolved at start) or an integer in [lo, hi]."""
    bounded = _int(lo, hi)

    def parse(text: str) -> int | None:
        return None if text.strip().lower() == "auto" else bounded(text)
    return parse


def _optional_int(lo: int) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        return None if text.strip().lower() in ("none", "auto") else _int(lo)(text)
    return parse


# The server's default for max_prefill_tokens_while_decoding (offline it is off): while streams are
# decoding, a step takes at most this many prompt tokens, so prompts arriving together cannot make
# one long step that every stream waits on (at an H100's ~760 TFLOP/s, 2,048 prompt tokens of an
# 8B model are ~40 ms of compute, 256 about 5 ms: near the ridge where a step's GEMMs turn from
# reading weights to computing, so such a step costs ~1.5x a decode step). Once the decode-interval
# tail was gone, the steps carrying prompts set the inter-token p99 (bench/RESULTS.md run 17):
# 512 gave 2.7-2.8x p50, 256 2.3-2.4x, with TTFT p99 still 2.5-2.8x p50. With such steps captured whole
# (run 18: mixed-step graphs), 256 measured 1.86-2.42x, TTFT p99 2.3-2.8x p50.
PREFILL_TOKENS_WHILE_DECODING = 256
# The server's default for distributed_executor_backend on GPUs when the engine shares the HTTP
# process (option.engine_process=false; offline `LLM`: "uni" for one rank): the model's host work
# (step inputs, graph launches) runs in its own process, so it never waits for the GIL that every
# streaming HTTP thread takes once per token. A fresh 8B server at 16 req/s measured TPOT p50
# 12.0 -> 8.3 ms and ITL p99 32.5 -> 16.4 ms with it (bench/RESULTS.md run 16). With the whole engine
# in its own process (option.engine_process, the default for several copies) it is "mp" too: with "uni"
# each copy's engine core ran scheduling, detokenization and the model's host work on one thread and sat
# at 100 % of a core at saturation (bench/RESULTS.md run 22).
SERVER_EXECUTOR_BACKEND = "mp"
CHAT_TEMPLATE_MAX_BYTES = 256 * 1024  # the largest hub chat templates are ~20 KB
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # not in a text file


class ChatTemplate(str):
    """A checked Jinja chat template; `origin` is the file it was read from, or 'inline'.

    The start-up log shows `origin` and the length, never the text.
    """

    origin: str

    def __new__(cls, text: str, origin: str = "inline") -> ChatTemplate:
        obj = super().__new__(cls, text)
        obj.origin = origin
        return obj

    def __getnewargs__(self) -> tuple[str, str]:  # copy / pickle keep the origin
        return str(self), self.origin


def _chat_template(text: str) -> ChatTemplate:
    """A path to a Jinja file (read now), or an inline Jinja template; either must be a chat template.

    A file must be a regular UTF-8 text file of at most `CHAT_TEMPLATE_MAX_BYTES`; the template
    must parse as Jinja and use `messages`. Errors about a file never quote what it holds (it may
    be any file this process can read): a syntax error gives its line only.
    """
    value = text.strip()
    path = Path(value).expanduser()
    if len(value) < 4096 and "\n" not in value and path.exists():
        if not path.is_file():
            raise ValueError(f"{path} is not a regular file")
        try:
            with path.open("rb") as f:
                data = f.read(CHAT_TEMPLATE_MAX_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"{path} cannot be read: {exc.strerror}") from None
        if len(data) > CHAT_TEMPLATE_MAX_BYTES:
            raise ValueError(f"{path} is larger than {CHAT_TEMPLATE_MAX_BYTES // 1024} KiB: not a chat template")
        try:
            source = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text: not a chat template") from None
        if _CONTROL_CHARS.search(source):
            raise ValueError(f"{path} holds control characters: not a text file")
        return ChatTemplate(_check_jinja(source, str(path)), str(path))
    if "{{" in value or "{%" in value:
        return ChatTemplate(_check_jinja(value, "inline"))
    raise ValueError(f"{value[:200]!r} is neither an existing file nor a Jinja template ({{{{ ... }}}} / {{% ... %}})")


def _check_jinja(source: str, origin: str) -> str:
    """`source` if it parses as a Jinja chat template (as transformers compiles it) using `messages`."""
    import jinja2
    import jinja2.meta
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` block (only parsed here)."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    what = "the inline template" if origin == "inline" else origin
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        detail = f": {exc.message}" if origin == "inline" else ""  # never echo a file's text
        raise ValueError(f"{what} is not a valid Jinja template (syntax error at line {exc.lineno}{detail})") from None
    if "messages" not in jinja2.meta.find_undeclared_variables(ast):
        raise ValueError(f"{what} does not use `messages`: not a chat template")
    return source


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def _load_format(text: str) -> str:
    value = _choice("auto", "dummy", "safetensors", "pt")(text)
    return "dummy" if value == "dummy" else "auto"


KEYS: tuple[Key, ...] = (
    Key("option.model_id", "model_id", _str, "a hub id (org/name), s3://bucket/prefix or a local directory"),
    Key("option.revision", "revision", _str, "a hub branch, tag or commit"),
    Key("hf_token", "hf_token", _str, "a Hugging Face access token"),
    Key("port", "port", _int(1, 65535), "an integer port 1..65535"),
    # LMI's default is every visible GPU ("max", resolved at start); the offline LLM's is vLLM's 1.
    Key("option.tensor_parallel_degree", "engine.tensor_parallel_size", _tp, "a positive integer or max", "max",
        ("option.tensor_parallel_size",)),
    Key("option.rolling_batch", "rolling_batch",
        _choice("auto", "vllm", "lmi-dist", "scheduler", "disable", "deepspeed", "trtllm", "tnx"),
        "auto|vllm|lmi-dist|scheduler|disable|deepspeed|trtllm|tnx"),
    Key("option.max_rolling_batch_size", "engine.max_num_seqs", _int(1), "a positive integer",
        aliases=("option.max_num_seqs",)),
    Key("option.max_rolling_batch_prefill_tokens", "engine.max_num_batched_tokens", _optional_int(1),
        "a positive integer", aliases=("option.max_num_batched_tokens",)),
    Key("option.dtype", "engine.dtype", normalize_dtype, "auto|fp32|fp16|bf16 (or float32|float16|bfloat16)"),
    Key("option.max_model_len", "engine.max_model_len", _optional_int(1), "a positive integer"),
    Key("option.gpu_memory_utilization", "engine.gpu_memory_utilization", _float(0.0, 1.0, lo_open=True),
        "a number in (0, 1]"),
    Key("option.enforce_eager", "engine.enforce_eager", _bool, "true|false"),
    Key("option.disable_custom_all_reduce", "engine.disable_custom_all_reduce", _bool, "true|false"),
    Key("option.async_scheduling", "engine.async_scheduling", _optional_bool, "auto|true|false"),
    Key("option.distributed_executor_backend", "engine.distributed_executor_backend", _choice("mp", "uni"),
        "mp|uni"),
    Key("option.enable_prefix_caching", "engine.enable_prefix_caching", _bool, "true|false"),
    Key("option.enable_chunked_prefill", "engine.enable_chunked_prefill", _bool, "true|false"),
    Key("option.long_prefill_token_threshold", "engine.long_prefill_token_threshold", _int(0),
        "a non-negative integer (0: off)"),
    # Unset: the server's default, resolved at start (PREFILL_TOKENS_WHILE_DECODING with chunked prefill);
    # the offline LLM's is 0 (off).
    Key("option.max_prefill_tokens_while_decoding", "engine.max_prefill_tokens_while_decoding", _optional_int(0),
        f"a non-negative integer (0: off; unset: {PREFILL_TOKENS_WHILE_DECODING} with chunked prefill)", None),
    # The server serves first come, first served (streams are judged by latency); the offline LLM's None
    # fills decode steps on a GPU (EngineConfig.makespan_target).
    Key("option.makespan_step_tokens", "engine.makespan_step_tokens", _int(0),
        "a non-negative integer (0: off, the server's FCFS)", 0),
    Key("option.block_size", "engine.block_size", _int(1, 1024), "a positive integer <= 1024"),
    Key("option.kv_cache_memory_gb", "engine.kv_cache_memory_gb", _float(0.0, 1e6, lo_open=True),
        "a positive number of GB (CPU KV cache budget)"),
    Key("option.num_gpu_blocks_override", "engine.num_gpu_blocks_override", _optional_int(1),
        "a positive integer"),
    Key("option.device", "engine.device", _choice("auto", "cpu", "cuda"), "auto|cpu|cuda"),
    Key("option.seed", "engine.seed", _int(0), "a non-negative integer"),
    Key("option.load_format", "engine.load_format", _load_format, "auto|safetensors|pt|dummy"),
    Key("option.max_logprobs", "engine.max_logprobs", _int(0, 100), "an integer 0..100"),
    Key("option.guided_decoding_compile_timeout", "engine.guided_decoding_compile_timeout", _float(0.1, 3600.0),
        "seconds in [0.1, 3600]"),
    Key("option.guided_decoding_max_bytes", "engine.guided_decoding_max_bytes", _int(1, 1 << 30),
        "a positive number of bytes"),
    Key("option.guided_decoding_cache_mb", "engine.guided_decoding_cache_mb", _int(1, 1 << 20),
        "a positive number of MiB"),
    Key("option.tokenizer", "engine.tokenizer", _str, "a tokenizer id or path"),
    Key("option.speculative_config", "engine.speculative_config", _speculative_config,
        'a JSON object of vLLM\'s speculative_config names, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}'),
    # LMI's draft-model names; `serving/server/settings/config.py` folds them into engine.speculative_config.
    Key("option.speculative_draft_model", "speculative_draft_model", _str,
        "a draft checkpoint (directory or Hub id) with the model's vocabulary", None),  # no field: folded
    Key("option.speculative_length", "speculative_length", _int(1, 16),
        "an integer 1..16 (draft tokens proposed per step)", None),  # no field: folded
    Key("option.enable_lora", "engine.enable_lora", _bool, "true|false"),
    Key("option.max_loras", "engine.max_loras", _int(1, 1024), "an integer 1..1024 (adapters on the device at once)"),
    Key("option.max_lora_rank", "engine.max_lora_rank", _int(1, 1024), "an integer 1..1024 (the largest LoRA rank)"),
    Key("option.max_cpu_loras", "engine.max_cpu_loras", _optional_int(1),
        "a positive integer >= option.max_loras (adapters kept in host memory), or none"),
    Key(ALLOWLIST_OPTION, "runtime_adapter_sources", parse_allowlist,
        "a comma-separated list of absolute directories and/or s3://bucket/prefix the adapter management API may "
        "load from (unset: that API is off)"),
    Key("option.lora_extra_vocab_size", "lora_extra_vocab_size", _int(0, 1 << 20), "a non-negative integer"),
    Key("option.trust_remote_code", "trust_remote_code", _bool, "true|false"),
    Key("option.quantize", "engine.quantization", parse_quantize_option,
        f"{QUANTIZE_ACCEPTS}; unset: what the checkpoint's quantization_config says", aliases=("option.quantization",)),
    Key("option.enable_streaming", "enable_streaming", _choice("true", "false", "huggingface"),
        "true|false|huggingface"),
    Key("option.output_formatter", "output_formatter",
        _choice("json", "jsonlines", "sse", "json_chat", "jsonlines_chat", "none"),
        "json|jsonlines|sse|json_chat|jsonlines_chat|none"),
    Key("option.tgi_compat", "tgi_compat", _bool, "true|false"),
    Key("option.chat_template", "chat_template", _chat_template,
        "a Jinja chat template file (UTF-8, at most 256 KiB) or an inline template, using `messages`"),
    # Unset: derived from option.model_id at start (the field's default names the embedded model).
    Key("option.served_model_name", "served_model_name", _str, "a model name for the /v1 routes", None),
    Key("option.model_loading_timeout", "model_loading_timeout", _float(1.0, 1e7), "seconds (a positive number)"),
    Key("option.predict_timeout", "predict_timeout", _float(1.0, 1e7), "seconds (a positive number)"),
    Key("job_queue_size", "job_queue_size", _int(1, 100000), "an integer 1..100000"),
    Key("chunked_read_timeout", "chunked_read_timeout", _float(1.0, 1e7), "seconds (a positive number)"),
    Key("plain_heartbeat", "plain_heartbeat", _bool, "true|false"),
    Key("write_timeout", "write_timeout", _float(1.0, 3600.0), "seconds in [1, 3600]"),
    Key("max_request_size", "max_request_size", _int(1), "a positive number of bytes"),
    Key("option.s3_endpoint_url", "s3_endpoint_url", _str, "an http(s) URL of an S3 API"),
    Key("download_dir", "download_dir", _str, "a directory for downloaded models"),
    Key("compat_200_errors", "compat_200_errors", _bool, "true|false"),
    Key("fail_fast", "fail_fast", _bool, "true|false"),
    # Unset: auto, resolved at start (on for several model copies).
    Key("option.engine_process", "engine_process", _optional_bool, "auto|true|false", None),
    Key("max_workers", "max_workers", _int(1, 1024), "a positive integer (model copies)"),
    # HTTP frontends (gunicorn workers) over the shared engine cores; auto: settings/config.py `auto_frontends`.
    Key("option.frontends", "frontends", _auto_int(1, 64), "auto|an integer 1..64", aliases=("frontends",)),
    Key("option.prefix_affinity", "prefix_affinity", _bool, "true|false"),
    Key("threads", "threads", _int(0, 4096), "an integer 0..4096 (0 = automatic)"),
    Key("graceful_timeout", "graceful_timeout", _float(0.0, 30.0), "seconds in [0, 30]"),
)

# TGI / SageMaker names that LMI's entrypoint translates, each only when the LMI name is unset.
TGI_ALIASES: dict[str, tuple[str, Callable[[str], str]]] = {
    "HF_MODEL_QUANTIZE": ("OPTION_QUANTIZE", str),
    "HF_MODEL_TRUST_REMOTE_CODE": ("OPTION_TRUST_REMOTE_CODE", str),
    "SM_NUM_GPUS": ("TENSOR_PARALLEL_DEGREE", str),
    "MAX_CONCURRENT_REQUESTS": ("SERVING_JOB_QUEUE_SIZE", str),
    "MAX_BATCH_PREFILL_TOKENS": ("OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS", str),
    "MAX_BATCH_SIZE": ("OPTION_MAX_ROLLING_BATCH_SIZE", str),
    "ENABLE_CUDA_GRAPHS": ("OPTION_ENFORCE_EAGER", lambda v: "false" if v.strip().lower() == "true" else "true"),
    "CUDA_MEMORY_FRACTION": ("OPTION_GPU_MEMORY_UTILIZATION", str),
}

# LMI keys that are valid there but change nothing here: accepted and logged, never "unknown".
IGNORED_KEYS: dict[str, str] = {
    "engine": "one engine serves every model here (no Python/MPI choice)",
    "option.mpi_mode": "no MPI: each tensor-parallel rank is a process spawned by the worker (torch.distributed)",
    "option.entryPoint": "custom handlers (model.py) are not executed",
    "option.task": "only text generation is served",
    "option.parallel_loading": "weights load once, in the engine thread",
    "option.draft_model_tp_size": "the draft model runs on rank 0's device only (it is small: a copy on "
                                  "every rank would cost memory everywhere for no speed)",
    "features": "set by the LMI image; not used",
    "load_models": "one model is served: set HF_MODEL_ID / option.model_id",
    "model_store": "the model comes from option.model_id or /opt/ml/model",
    "inference_address": "the port comes from SAGEMAKER_BIND_TO_PORT (default 8080)",
    "management_address": "the management API (/models/{model}/adapters) shares the inference port",
    "wait_model_loading": "/ping answers 503 until the model is ready",
    "retry_threshold": "the engine is not restarted; /ping fails once it is dead",
    "min_workers": "model copies are fixed at start (SERVING_MAX_WORKERS, else GPUs / tensor_parallel_degree)",
    "minWorkers": "one worker process owns the accelerator",
    "maxWorkers": "one worker process owns the accelerator",
    "batch_size": "requests are batched continuously by the engine",
    "max_batch_delay": "requests are batched continuously by the engine",
    "max_idle_time": "requests are batched continuously by the engine",
    "allow_multi_status": "/ping is 503 / 200 / 500 only",
    "health_check_override": "/ping always reflects the engine state",
    "backport_for_non_streaming_http_error_codes": "HTTP error codes are the default here",
}

ROLLING_BATCH_MEANING: dict[str, str] = {
    "auto": "continuous batching on this server's paged-attention engine (LMI would pick lmi-dist)",
    "vllm": "served by this server's engine, which follows vLLM's options and sampling semantics",
    "lmi-dist": "treated as vllm: served by this server's engine (no MPI)",
    "scheduler": "served by this server's continuous-batching engine",
    "disable": "LMI's dynamic batching; here requests still share this engine's continuous batch, "
               "and list inputs are answered as lists",
    "deepspeed": "not available (removed in LMI 0.28); served by this server's engine",
    "trtllm": "TensorRT-LLM is not in this image; served by this server's engine",
    "tnx": "transformers-neuronx is not in this image; served by this server's engine",
}
