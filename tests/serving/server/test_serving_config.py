"""load_config: LMI precedence, name mapping, TGI aliases, and every invalid-value message."""

import logging
import os
import re

import pytest

from serving.server.settings.serving_config import ConfigError, load_config, log_config, read_properties
from serving.server.settings.config_keys import KEYS


def test_defaults_serve_the_embedded_model():
    cfg = load_config({}, [])
    assert cfg.engine.model is None and cfg.port == 8080 and cfg.job_queue_size == 1000
    assert cfg.engine.max_num_seqs == 256 and cfg.engine.gpu_memory_utilization == 0.9
    assert cfg.served_model_name == "SmolLM2-135M-Instruct" and cfg.rolling_batch == "auto"
    assert cfg.predict_timeout == 240 and cfg.model_loading_timeout == 1200


def test_seed_env_from_the_sagemaker_article():
    env = {"HF_MODEL_ID": "microsoft/Phi-3-mini-4k-instruct", "OPTION_ROLLING_BATCH": "vllm",
           "TENSOR_PARALLEL_DEGREE": "max", "OPTION_MAX_ROLLING_BATCH_SIZE": "2", "OPTION_DTYPE": "fp16"}
    cfg = load_config(env, [], gpu_count=lambda: 4)
    assert cfg.engine.model == "microsoft/Phi-3-mini-4k-instruct" and cfg.engine.tensor_parallel_size == 4
    assert cfg.engine.max_num_seqs == 2 and cfg.engine.dtype == "float16" and cfg.rolling_batch == "vllm"
    assert cfg.served_model_name == "microsoft/Phi-3-mini-4k-instruct"
    assert cfg.sources["engine.max_num_seqs"] == "env OPTION_MAX_ROLLING_BATCH_SIZE"
    assert load_config({"TENSOR_PARALLEL_DEGREE": "max"}, [], gpu_count=lambda: 0).engine.tensor_parallel_size == 1


def test_properties_file_wins_over_env(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("# comment\nengine=Python\noption.model_id = /models/x\noption.max_rolling_batch_size=64\n"
                     "option.rolling_batch: lmi-dist\njob_queue_size 7\n")
    env = {"OPTION_MAX_ROLLING_BATCH_SIZE": "2", "OPTION_DTYPE": "bf16", "HF_MODEL_ID": "org/m"}
    cfg = load_config(env, [tmp_path / "missing.properties", props])
    assert cfg.engine.max_num_seqs == 64 and cfg.engine.model == "/models/x" and cfg.job_queue_size == 7
    assert cfg.engine.dtype == "bfloat16" and cfg.rolling_batch == "lmi-dist"
    assert cfg.sources["engine.max_num_seqs"] == str(props) and cfg.properties_path == str(props)


def test_properties_in_local_model_dir_are_found(tmp_path):
    (tmp_path / "serving.properties").write_text("option.max_model_len=512\n")
    cfg = load_config({"HF_MODEL_ID": str(tmp_path)})
    assert cfg.engine.max_model_len == 512


def test_option_mapping_and_vllm_aliases():
    cfg = load_config({"OPTION_MAX_NUM_SEQS": "3", "OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "1024",
                       "OPTION_ENFORCE_EAGER": "true", "OPTION_ENABLE_PREFIX_CACHING": "false",
                       "OPTION_GPU_MEMORY_UTILIZATION": "0.5", "OPTION_MAX_MODEL_LEN": "4096",
                       "OPTION_TGI_COMPAT": "true", "OPTION_OUTPUT_FORMATTER": "jsonlines",
                       "OPTION_CHAT_TEMPLATE": "{{ messages }}", "OPTION_ENABLE_STREAMING": "true",
                       "SERVING_JOB_QUEUE_SIZE": "9", "OPTION_PREDICT_TIMEOUT": "30",
                       "OPTION_MODEL_LOADING_TIMEOUT": "60", "SAGEMAKER_BIND_TO_PORT": "9001",
                       "HF_MODEL_REVISION": "v2", "HF_TOKEN": "secret"}, [])
    e = cfg.engine
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.enforce_eager, e.enable_prefix_caching,
            e.gpu_memory_utilization, e.max_model_len) == (3, 1024, True, False, 0.5, 4096)
    assert cfg.tgi_compat and cfg.output_formatter == "jsonlines" and cfg.chat_template == "{{ messages }}"
    assert (cfg.job_queue_size, cfg.predict_timeout, cfg.model_loading_timeout, cfg.port) == (9, 30, 60, 9001)
    assert cfg.revision == "v2" and e.revision == "v2" and cfg.hf_token == "secret" and "secret" not in repr(cfg)


