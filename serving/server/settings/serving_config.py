"""The container's configuration: LMI env vars + serving.properties -> one frozen `ServingConfig`.

`load_config(environ, properties_paths)` is the only reader of the environment (it is passed in;
nothing else in `serving/` reads `os.environ`). Precedence is LMI's: defaults < environment
(`OPTION_FOO` -> `option.foo`, `SERVING_FOO` -> `foo`, `HF_MODEL_ID`, `TENSOR_PARALLEL_DEGREE`,
TGI aliases) < `serving.properties` (the file wins). Keys, parsers and targets live in the table
in `serving/server/settings/config_keys.py`; each resolved value remembers where it came from for the start log.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from serving.server.settings.config_keys import (
    FIELD_DEFAULT,
    IGNORED_KEYS,
    KEYS,
    PREFILL_TOKENS_WHILE_DECODING,
    SERVER_EXECUTOR_BACKEND,
    ROLLING_BATCH_MEANING,
    TGI_ALIASES,
    ConfigError,
    Key,
)
from serving.engine_config import EngineConfig
from serving.checkpoint.quantization import startup_summary
from serving.speculative_config import SpeculativeConfig

logger = logging.getLogger("serving.server.settings.serving_config")

OPT_ML_MODEL = "/opt/ml/model"
PROPERTIES_NAME = "serving.properties"
# Env vars the LMI image / SageMaker set or that we read elsewhere by name: never "unknown".
_ENV_DIRECT = {
    "HF_MODEL_ID": "option.model_id",
    "HF_REVISION": "option.revision",
    "HF_MODEL_REVISION": "option.revision",  # TGI's name; LMI reads HF_REVISION only
    "TENSOR_PARALLEL_DEGREE": "option.tensor_parallel_degree",
    "PREDICT_TIMEOUT": "option.predict_timeout",
    "MODEL_LOADING_TIMEOUT": "option.model_loading_timeout",
    "SAGEMAKER_BIND_TO_PORT": "port",
    "AWS_ENDPOINT_URL_S3": "option.s3_endpoint_url",
    "HF_TOKEN": "hf_token",
}
# Lower number wins when two env names map to the same key (HF_MODEL_ID beats OPTION_MODEL_ID,
# as in DJL where HF_MODEL_ID writes the synthetic serving.properties).
_ENV_RANK = {"HF_MODEL_ID": 0, "HF_REVISION": 0, "TENSOR_PARALLEL_DEGREE": 0, "HF_MODEL_REVISION": 2}


@dataclass(frozen=True)
class ServingConfig:
    """Everything the container needs, resolved once at start (engine options use vLLM names).

    `engine.model` is None for the embedded default model and otherwise the *source* string
    (hub id, s3:// URI or local path); `serving/server/settings/model_fetch.py` turns it into a local dir.
    """

    engine: EngineConfig
    model_id: str | None = None
    revision: str | None = None
    hf_token: str | None = field(default=None, repr=False)
    port: int = 8080
    rolling_batch: str = "auto"
    job_queue_size: int = 1000
    predict_timeout: float = 240.0
    model_loading_timeout: float = 1200.0
    chunked_read_timeout: float = 60.0
    # A non-streamed answer still running after min(15 s, chunked_read_timeout / 4) commits 200 and sends a
    # space every such period (for proxies that cut idle connections); off: its status waits for its result.
    plain_heartbeat: bool = False
    max_request_size: int = 6 * 1024 * 1024  # SageMaker's InvokeEndpoint body limit
    write_timeout: float = 30.0  # a client that takes no byte for this long is cut off (its request aborted)
    output_formatter: str | None = None
    tgi_compat: bool = False
    chat_template: str | None = None
    served_model_name: str = "SmolLM2-135M-Instruct"
    enable_streaming: str = "false"
    trust_remote_code: bool = False
    s3_endpoint_url: str | None = None
    download_dir: str = "/tmp/open-lmi/download"
    compat_200_errors: bool = False
    fail_fast: bool = False
    # The engine (scheduler, model, detokenizer) in a process of its own, off the HTTP threads' GIL
    # (serving/engine/engine_process.py). Resolved at start ("auto" in the table): on for several model
    # copies (each copy's engine in its own process, so N engines never share one GIL), off for one,
    # where on an 8B server at 8 and 16 req/s it measured the same as the default (model work in a
    # worker process, option.distributed_executor_backend=mp).
    engine_process: bool = False
    # Model copies asked for (LMI's SERVING_MAX_WORKERS); None: visible GPUs // tensor_parallel_degree, 1 on CPU.
    max_workers: int | None = None
    # HTTP frontends (gunicorn workers), each a client of every engine core (needs engine_process);
    # resolved at start (None: "auto", see `auto_frontends`).
    frontends: int | None = None
    # Several copies: send a prompt whose first tokens a copy saw before to that copy (its prefix cache).
    prefix_affinity: bool = True
    threads: int = 0  # gunicorn threads; 0 -> job_queue_size + headroom (capped)
    graceful_timeout: float = 25.0
    # Where the adapter management API may load adapters from (adapter_allowlist.py); empty: that API is off.
    runtime_adapter_sources: tuple[str, ...] = ()
    lora_extra_vocab_size: int = 256  # LMI / vLLM: accepted, logged; adapters adding tokens are refused
    # Engine copies behind the endpoint: max_workers, else visible GPUs // tensor_parallel_degree (1 on CPU).
    model_copies: int = 1
    gpu_count: int = 0  # visible GPUs at start (0: the engine runs on the CPU)
    properties_path: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def copy_devices(self) -> list[tuple[str, ...]]:
        """The devices of each model copy (`EngineConfig.rank_devices`, on the GPUs counted at start)."""
        return [self.engine.rank_devices(self.gpu_count, c) for c in range(self.model_copies)]

    @property
    def gunicorn_threads(self) -> int:
        """Threads for the one gthread worker: every open stream holds one, /ping needs spare."""
        return self.threads or min(self.job_queue_size + 16, 1024)


def default_properties_paths(environ: Mapping[str, str], cwd: str | Path = ".") -> list[Path]:
    """Where LMI looks for serving.properties: the local model dir, /opt/ml/model, the cwd."""
    paths: list[Path] = []
    for name in ("HF_MODEL_ID", "OPTION_MODEL_ID"):
        value = environ.get(name, "").strip()
        if value and not value.startswith("s3://") and Path(value).is_dir():
            paths.append(Path(value) / PROPERTIES_NAME)
    paths.append(Path(OPT_ML_MODEL) / PROPERTIES_NAME)
    paths.append(Path(cwd) / PROPERTIES_NAME)
    return paths


_PROPS_WS = " \t\f"
_SURROGATE = re.compile("[\ud800-\udfff]")
_PROPS_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _logical_lines(text: str) -> Iterable[str]:
    """Java's logical lines: a line ending in an odd number of backslashes continues on the next
    (whose leading whitespace is dropped); comment and blank lines are skipped."""
    pending: str | None = None
    for natural in re.split(r"\r\n|\r|\n", text):
        line = natural.lstrip(_PROPS_WS)
        if pending is None and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            pending = (pending or "") + line[:-1]
            continue
        yield (pending or "") + line
        pending = None
    if pending:  # a continuation at the end of the file: the line just ends there
        yield pending


def _unescape_props(s: str, where: str) -> tuple[str, int]:
    """Java escapes (\\t \\n \\r \\f, \\uXXXX, \\<any char> -> that char) -> (text, length of text
    up to its last escaped or non-whitespace character), so trailing plain whitespace can be cut."""
    out: list[str] = []
    keep = 0
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            nxt = s[i + 1]
            if nxt == "u":
                hex4 = s[i + 2:i + 6]
                if len(hex4) != 4 or not all(h in "0123456789abcdefABCDEF" for h in hex4):
                    raise ConfigError(f"{where}: malformed \\uXXXX escape {s[i:i + 6]!r}")
                out.append(chr(int(hex4, 16)))
                i += 6
            else:
                out.append(_PROPS_ESCAPES.get(nxt, nxt))
                i += 2
            keep = len(out)
            continue
        out.append(c)
        if c not in _PROPS_WS:
            keep = len(out)
        i += 1
    text = "".join(out)
    if _SURROGATE.search(text):  # \uD83D\uDE00: a UTF-16 pair is one character, as in Java's strings
        pairs = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        keep -= len(text) - len(pairs)
        text = pairs
    return text, keep


def _split_key(line: str) -> tuple[str, str]:
    """A logical line -> (raw key, raw value): the key ends at the first unescaped '=', ':' or
    whitespace; then whitespace, at most one '=' or ':', and whitespace again precede the value."""
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            i += 2
            continue
        if c in "=:" or c in _PROPS_WS:
            break
        i += 1
    key, rest = line[:i], line[i:]
    rest = rest.lstrip(_PROPS_WS)
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(_PROPS_WS)
    return key, rest


def read_properties(path: Path) -> dict[str, str]:
    """Parse a Java .properties file as `java.util.Properties.load(Reader)` does (UTF-8, as DJL
    reads it): `key=value`, `key: value` or `key value`; `#` / `!` comment lines; a line ending in
    an odd number of backslashes continues on the next; escapes `\\uXXXX`, `\\t \\n \\r \\f`, and a
    backslash before any other character (`\\=`, `\\:`, `\\ `, `\\#`, `\\\\`) stands for that
    character, in keys and values. One difference, on purpose: trailing unescaped whitespace of a
    value is dropped (Java keeps it; `fp16 ` is never what anyone meant). A malformed `\\u` escape
    is a ConfigError naming the file and line, a file that is not UTF-8 one naming the file."""
    out: dict[str, str] = {}
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                          "save serving.properties as UTF-8") from None
    for n, line in enumerate(_logical_lines(text), 1):
        raw_key, raw_value = _split_key(line)
        where = f"{path} (entry {n})"
        key, _ = _unescape_props(raw_key, where)
        value, keep = _unescape_props(raw_value, where)
        out[key] = value[:keep]
    return out


def _env_to_key(name: str) -> str | None:
    """DJL's mapping: OPTION_FOO -> option.foo, OPTION_ENGINE -> engine, SERVING_FOO -> foo."""
    if name in _ENV_DIRECT:
        return _ENV_DIRECT[name]
    for prefix, target in (("OPTION_", "option."), ("SERVING_", "")):
        if name.startswith(prefix) and len(name) > len(prefix):
            suffix = name[len(prefix):]
            if name == "OPTION_ENGINE":
                return "engine"
            if name == "OPTION_ENTRYPOINT":
                return "option.entryPoint"
            if re.fullmatch(r"[A-Z_\d]+", suffix):
                suffix = suffix.lower()
            return target + suffix
    return None


def _collect_env(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """env -> {key: (raw value, source)} with LMI's entrypoint TGI translations applied."""
    env = {k: v for k, v in environ.items() if isinstance(v, str) and v.strip() != ""}
    labelled: dict[str, tuple[str, str]] = {}
    for tgi_name, (lmi_name, transform) in TGI_ALIASES.items():
        if tgi_name in env and lmi_name not in env:
            labelled[lmi_name] = (transform(env[tgi_name]), f"env {tgi_name} (TGI alias of {lmi_name})")
    for name, value in env.items():
        if name not in TGI_ALIASES:
            labelled[name] = (value, f"env {name}")
    out: dict[str, tuple[str, str]] = {}
    ranks: dict[str, int] = {}
    for name, (value, source) in sorted(labelled.items()):
        key = _env_to_key(name)
        if key is None:
            continue
        rank = _ENV_RANK.get(name, 1)
        if key in out and ranks[key] <= rank:
            continue
        out[key] = (value.strip(), source)
        ranks[key] = rank
    return out


def _lookup(raw: Mapping[str, tuple[str, str]], key: Key) -> tuple[str, str] | None:
    for name in (key.name, *key.aliases):
        if name in raw:
            return raw[name]
    return None


def key_default(key: Key) -> object:
    """What an unset key resolves to: the table's `default`, else its target field's own default."""
    if key.default is not FIELD_DEFAULT:
        return key.default
    cls, name = (EngineConfig, key.target.removeprefix("engine.")) if key.target.startswith("engine.") else (
        ServingConfig, key.target)
    found = next(f for f in dataclasses.fields(cls) if f.name == name)
    assert found.default is not dataclasses.MISSING, f"{key.name}: {cls.__name__}.{name} has no plain default"
    return found.default


def _count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no driver: CPU
        return 0


def load_config(
    environ: Mapping[str, str],
    properties_paths: Iterable[str | Path] | None = None,
    *,
    gpu_count: Callable[[], int] = _count_gpus,
) -> ServingConfig:
    """Resolve the container configuration once; raise ConfigError naming the bad variable.

    Args:
        environ: the process environment (pass `os.environ`; tests pass a dict).
        properties_paths: candidate serving.properties files; the first that exists is read.
            None -> `default_properties_paths(environ)`.
        gpu_count: how `TENSOR_PARALLEL_DEGREE=max` learns the number of GPUs.
    """
    raw = _collect_env(environ)
    paths = default_properties_paths(environ) if properties_paths is None else [Path(p) for p in properties_paths]
    props_path = next((p for p in paths if p.is_file()), None)
    if props_path is not None:
        for key, value in read_properties(props_path).items():
            raw[key] = (value, f"{props_path}")  # the file wins over the environment

    known = {n for k in KEYS for n in (k.name, *k.aliases)}
    for key, (_, source) in sorted(raw.items()):
        if key in known or key in IGNORED_KEYS:
            continue
        if source.startswith("env SERVING_") and not key.startswith("option."):
            logger.info("ignoring global setting %s (%s): not used by this server", key, source)
        else:
            logger.warning("unknown setting %s (%s): ignored", key, source)
    for key, reason in IGNORED_KEYS.items():
        if key in raw:
            logger.info("%s=%s (%s) accepted; %s", key, raw[key][0], raw[key][1], reason)

    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for key in KEYS:
        hit = _lookup(raw, key)
        if hit is None:
            values[key.target] = key_default(key)
            sources[key.target] = "default"
            continue
        text, source = hit
        try:
            value = key.parse(text)
        except (ValueError, TypeError) as exc:
            raise ConfigError(_invalid_message(key, text, source, exc)) from None
        values[key.target] = value
        sources[key.target] = source
    return _build(values, sources, props_path, gpu_count)


RESOLVED_ENV = "OPEN_LMI_RESOLVED_CONFIG"
"""`container/serve` resolves the configuration once and hands it across its `exec` of gunicorn in
this variable (JSON), so the config file, the worker and the app never resolve it again. It is
parsed once: in the arbiter, by gunicorn.conf.py; the worker, forked from the arbiter, inherits
that parsed object (`config_from_env` returns it) and parses nothing."""


def resolved_to_env(config: ServingConfig) -> str:
    """The resolved configuration as the JSON value of `RESOLVED_ENV`."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(ServingConfig)}
    values["engine"] = dataclasses.asdict(config.engine)
    values["sources"] = dict(config.sources)
    return json.dumps(values)


def config_from_env(environ: Mapping[str, str]) -> ServingConfig:
    """The configuration `container/serve` resolved (`RESOLVED_ENV`), else `load_config(environ)`."""
    text = environ.get(RESOLVED_ENV)
    if not text:
        return load_config(environ)
    return _parse_resolved(text)


@functools.lru_cache(maxsize=1)
def _parse_resolved(text: str) -> ServingConfig:
    """`RESOLVED_ENV`'s JSON -> the frozen ServingConfig, once per text (a forked worker finds it parsed)."""
    values = json.loads(text)
    engine = EngineConfig(**values.pop("engine"))
    sources = MappingProxyType(values.pop("sources"))
    values["runtime_adapter_sources"] = tuple(values.get("runtime_adapter_sources", ()))  # JSON has lists
    return ServingConfig(engine=engine, sources=sources, **values)


# HTTP frontends for one copy on GPUs: one HTTP process at 5-6x an 8B copy's capacity was GIL-bound (no 503s,
# requests waiting unread ~20 s, or /ping stalls); three over one engine core shed the excess at once with /ping
# under 30 ms and 1.2-1.3x the output tokens/s (bench/RESULTS.md, one H100).
GPU_MIN_FRONTENDS = 3


def auto_frontends(copies: int, engine_process: bool, cpus: int, on_gpus: bool = False) -> int:
    """HTTP frontends for `frontends=auto`: one per model copy (one HTTP process routes ~1.7 copies'
    streams at most: bench/RESULTS.md) and at least `GPU_MIN_FRONTENDS` on GPUs, never more than half
    the CPUs (each busy frontend takes about one core, the cores' engines and rank processes need the
    rest); 1 with the engine in the HTTP process."""
    if not engine_process:
        return 1
    want = max(copies, GPU_MIN_FRONTENDS if on_gpus else 1)
    return max(1, min(want, cpus // 2))


def _build(values: dict[str, object], sources: dict[str, str], props_path: Path | None,
           gpu_count: Callable[[], int]) -> ServingConfig:
    engine_kwargs = {k.removeprefix("engine."): v for k, v in values.items() if k.startswith("engine.")}
    tensor_parallel_size = engine_kwargs["tensor_parallel_size"]
    on_cpu = engine_kwargs.get("device") == "cpu"
    gpus = 0 if on_cpu else gpu_count()
    if tensor_parallel_size == "max":
        tensor_parallel_size = engine_kwargs["tensor_parallel_size"] = max(1, gpus)
    if gpus and tensor_parallel_size > gpus:
        raise ConfigError(f"{_src(sources, 'engine.tensor_parallel_size')}: tensor_parallel_degree="
                          f"{tensor_parallel_size} exceeds the {gpus} visible GPU(s); use at most {gpus} (or max)")
    copies = max(1, gpus // tensor_parallel_size) if gpus else 1
    if values["max_workers"] is not None:
        if gpus and values["max_workers"] * tensor_parallel_size > gpus:
            raise ConfigError(f"{_src(sources, 'max_workers')}: max_workers={values['max_workers']} model copies of "
                              f"tensor_parallel_degree={tensor_parallel_size} need "
                              f"{values['max_workers'] * tensor_parallel_size} GPUs; {gpus} are visible")
        copies = values["max_workers"]
    if values["engine_process"] is None:  # auto: on GPUs, and for several copies, the engine in a process of its own
        values["engine_process"] = copies > 1 or gpus > 0
        sources["engine_process"] = "default (auto: on for GPUs and for several model copies)"
    if values.get("frontends") is None:
        values["frontends"] = auto_frontends(copies, bool(values["engine_process"]), os.cpu_count() or 1, gpus > 0)
        sources["frontends"] = (f"default (auto: one per model copy, at least {GPU_MIN_FRONTENDS} on GPUs, "
                                "at most half the CPUs)")
    elif values["frontends"] > 1 and not values["engine_process"]:
        raise ConfigError(f"{_src(sources, 'frontends')}: frontends={values['frontends']} needs the engine in "
                          "processes of its own: set OPTION_ENGINE_PROCESS=true (or leave frontends at auto)")
    lora_max, lora_cpu = engine_kwargs["max_loras"], engine_kwargs["max_cpu_loras"]
    if lora_cpu is not None and lora_cpu < lora_max:
        raise ConfigError(f"{_src(sources, 'engine.max_cpu_loras')}: option.max_cpu_loras={lora_cpu} is less than "
                          f"option.max_loras={lora_max} ({_src(sources, 'engine.max_loras')}): adapters on the "
                          "device are also kept in host memory, so use at least max_loras (or leave it unset)")
    if engine_kwargs["max_prefill_tokens_while_decoding"] is None:  # the server's default (see config_keys)
        engine_kwargs["max_prefill_tokens_while_decoding"] = (
            PREFILL_TOKENS_WHILE_DECODING if engine_kwargs["enable_chunked_prefill"] else 0)
    if engine_kwargs["distributed_executor_backend"] is None:  # the server's default (see config_keys)
        engine_kwargs["distributed_executor_backend"] = (
            SERVER_EXECUTOR_BACKEND if tensor_parallel_size > 1 or gpus else "uni")
    draft, length = values.pop("speculative_draft_model"), values.pop("speculative_length")
    try:  # LMI's draft-model names (config_keys) into vLLM's speculative_config
        engine_kwargs["speculative_config"] = SpeculativeConfig.from_lmi(draft, length,
                                                                         engine_kwargs["speculative_config"])
    except ValueError as exc:
        where = _src(sources, "speculative_draft_model" if draft is not None else "speculative_length")
        raise ConfigError(f"{where}: {exc}") from None
    model_id = values["model_id"]
    engine_kwargs["model"] = model_id
    engine_kwargs["revision"] = values["revision"]
    engine_kwargs["trust_remote_code"] = values["trust_remote_code"]
    try:
        engine = EngineConfig(**engine_kwargs)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"invalid engine option: {exc}") from None
    served = values["served_model_name"] or _default_served_name(model_id)  # type: ignore[arg-type]
    sources.setdefault("served_model_name", "default")
    if values["served_model_name"] is None:
        sources["served_model_name"] = "derived from option.model_id" if model_id else "default"
    server = {f.name: values[f.name] for f in dataclasses.fields(ServingConfig)
              if f.name in values and f.name not in ("engine", "served_model_name")}
    return ServingConfig(engine=engine, served_model_name=served, model_copies=copies, gpu_count=gpus,
                         properties_path=str(props_path) if props_path else None,
                         sources=MappingProxyType(dict(sources)), **server)  # type: ignore[arg-type]


def _invalid_message(key: Key, text: str, source: str, exc: Exception) -> str:
    """E.g. "OPTION_DTYPE='fp8' is invalid: accepts auto|fp32|..." (names the variable or file)."""
    if source.startswith("env "):
        name, _, note = source.removeprefix("env ").partition(" ")
        label = f"{name}={text!r}" + (f" {note}" if note else "")
    else:
        label = f"{key.name}={text!r} in {source}"
    detail = str(exc)
    if detail.startswith(("invalid literal", "could not convert")) or not detail:
        detail = ""
    return f"{label} is invalid: accepts {key.accepts}" + (f" ({detail})" if detail else "")


def _src(sources: Mapping[str, str], target: str) -> str:
    return sources.get(target, "default")


def _default_served_name(model_id: str | None) -> str:
    """vLLM serves a model under the id it was given; a local dir or s3 prefix under its name."""
    if not model_id:
        return "SmolLM2-135M-Instruct"
    if model_id.startswith("s3://") or model_id.startswith("/") or model_id.startswith("."):
        return Path(model_id.rstrip("/")).name or model_id
    return model_id


def describe(config: ServingConfig) -> list[tuple[str, str, str]]:
    """Rows (setting, value, source) of the resolved configuration, secrets masked."""
    rows: list[tuple[str, str, str]] = []
    for key in KEYS:
        target = key.target
        if target.startswith("engine."):
            value = getattr(config.engine, target.removeprefix("engine."))
        else:
            value = getattr(config, target, None)
        if target == "hf_token" and value:
            value = "***"
        if target == "chat_template" and value:  # where it came from, never its text
            value = f"{getattr(value, 'origin', 'inline')} ({len(value)} chars)"
        rows.append((key.name, str(value), config.sources.get(target, "default")))
    return rows


def log_config(config: ServingConfig, log: logging.Logger = logger) -> None:
    """Log the resolved settings as a table, and what the rolling_batch choice means here."""
    rows = describe(config)
    w1 = max(len(r[0]) for r in rows)
    w2 = min(max(len(r[1]) for r in rows), 48)
    lines = [f"{'setting':<{w1}}  {'value':<{w2}}  source", f"{'-' * w1}  {'-' * w2}  {'-' * 6}"]
    lines += [f"{a:<{w1}}  {b:<{w2}}  {c}" for a, b, c in rows]
    log.info("resolved configuration (%s):\n%s",
             config.properties_path or "no serving.properties", "\n".join(lines))
    log.info("option.rolling_batch=%s: %s", config.rolling_batch, ROLLING_BATCH_MEANING[config.rolling_batch])
    log.info("tensor parallelism: degree %d (one process per rank when > 1); %d model copies: %s",
             config.engine.tensor_parallel_size, config.model_copies,
             "; ".join(f"copy {c} on {','.join(d)}" for c, d in enumerate(config.copy_devices())))
    if config.trust_remote_code:
        log.warning("option.trust_remote_code=true accepted, but this server never executes model "
                    "repository code: models run on its own implementations (a model that needs custom "
                    "code is refused at load) and tokenizers on built-in transformers classes (an auto_map "
                    "in tokenizer_config.json is ignored; a tokenizer that exists only as repository code "
                    "is refused at load)")
    if config.enable_streaming != "false":
        log.info("option.enable_streaming=%s has no effect: requests stream with \"stream\": true, or "
                 "for every request with option.output_formatter=jsonlines", config.enable_streaming)
    _log_lora(config, log)
    log.info("weights: %s", startup_summary(config.engine.model, config.engine.quantization))
    if config.output_formatter == "json":
        log.info("option.output_formatter=json: per-request \"stream\": true is ignored (LMI behaviour)")


def _log_lora(config: ServingConfig, log: logging.Logger) -> None:
    """What the LoRA options do here (and that lora_extra_vocab_size changes nothing)."""
    engine = config.engine
    if engine.enable_lora:
        api = (f"more through POST /models/{config.served_model_name}/adapters from under "
               f"{', '.join(config.runtime_adapter_sources)}" if config.runtime_adapter_sources else
               "the adapter management API is off (OPTION_RUNTIME_ADAPTER_SOURCES unset: its routes answer 403)")
        log.info("LoRA adapters enabled: %d on the device at once, %d kept in host memory, rank <= %d; adapters "
                 "under <model dir>/adapters/<name>/ are registered before /ping answers 200; %s",
                 engine.max_loras, engine.num_cpu_loras, engine.max_lora_rank, api)
    if config.sources.get("lora_extra_vocab_size", "default") != "default":
        log.info("option.lora_extra_vocab_size=%d (%s) accepted and has no effect: adapters that add tokens to "
                 "the vocabulary (new embeddings or a trained lm_head) are refused when registered, whatever "
                 "its value (vLLM deprecated the option)", config.lora_extra_vocab_size,
                 config.sources["lora_extra_vocab_size"])