def test_executor_backend_is_worker_processes_on_gpus_unless_set():
    """The server runs the model in its own process on GPUs (off the HTTP threads' GIL); on the
    CPU one rank stays in-process; TP always uses processes; an explicit value wins."""
    backend = lambda env, gpus: load_config(env, [], gpu_count=lambda: gpus).engine.distributed_executor_backend  # noqa: E731
    assert backend({}, 1) == "mp" and backend({}, 0) == "uni"
    assert backend({"TENSOR_PARALLEL_DEGREE": "2"}, 0) == "mp"
    assert backend({"OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "uni"}, 1) == "uni"
    assert backend({"OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "MP"}, 0) == "mp"
    with pytest.raises(ConfigError, match="DISTRIBUTED_EXECUTOR_BACKEND=.ray. is invalid: accepts mp|uni"):
        backend({"OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "ray"}, 1)
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 needs 'mp'"):
        backend({"OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "uni", "TENSOR_PARALLEL_DEGREE": "2"}, 2)


def test_engine_process_is_auto_on_for_gpus_and_several_copies_with_the_model_in_worker_processes_on_gpus():
    cfg = lambda env, gpus: load_config(env, [], gpu_count=lambda: gpus)  # noqa: E731
    one_gpu = cfg({}, 1)  # one copy on a GPU: its engine core behind several HTTP frontends (overload, /ping)
    assert one_gpu.engine_process is True and one_gpu.frontends == max(1, min(3, (os.cpu_count() or 1) // 2))
    assert cfg({}, 0).engine_process is False and cfg({}, 0).frontends == 1  # CPU: engine thread in the one process
    assert cfg({"OPTION_ENGINE_PROCESS": "false"}, 1).frontends == 1
    on = cfg({"OPTION_ENGINE_PROCESS": "true"}, 1)
    assert on.engine_process is True and on.engine.distributed_executor_backend == "mp"  # model host work apart
    assert cfg({"OPTION_ENGINE_PROCESS": "true", "OPTION_DEVICE": "cpu"}, 1).engine.distributed_executor_backend == "uni"
    assert cfg({"OPTION_ENGINE_PROCESS": "true", "TENSOR_PARALLEL_DEGREE": "2"}, 2).engine.distributed_executor_backend == "mp"
    copies = cfg({"TENSOR_PARALLEL_DEGREE": "1"}, 4)  # 4 copies, each engine in its own process with its rank
    assert copies.model_copies == 4 and copies.engine_process is True
    assert copies.engine.distributed_executor_backend == "mp"
    assert copies.copy_devices() == [("cuda:0",), ("cuda:1",), ("cuda:2",), ("cuda:3",)]
    assert "auto" in copies.sources["engine_process"]
    threads = cfg({"TENSOR_PARALLEL_DEGREE": "2", "OPTION_ENGINE_PROCESS": "false"}, 4)
    assert threads.model_copies == 2 and threads.engine_process is False
    assert threads.copy_devices() == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]


def test_max_workers_sets_the_model_copies_on_cpu_and_gpus():
    cfg = lambda env, gpus: load_config(env, [], gpu_count=lambda: gpus)  # noqa: E731
    cpu = cfg({"SERVING_MAX_WORKERS": "2", "OPTION_DEVICE": "cpu"}, 4)
    assert cpu.model_copies == 2 and cpu.engine_process is True and cpu.copy_devices() == [("cpu",), ("cpu",)]
    assert cfg({"SERVING_MAX_WORKERS": "1", "TENSOR_PARALLEL_DEGREE": "1"}, 4).copy_devices() == [("cuda:0",)]
    assert cfg({"SERVING_MAX_WORKERS": "1"}, 4).engine_process is True  # on GPUs: an engine core, several frontends
    assert cfg({"SERVING_MAX_WORKERS": "1", "OPTION_DEVICE": "cpu"}, 0).engine_process is False
    with pytest.raises(ConfigError, match=r"SERVING_MAX_WORKERS.*max_workers=3 model copies of "
                                          r"tensor_parallel_degree=2 need 6 GPUs; 4 are visible"):
        cfg({"SERVING_MAX_WORKERS": "3", "TENSOR_PARALLEL_DEGREE": "2"}, 4)
    with pytest.raises(ConfigError, match="SERVING_MAX_WORKERS='0' is invalid"):
        cfg({"SERVING_MAX_WORKERS": "0"}, 0)


def test_rank_devices_is_the_one_layout_of_copies_and_ranks():
    from serving.engine_config import EngineConfig

    two = EngineConfig(tensor_parallel_size=2)
    assert two.rank_devices(0) == ("cpu", "cpu") and two.rank_devices(0, copy=3) == ("cpu", "cpu")
    assert two.rank_devices(4, copy=1) == ("cuda:2", "cuda:3")
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=2 \(from device 2\) exceeds the 3 visible GPUs"):
        two.rank_devices(3, copy=1)


def test_async_scheduling_is_auto_unless_set():
    assert load_config({}, []).engine.async_scheduling is None
    assert load_config({"OPTION_ASYNC_SCHEDULING": "true"}, []).engine.async_scheduling is True
    assert load_config({"OPTION_ASYNC_SCHEDULING": "false"}, []).engine.async_scheduling is False
    assert load_config({"OPTION_ASYNC_SCHEDULING": "auto"}, []).engine.async_scheduling is None


def test_prefill_tokens_while_decoding_server_default_follows_chunked_prefill():
    from serving.server.settings.config_keys import PREFILL_TOKENS_WHILE_DECODING
    from serving.engine_config import EngineConfig

    assert EngineConfig().max_prefill_tokens_while_decoding == 0  # offline: off
    assert EngineConfig().long_prefill_token_threshold == 0  # vLLM's option, off as in vLLM
    cfg = load_config({}, [])
    assert cfg.engine.max_prefill_tokens_while_decoding == PREFILL_TOKENS_WHILE_DECODING > 0
    assert cfg.engine.long_prefill_token_threshold == 0
    off = load_config({"OPTION_ENABLE_CHUNKED_PREFILL": "false"}, [])
    assert off.engine.max_prefill_tokens_while_decoding == 0 and not off.engine.enable_chunked_prefill
    env = {"OPTION_MAX_PREFILL_TOKENS_WHILE_DECODING": "0", "OPTION_LONG_PREFILL_TOKEN_THRESHOLD": "512"}
    cfg = load_config(env, [])
    assert (cfg.engine.max_prefill_tokens_while_decoding, cfg.engine.long_prefill_token_threshold) == (0, 512)
    for name in ("OPTION_MAX_PREFILL_TOKENS_WHILE_DECODING", "OPTION_LONG_PREFILL_TOKEN_THRESHOLD"):
        with pytest.raises(ConfigError, match="needs chunked prefill"):
            load_config({name: "64", "OPTION_ENABLE_CHUNKED_PREFILL": "false"}, [])


def test_makespan_scheduling_is_on_offline_on_a_gpu_only():
    from serving.engine_config import MAKESPAN_STEP_TOKENS, EngineConfig

    assert EngineConfig().makespan_target("cuda") == MAKESPAN_STEP_TOKENS > 0
    assert EngineConfig().makespan_target("cpu") == 0  # compute-bound at any step size: nothing to fill
    assert EngineConfig(enable_chunked_prefill=False).makespan_target("cuda") == 0
    assert EngineConfig(makespan_step_tokens=0).makespan_target("cuda") == 0
    assert EngineConfig(makespan_step_tokens=96).makespan_target("cpu") == 96
    with pytest.raises(ValueError, match="makespan_step_tokens must be a non-negative integer"):
        EngineConfig(makespan_step_tokens=-1)
    cfg = load_config({}, [])  # the server: FCFS (streams are judged by their latency)
    assert cfg.engine.makespan_step_tokens == 0 and cfg.engine.makespan_target("cuda") == 0
    assert load_config({"OPTION_MAKESPAN_STEP_TOKENS": "192"}, []).engine.makespan_target("cuda") == 192
    with pytest.raises(ConfigError, match="needs chunked prefill"):
        load_config({"OPTION_MAKESPAN_STEP_TOKENS": "64", "OPTION_ENABLE_CHUNKED_PREFILL": "false"}, [])


def test_chat_template_from_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_config({"OPTION_CHAT_TEMPLATE": str(f)}, []).chat_template.startswith("{% for")


def test_tgi_aliases_apply_only_when_lmi_name_is_unset():
    env = {"MAX_BATCH_SIZE": "5", "MAX_BATCH_PREFILL_TOKENS": "999", "MAX_CONCURRENT_REQUESTS": "11",
           "SM_NUM_GPUS": "2", "ENABLE_CUDA_GRAPHS": "true", "CUDA_MEMORY_FRACTION": "0.7",
           "HF_MODEL_TRUST_REMOTE_CODE": "true"}
    cfg = load_config(env, [])
    assert (cfg.engine.max_num_seqs, cfg.engine.max_num_batched_tokens, cfg.job_queue_size,
            cfg.engine.tensor_parallel_size, cfg.engine.enforce_eager, cfg.engine.gpu_memory_utilization,
            cfg.trust_remote_code) == (5, 999, 11, 2, False, 0.7, True)
    assert "TGI alias" in cfg.sources["engine.max_num_seqs"]
    assert load_config({"ENABLE_CUDA_GRAPHS": "false"}, []).engine.enforce_eager is True
    cfg = load_config({**env, "OPTION_MAX_ROLLING_BATCH_SIZE": "8"}, [])
    assert cfg.engine.max_num_seqs == 8


def test_hf_model_id_beats_option_model_id():
    assert load_config({"HF_MODEL_ID": "a/b", "OPTION_MODEL_ID": "c/d"}, []).model_id == "a/b"
    assert load_config({"OPTION_MODEL_ID": "c/d"}, []).model_id == "c/d"


@pytest.mark.parametrize("rb", ["auto", "vllm", "lmi-dist", "scheduler", "disable", "deepspeed", "trtllm", "tnx"])
def test_every_rolling_batch_is_served_and_explained(rb, caplog):
    cfg = load_config({"OPTION_ROLLING_BATCH": rb.upper()}, [])
    with caplog.at_level(logging.INFO, logger="serving.server.settings.serving_config"):
        log_config(cfg)
    assert f"option.rolling_batch={rb}:" in caplog.text and "option.max_rolling_batch_size" in caplog.text


def test_unknown_keys_warn(caplog, tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.bogus=1\noption.entryPoint=model.py\n")
    with caplog.at_level(logging.INFO, logger="serving.server.settings.serving_config"):
        load_config({"OPTION_NOT_A_THING": "1"}, [props])
    assert "unknown setting option.not_a_thing (env OPTION_NOT_A_THING)" in caplog.text
    assert "unknown setting option.bogus" in caplog.text
    assert "option.entryPoint=model.py" in caplog.text and "not executed" in caplog.text


INVALID = [
    ("OPTION_MAX_ROLLING_BATCH_SIZE", "zero", "a positive integer"),
    ("OPTION_MAX_ROLLING_BATCH_SIZE", "0", "a positive integer"),
    ("OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS", "-3", "a positive integer"),
    ("OPTION_DTYPE", "fp8", "auto|fp32|fp16|bf16"),
    ("OPTION_MAX_MODEL_LEN", "1.5", "a positive integer"),
    ("OPTION_GPU_MEMORY_UTILIZATION", "1.5", "a number in (0, 1]"),
    ("OPTION_GPU_MEMORY_UTILIZATION", "0", "a number in (0, 1]"),
    ("OPTION_ENFORCE_EAGER", "maybe", "true|false"),
    ("OPTION_ASYNC_SCHEDULING", "sometimes", "auto|true|false"),
    ("OPTION_ENABLE_PREFIX_CACHING", "2", "true|false"),
    ("OPTION_ENABLE_STREAMING", "yes please", "true|false|huggingface"),
    ("OPTION_OUTPUT_FORMATTER", "xml", "json|jsonlines|sse"),
    ("OPTION_TGI_COMPAT", "sure", "true|false"),
    ("OPTION_CHAT_TEMPLATE", "/no/such/file.jinja", "a Jinja chat template file (UTF-8, at most 256 KiB)"),
    ("OPTION_TRUST_REMOTE_CODE", "perhaps", "true|false"),
    ("OPTION_ROLLING_BATCH", "turbo", "auto|vllm|lmi-dist|scheduler|disable"),
    ("TENSOR_PARALLEL_DEGREE", "all", "a positive integer or max"),
    ("TENSOR_PARALLEL_DEGREE", "0", "a positive integer or max"),
    ("SERVING_JOB_QUEUE_SIZE", "-1", "an integer 1..100000"),
    ("OPTION_PREDICT_TIMEOUT", "soon", "seconds"),
    ("OPTION_MODEL_LOADING_TIMEOUT", "0", "seconds"),
    ("SAGEMAKER_BIND_TO_PORT", "70000", "an integer port 1..65535"),
    ("OPTION_QUANTIZE", "int3", "none|gptq|awq|fp8"),
    ("MAX_BATCH_SIZE", "many", "a positive integer"),
    ("SM_NUM_GPUS", "x", "a positive integer or max"),
    ("CUDA_MEMORY_FRACTION", "2", "a number in (0, 1]"),
    ("MAX_CONCURRENT_REQUESTS", "0", "an integer 1..100000"),
    ("SERVING_GRACEFUL_TIMEOUT", "60", "seconds in [0, 30]"),
    ("OPTION_ENABLE_LORA", "yes please", "true|false"),
    ("OPTION_MAX_LORAS", "0", "an integer 1..1024"),
    ("OPTION_MAX_LORA_RANK", "sixteen", "an integer 1..1024"),
    ("OPTION_MAX_CPU_LORAS", "-1", "a positive integer >= option.max_loras"),
    ("OPTION_LORA_EXTRA_VOCAB_SIZE", "-5", "a non-negative integer"),
]


@pytest.mark.parametrize("name, value, accepts", INVALID)
def test_invalid_values_fail_naming_variable_and_accepted_values(name, value, accepts):
    with pytest.raises(ConfigError) as err:
        load_config({name: value}, [])
    msg = str(err.value)
    assert msg.startswith(f"{name}={value!r}") and f"accepts {accepts}" in msg


def test_invalid_value_in_properties_names_the_file(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.dtype=int4\n")
    with pytest.raises(ConfigError, match=r"option.dtype='int4' in .*serving.properties is invalid: accepts auto"):
        load_config({}, [props])


def test_every_key_has_accepts_text_and_a_parsable_default():
    for key in KEYS:
        assert key.accepts and key.name


def test_the_table_restates_no_field_default():
    """A table `default=` is written only where the container's unset value differs from the field's."""
    import dataclasses

    from serving.engine_config import EngineConfig
    from serving.server.settings.serving_config import ServingConfig, key_default
    from serving.server.settings.config_keys import FIELD_DEFAULT

    def field_default(target):
        cls, name = (EngineConfig, target[len("engine."):]) if target.startswith("engine.") else (ServingConfig, target)
        return {f.name: f.default for f in dataclasses.fields(cls)}.get(name, dataclasses.MISSING)

    explicit = {k.name for k in KEYS if k.default is not FIELD_DEFAULT}
    assert explicit == {"option.tensor_parallel_degree", "option.max_prefill_tokens_while_decoding",
                        "option.makespan_step_tokens", "option.served_model_name", "option.engine_process",
                        # LMI's draft-model keys set no field: they are folded into engine.speculative_config
                        "option.speculative_draft_model", "option.speculative_length"}
    for key in KEYS:
        if field_default(key.target) is dataclasses.MISSING:
            assert key.name in explicit, key.name  # a key that sets no field says its own default
        elif key.name in explicit:
            assert key.default != field_default(key.target), key.name  # else it restates the field
        else:
            assert key_default(key) == field_default(key.target), key.name
    cfg = load_config({"OPTION_DEVICE": "cpu"}, [])  # unset keys resolve to the fields' defaults
    assert cfg.engine.max_num_seqs == EngineConfig().max_num_seqs and cfg.engine.block_size == EngineConfig().block_size
    assert cfg.threads == 0 and cfg.runtime_adapter_sources == () and cfg.engine.makespan_step_tokens == 0


def test_read_properties_continuations(tmp_path):
    p = tmp_path / "s.properties"
    p.write_text("a=1\n! bang comment\nb = two \\\n  words\nc:3\n")
    assert read_properties(p) == {"a": "1", "b": "two words", "c": "3"}


def _props(tmp_path, text: str) -> dict[str, str]:
    p = tmp_path / "serving.properties"
    p.write_bytes(text.encode("utf-8"))
    return read_properties(p)


def test_read_properties_java_escapes(tmp_path):
    # What java.util.Properties.load(Reader) gives for each line (checked against its documented grammar).
    text = (
        "option.chat_template={{ '\\u4f60\\u597d' }}\n"      # \uXXXX -> the character
        "raw=你好 😀\n"                                       # raw UTF-8, as DJL reads the file
        "pair=\\uD83D\\uDE00\n"                               # a UTF-16 surrogate pair -> one character
        "key\\=with\\:seps = v\n"                             # escaped separators stay in the key
        "key\\ space:x\n"                                     # an escaped space too
        "tabs=a\\tb\\nc\\rd\\fe\n"                            # \t \n \r \f
        "other=\\q\\#\\!\\\\\n"                               # backslash + any other char -> that char
        "win=crlf\r\n"                                        # CRLF and CR line ends
        "mac=cr\r"
        "spaced   :   v2\n"                                   # whitespace around the separator
        "bare key\n"                                          # whitespace alone separates
        "novalue\n"                                           # a key alone -> ""
        "   # indented comment\n"
        "trail=kept\\ \n"                                     # an escaped trailing space is kept
        "cont=one, \\\n    two, \\\\\n"                       # odd backslashes continue; even ones do not
        "after=x\n"
        "# comment \\\n"                                      # a comment never continues
        "next=y\n"
        "odd=a\\\\\\\n   b\n"                                 # three backslashes: \ then a continuation
    )
    assert _props(tmp_path, text) == {
        "option.chat_template": "{{ '你好' }}", "raw": "你好 😀", "pair": "😀", "key=with:seps": "v",
        "key space": "x", "tabs": "a\tb\nc\rd\fe", "other": "q#!\\", "win": "crlf", "mac": "cr",
        "spaced": "v2", "bare": "key", "novalue": "", "trail": "kept ", "cont": "one, two, \\",
        "after": "x", "next": "y", "odd": "a\\b"}


def test_read_properties_continuation_at_end_of_file(tmp_path):
    assert _props(tmp_path, "a=1 \\") == {"a": "1"}  # the line ends with the file
    assert _props(tmp_path, "a=1\\\n") == {"a": "1"}


def test_read_properties_bad_unicode_escape_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"serving.properties.*malformed \\uXXXX escape '\\\\u12g4'"):
        _props(tmp_path, "a=\\u12g4\n")


def test_lora_keys_lmi_defaults_env_and_properties(tmp_path, caplog):
    e = load_config({}, []).engine
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (False, 4, 16, None)
    assert load_config({}, []).lora_extra_vocab_size == 256
    cfg = load_config({"OPTION_ENABLE_LORA": "true", "OPTION_MAX_LORAS": "16", "OPTION_MAX_LORA_RANK": "64",
                       "OPTION_MAX_CPU_LORAS": "32", "OPTION_LORA_EXTRA_VOCAB_SIZE": "512"}, [])
    e = cfg.engine
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (True, 16, 64, 32)
    assert cfg.sources["engine.max_loras"] == "env OPTION_MAX_LORAS" and cfg.lora_extra_vocab_size == 512
    with caplog.at_level(logging.INFO, logger="serving.server.settings.serving_config"):
        log_config(cfg)
    assert "LoRA adapters enabled: 16 on the device at once, 32 kept in host memory, rank <= 64" in caplog.text
    assert "option.lora_extra_vocab_size=512 (env OPTION_LORA_EXTRA_VOCAB_SIZE) accepted and has no effect" \
        in caplog.text
    assert "unknown setting" not in caplog.text and "not supported yet" not in caplog.text
    props = tmp_path / "serving.properties"
    props.write_text("option.enable_lora=true\noption.max_loras=2\noption.max_cpu_loras=none\n")
    e = load_config({"OPTION_MAX_LORAS": "8"}, [props]).engine
    assert (e.enable_lora, e.max_loras, e.max_cpu_loras) == (True, 2, None)


def test_max_cpu_loras_below_max_loras_names_both():
    with pytest.raises(ConfigError, match=r"env OPTION_MAX_CPU_LORAS: option.max_cpu_loras=2 is less than "
                                          r"option.max_loras=4 \(default\)"):
        load_config({"OPTION_MAX_CPU_LORAS": "2"}, [])


def test_properties_file_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "serving.properties"
    p.write_bytes(b"option.model_id=caf\xe9\noption.dtype=fp16\n")  # Latin-1, as some editors save it
    with pytest.raises(ConfigError, match=rf"{re.escape(str(p))} is not UTF-8 text \(byte 19"):
        load_config({}, [p])


def test_frontends_are_one_per_copy_at_most_half_the_cpus_and_need_engine_cores():
    from serving.server.settings.serving_config import auto_frontends

    cfg = lambda env, gpus: load_config(env, [], gpu_count=lambda: gpus)  # noqa: E731
    assert [auto_frontends(copies, True, 64) for copies in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert [auto_frontends(copies, True, 64, on_gpus=True) for copies in (1, 2, 4, 8)] == [3, 3, 4, 8]
    assert auto_frontends(1, True, 4, on_gpus=True) == 2  # still at most half the CPUs
    assert auto_frontends(4, True, 4) == 2 and auto_frontends(4, True, 1) == 1  # half the CPUs, at least one
    assert auto_frontends(4, False, 64) == 1  # engines in the HTTP process: one process holds them
    assert cfg({}, 0).frontends == 1 and "auto" in cfg({}, 0).sources["frontends"]
    assert cfg({}, 1).frontends == max(1, min(3, (os.cpu_count() or 1) // 2))  # one copy on a GPU
    assert cfg({"SERVING_FRONTENDS": "3", "SERVING_MAX_WORKERS": "2", "OPTION_DEVICE": "cpu"}, 0).frontends == 3
    assert cfg({"OPTION_FRONTENDS": "2", "OPTION_ENGINE_PROCESS": "true"}, 1).frontends == 2  # one core, 2 frontends
    with pytest.raises(ConfigError, match="frontends=2 needs the engine in processes of its own"):
        cfg({"SERVING_FRONTENDS": "2", "OPTION_ENGINE_PROCESS": "false"}, 1)
    with pytest.raises(ConfigError, match="SERVING_FRONTENDS='0' is invalid: accepts auto|an integer 1..64"):
        cfg({"SERVING_FRONTENDS": "0"}, 1)
    assert cfg({"SERVING_FRONTENDS": "2"}, 1).frontends == 2  # auto engine process on a GPU: allowed


def test_resolved_config_crosses_exec_as_json_and_is_parsed_once_per_process_tree():
    """container/serve -> RESOLVED_ENV -> gunicorn.conf (arbiter) parses; the forked worker reuses it."""
    import os

    from serving.server.settings import serving_config as config_module

    env = {"HF_MODEL_ID": "org/m", "OPTION_MAX_ROLLING_BATCH_SIZE": "8", "OPTION_DEVICE": "cpu",
           "OPTION_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'}
    resolved = load_config(env, [])
    handed = {config_module.RESOLVED_ENV: config_module.resolved_to_env(resolved)}
    arbiter = config_module.config_from_env(handed)
    assert arbiter == resolved and arbiter.engine.speculative_config == resolved.engine.speculative_config
    assert arbiter.sources["engine.max_num_seqs"] == "env OPTION_MAX_ROLLING_BATCH_SIZE"
    parsed = config_module._parse_resolved.cache_info().misses
    pid = os.fork()
    if pid == 0:  # the worker: the same object, no second parse
        same = config_module.config_from_env(dict(handed)) is arbiter
        os._exit(0 if same and config_module._parse_resolved.cache_info().misses == parsed else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
