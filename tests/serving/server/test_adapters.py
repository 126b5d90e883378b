"""LoRA adapters at the HTTP edge with the fake engine: which adapter a request names (custom
attribute, body `adapters`, /v1 `model`), the 404 with the known names, DJL's management API,
/v1/models, and adapter sources (start-up `adapters/` dirs, local and s3:// `src`)."""

import json
import logging
import shutil

import boto3
import pytest

from fake_engine_loop import FakeEngineLoop
from serving.server.settings.adapter_source import AdapterSourceError, fetch_adapter, find_adapters
from serving.server.settings.serving_config import load_config
from serving.server.settings.config_keys import ConfigError
from serving.server.adapter_journal import AdapterJournal
from serving.server.adapters import AdapterRegistry, StartupAdapterError, header_adapter
from serving.server.app import create_app

HEADER = "X-Amzn-SageMaker-Custom-Attributes"


def peft_dir(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return path


def make(tmp_path, lora=True, adapters=("a1", "a2"), **env):
    loop = FakeEngineLoop()
    env = {"OPTION_ENABLE_LORA": str(lora).lower(), "SERVING_DOWNLOAD_DIR": str(tmp_path / "dl"),
           "OPTION_SERVED_MODEL_NAME": "base", "OPTION_RUNTIME_ADAPTER_SOURCES": str(tmp_path), **env}
    app = create_app(loop, load_config(env, []))
    if lora:
        for name in adapters:
            app.extensions["adapters"].register(name, str(peft_dir(tmp_path / name)))
    return loop, app.test_client()


def test_header_parsing():
    assert header_adapter(None) is None and header_adapter("") is None and header_adapter("x=1;y") is None
    assert header_adapter("adapter=a1") == "a1"
    assert header_adapter(' x-trace = t ;  Adapter = "a1" ; other=2') == "a1"  # spaces, case, quotes
    assert header_adapter("adapter=") is None and header_adapter("adapter=a1;adapter=a1") == "a1"
    with pytest.raises(ValueError, match="more than one adapter"):
        header_adapter("adapter=a1;adapter=a2")


def test_each_way_of_naming_an_adapter(tmp_path):
    loop, client = make(tmp_path)
    r = client.post("/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}},
                    headers={HEADER: "x=1; adapter=a1"})
    assert r.json == {"generated_text": "ABC"} and loop.lora_names[-1] == "a1"
    r = client.post("/invocations", json={"inputs": "hi", "adapters": "a2", "parameters": {"max_new_tokens": 2}})
    assert r.json == {"generated_text": "AB"} and loop.lora_names[-1] == "a2"
    r = client.post("/invocations", json={"inputs": ["x", "y", "z"], "adapters": ["a1", "", "a2"],
                                          "parameters": {"max_new_tokens": 2}})
    assert [o["generated_text"] for o in r.json] == ["AB", "ab", "AB"] and loop.lora_names[-3:] == ["a1", None, "a2"]
    r = client.post("/invocations", json={"inputs": "x", "adapters": [], "parameters": {"max_new_tokens": 1}})
    assert r.json == {"generated_text": "a"} and loop.lora_names[-1] is None  # LMI: an empty list is none
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "adapters": ["a1"],
                                          "max_tokens": 2})
    assert r.json["choices"][0]["message"]["content"] == "AB" and loop.lora_names[-1] == "a1"
    r = client.post("/v1/completions", json={"model": "a2", "prompt": "hi", "max_tokens": 2})
    assert r.json["choices"][0]["text"] == "AB" and loop.lora_names[-1] == "a2"
    r = client.post("/v1/chat/completions", json={"model": "a1", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2, "stream": True})
    assert b'"content": "A"' in r.data and loop.lora_names[-1] == "a1"
    for base in ("base", None):  # the served name (or none) is the base model
        r = client.post("/v1/completions", json={"model": base, "prompt": "hi", "max_tokens": 2})
        assert r.json["choices"][0]["text"] == "ab" and loop.lora_names[-1] is None
    r = client.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2},
                    headers={HEADER: "adapter=a2"})  # the openai client always sends a model: the header decides
    assert r.json["choices"][0]["text"] == "AB" and loop.lora_names[-1] == "a2"
    r = client.post("/generate", json={"prompt": "hi", "max_tokens": 2}, headers={HEADER: "adapter=a1"})
    assert r.json == {"text": ["hiAB"]}


@pytest.mark.parametrize("path, body, headers, needle", [
    ("/invocations", {"inputs": "x", "adapters": "a2"}, {HEADER: "adapter=a1"}, "custom attribute names adapter 'a1'"),
    ("/invocations", {"inputs": ["x", "y"], "adapters": ["a1", ""]}, {HEADER: "adapter=a1"}, "'' (base)"),
    ("/invocations", {"inputs": ["x", "y"], "adapters": ["a1"]}, {}, "1 names for 2 inputs"),
    ("/invocations", {"inputs": "x", "adapters": ["a1", "a2"]}, {}, "2 names for a single input"),
    ("/invocations", {"inputs": "x", "adapters": 3}, {}, "adapters must be"),
    ("/invocations", {"inputs": "x"}, {HEADER: "adapter=a1;adapter=a2"}, "more than one adapter"),
    ("/v1/completions", {"model": "a2", "prompt": "x"}, {HEADER: "adapter=a1"}, "model field names 'a2'"),
])
def test_conflicts_and_bad_values_are_400(tmp_path, path, body, headers, needle):
    _, client = make(tmp_path)
    r = client.post(path, json=body, headers=headers)
    message = r.json["error"]["message"] if path.startswith("/v1") else r.json["error"]
    assert r.status_code == 400 and needle in message, message


def test_unknown_adapter_is_404_with_known_names_never_the_base(tmp_path):
    loop, client = make(tmp_path)
    for path, body, headers in [("/invocations", {"inputs": "x"}, {HEADER: "adapter=nope"}),
                                ("/invocations", {"inputs": ["x", "y"], "adapters": ["a1", "nope"]}, {}),
                                ("/v1/completions", {"model": "nope", "prompt": "x"}, {}),
                                ("/v1/chat/completions",
                                 {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, {})]:
        r = client.post(path, json=body, headers=headers)
        message = r.json["error"]["message"] if path.startswith("/v1") else r.json["error"]
        assert r.status_code == 404, (path, r.json)
        assert message.startswith("unknown adapter 'nope': no adapter of that name is registered"), message
        assert "a1" not in message and "a2" not in message  # one tenant never learns the others' names
    assert loop.lora_names == []  # nothing ran, on the base model or any other
    _, off = make(tmp_path / "off", lora=False)
    r = off.post("/v1/completions", json={"model": "llama-2-13b-chat-hf", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200  # LoRA off: /v1's model is accepted whatever it says, as before


def test_adapter_removed_after_the_check_is_still_404(tmp_path):
    loop, client = make(tmp_path)
    app_check = client.application.extensions["adapters"]
    loop.loras.pop("a1")  # the engine no longer has it (as if removed between the check and the submit)
    r = client.post("/invocations", json={"inputs": "x"}, headers={HEADER: "adapter=a1"})
    assert r.status_code == 404 and "unknown adapter 'a1'" in r.json["error"] and app_check.get("a1") is not None


def test_management_api(tmp_path):
    loop, client = make(tmp_path, adapters=())
    src = peft_dir(tmp_path / "new")
    r = client.post(f"/models/base/adapters?name=n1&src={src}")
    assert r.status_code == 200 and r.json == {"status": "Adapter n1 registered"} and "n1" in loop.loras
    assert loop.loras["n1"].lora_path == str(src) and loop.loras["n1"].lora_int_id == 1
    r = client.post("/adapters", json={"name": "n2", "src": str(src)})  # one model: no prefix; a JSON body
    assert r.status_code == 200 and loop.loras["n2"].lora_int_id == 2
    assert client.get("/models/base/adapters").json == {"adapters": [{"name": "n1", "src": str(src)},
                                                                     {"name": "n2", "src": str(src)}]}
    assert client.get("/adapters?limit=1").json == {"adapters": [{"name": "n1", "src": str(src)}], "nextPageToken": "1"}
    assert client.get("/adapters?limit=1&next_page_token=1").json["adapters"][0]["name"] == "n2"
    assert client.get("/models/base/adapters/n2").json == {"name": "n2", "src": str(src)}
    r = client.post("/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 1}},
                    headers={HEADER: "adapter=n2"})
    assert r.json == {"generated_text": "A"}
    ids = [c["id"] for c in client.get("/v1/models").json["data"]]
    assert ids == ["base", "n1", "n2"]
    assert client.get("/v1/models").json["data"][1]["parent"] == "base"
    r = client.delete("/models/base/adapters/n1")
    assert r.status_code == 200 and r.json == {"status": "Adapter n1 unregistered"} and "n1" not in loop.loras
    r = client.post("/invocations", json={"inputs": "x"}, headers={HEADER: "adapter=n1"})
    assert r.status_code == 404 and "unknown adapter 'n1'" in r.json["error"] and "n2" not in r.json["error"]
    assert client.get("/models").json == {"models": [{"modelName": "base", "modelUrl": "", "status": "READY"}]}


@pytest.mark.parametrize("method, path, status, needle", [
    ("POST", "/models/base/adapters?name=x", 400, "Parameter src is required"),
    ("POST", "/models/base/adapters?src=/tmp", 400, "Parameter name is required"),
    ("POST", "/models/base/adapters?name=bad;name&src=/tmp", 400, "invalid adapter name"),
    ("POST", "/models/base/adapters?name=base&src=/tmp", 400, "the base model's name"),
    ("POST", "/models/base/adapters?name=a1&src={tmp}/a2", 409, "already registered"),
    ("POST", "/models/base/adapters?name=z&src={tmp}/missing", 400, "is not a directory"),
    ("POST", "/models/base/adapters?name=z&src=https://x/y", 403, "not under any of the places "
                                                                    "OPTION_RUNTIME_ADAPTER_SOURCES"),
    ("POST", "/models/base/adapters?name=z&src=/tmp", 403, "'/tmp' is not under any of the places"),
    ("POST", "/models/base/adapters?name=z&src={tmp}/../x", 403, "is not under any of the places"),
    ("POST", "/models/other/adapters?name=z&src={tmp}/a2", 404, "The model other was not found"),
    ("GET", "/models/base/adapters/zz", 404, "The adapter zz was not found"),
    ("DELETE", "/adapters/zz", 404, "The adapter zz was not found"),
    ("GET", "/adapters?limit=x", 400, "limit and next_page_token must be integers"),
])
def test_management_errors(tmp_path, method, path, status, needle):
    _, client = make(tmp_path)
    r = client.open(path.format(tmp=tmp_path), method=method)
    assert r.status_code == status and needle in r.json["error"] and r.json["code"] == status, r.json


def test_management_when_lora_is_off_or_loading(tmp_path):
    loop, client = make(tmp_path, lora=False)
    r = client.post(f"/adapters?name=a&src={peft_dir(tmp_path / 'a')}")
    assert r.status_code == 400 and "LoRA is not enabled" in r.json["error"]
    assert client.get("/adapters").status_code == 400
    loop, client = make(tmp_path / "l", adapters=())
    loop.state = "loading"
    assert client.post(f"/adapters?name=a&src={tmp_path / 'a'}").status_code == 503


def test_find_adapters(tmp_path, caplog):
    assert find_adapters(tmp_path) == {} and find_adapters(None) == {}
    peft_dir(tmp_path / "adapters" / "b")
    peft_dir(tmp_path / "adapters" / "a")
    (tmp_path / "adapters" / ".hidden").mkdir()
    (tmp_path / "adapters" / "README").write_text("x")
    with caplog.at_level(logging.WARNING):
        assert list(find_adapters(tmp_path)) == ["a", "b"]
    assert "README is not a directory" in caplog.text
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(AdapterSourceError, match=r"adapter 'c': .* has no adapter_config.json or "
                                                 r"adapter_model.safetensors.*not adapter_model.bin"):
        fetch_adapter("c", str(tmp_path / "c"), tmp_path)


def test_startup_registration(tmp_path, caplog):
    peft_dir(tmp_path / "adapters" / "s1")
    loop = FakeEngineLoop()
    registry = AdapterRegistry(loop, load_config({"OPTION_ENABLE_LORA": "true"}, []))
    assert registry.register_startup(tmp_path) == ["s1"] and registry.get("s1").src == str(tmp_path / "adapters/s1")
    off = AdapterRegistry(FakeEngineLoop(), load_config({}, []))
    with caplog.at_level(logging.WARNING):
        assert off.register_startup(tmp_path) == []
    assert "ignored because LoRA is off (s1): set OPTION_ENABLE_LORA=true" in caplog.text
    (tmp_path / "adapters" / "s0").mkdir()  # not a PEFT adapter: the start fails naming it
    with pytest.raises(StartupAdapterError, match="cannot register adapter 's0' found at start .* no adapter_config"):
        AdapterRegistry(FakeEngineLoop(), registry.config).register_startup(tmp_path)
    assert off.register_startup(tmp_path) == []  # LoRA off: not even looked at


@pytest.fixture()
def s3_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def test_adapters_from_s3(s3_endpoint, tmp_path):
    """Start-up adapters ride along with an s3:// model (one download); a management `src` may be s3:// too."""
    from serving.server.settings.model_fetch import resolve_model

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="lora-test")  # not "models": moto keeps one store per process
    files = {"m/config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
             "m/adapters/sql/adapter_config.json": '{"r": 8}', "m/adapters/sql/adapter_model.safetensors": "w",
             "loras/chat/adapter_config.json": '{"r": 16}', "loras/chat/adapter_model.safetensors": "w2"}
    for key, data in files.items():
        s3.put_object(Bucket="lora-test", Key=key, Body=data.encode())
    cfg = load_config({"HF_MODEL_ID": "s3://lora-test/m/", "AWS_ENDPOINT_URL_S3": s3_endpoint,
                       "SERVING_DOWNLOAD_DIR": str(tmp_path), "OPTION_ENABLE_LORA": "true"}, [])
    model_dir = resolve_model(cfg)
    assert find_adapters(model_dir) == {"sql": model_dir / "adapters" / "sql"}
    path = fetch_adapter("chat", "s3://lora-test/loras/chat", tmp_path, endpoint_url=s3_endpoint)
    assert (path / "adapter_model.safetensors").read_bytes() == b"w2"
    with pytest.raises(AdapterSourceError, match="adapter 'x': no objects under s3://lora-test/none"):
        fetch_adapter("x", "s3://lora-test/none/", tmp_path, endpoint_url=s3_endpoint)
    loop, client = make(tmp_path / "http", adapters=(), AWS_ENDPOINT_URL_S3=s3_endpoint,  # through the API
                        OPTION_RUNTIME_ADAPTER_SOURCES="s3://lora-test/loras")
    r = client.post("/models/base/adapters?name=chat&src=s3://lora-test/loras/chat")
    assert r.status_code == 200 and loop.loras["chat"].lora_path == str(tmp_path / "http/dl/s3/lora-test/loras/chat")
    assert client.get("/adapters/chat").json == {"name": "chat", "src": "s3://lora-test/loras/chat"}


def test_ping_is_200_only_once_start_up_adapters_are_registered():
    from serving.engine.request_stream import EngineState
    from serving.server.wsgi import ServedEngine

    loop = FakeEngineLoop()
    loop.state = EngineState.READY  # the model is loaded; the adapters under adapters/ are not yet
    served = ServedEngine(loop, load_config({"OPTION_ENABLE_LORA": "true"}, []))
    client = create_app(served, served.config).test_client()
    assert client.get("/ping").status_code == 503
    assert client.post("/invocations", json={"inputs": "x"}).status_code == 503
    served.startup_done.set()
    assert client.get("/ping").status_code == 200
    served.startup_error = StartupAdapterError("cannot register adapter 'x' found at start in /m/adapters/x: ...")
    r = client.get("/ping")
    assert r.status_code == 500 and "cannot register adapter 'x'" in r.json["error"]


def test_management_api_is_403_unless_the_operator_allows_sources(tmp_path):
    loop, client = make(tmp_path, adapters=(), OPTION_RUNTIME_ADAPTER_SOURCES="")  # the default: unset
    src = peft_dir(tmp_path / "ok")
    for method, path in [("POST", f"/models/base/adapters?name=n&src={src}"), ("POST", f"/adapters?name=n&src={src}"),
                         ("GET", "/adapters"), ("GET", "/models/base/adapters"), ("GET", "/adapters/n"),
                         ("DELETE", "/models/base/adapters/n")]:
        r = client.open(path, method=method)
        assert r.status_code == 403 and "OPTION_RUNTIME_ADAPTER_SOURCES" in r.json["error"], (path, r.json)
    assert loop.loras == {} and not (tmp_path / "dl").exists()
    registry = AdapterRegistry(FakeEngineLoop(), load_config({"OPTION_ENABLE_LORA": "true"}, []))
    peft_dir(tmp_path / "model" / "adapters" / "s1")
    assert registry.register_startup(tmp_path / "model") == ["s1"]  # start-up adapters need no option


def test_allow_list_is_enforced(tmp_path):
    allowed = tmp_path / "allowed"
    peft_dir(allowed / "a")
    peft_dir(tmp_path / "elsewhere" / "b")
    (allowed / "link").symlink_to(tmp_path / "elsewhere" / "b", target_is_directory=True)  # points out
    peft_dir(tmp_path / "allowed-not" / "c")  # a sibling whose name starts like the allowed dir
    loop, client = make(tmp_path, adapters=(), OPTION_RUNTIME_ADAPTER_SOURCES=f"{allowed},s3://bkt/loras")
    assert client.post(f"/adapters?name=a&src={allowed / 'a'}").status_code == 200
    for src in [tmp_path / "elsewhere" / "b", allowed / "link", f"{allowed}/../elsewhere/b",
                tmp_path / "allowed-not" / "c", "s3://bkt/loras-evil/x", "s3://bkt/loras/../../x", "s3://other/loras",
                "s3://bkt/loras//x", "file:///etc", "~/x"]:
        r = client.post("/adapters", query_string={"name": "x", "src": str(src)})
        assert r.status_code == 403 and "OPTION_RUNTIME_ADAPTER_SOURCES" in r.json["error"], (src, r.json)
    assert list(loop.loras) == ["a"]
    with pytest.raises(ConfigError, match="OPTION_RUNTIME_ADAPTER_SOURCES='relative/dir' is invalid"):
        load_config({"OPTION_RUNTIME_ADAPTER_SOURCES": "relative/dir"}, [])
    with pytest.raises(ConfigError, match="has an empty, '.' or '..' segment"):
        load_config({"OPTION_RUNTIME_ADAPTER_SOURCES": "s3://b/x/../y"}, [])


def test_adapters_registered_through_the_api_come_back_in_a_replacing_worker(tmp_path, caplog):
    """A worker that replaces a dead one registers, behind /ping's 503, the adapters this server run
    registered over HTTP (and not those deleted); one whose source is gone fails the start, named."""
    loop, client = make(tmp_path, adapters=())
    for name in ("k1", "k2", "k3"):
        assert client.post(f"/adapters?name={name}&src={peft_dir(tmp_path / name)}").status_code == 200
    assert client.delete("/adapters/k2").status_code == 200
    config = client.application.extensions["adapters"].config
    fresh = FakeEngineLoop()  # the new worker's engine: nothing registered on it yet
    registry = AdapterRegistry(fresh, config, AdapterJournal(config.download_dir))
    with caplog.at_level(logging.INFO):
        assert registry.register_startup(None) == ["k1", "k3"]
    assert sorted(fresh.loras) == ["k1", "k3"] and "registered again after a worker restart" in caplog.text
    shutil.rmtree(tmp_path / "k3")
    with pytest.raises(StartupAdapterError, match="cannot register again adapter 'k3'.*is not a directory"):
        AdapterRegistry(FakeEngineLoop(), config, AdapterJournal(config.download_dir)).register_startup(None)


def test_metric_series_of_a_deleted_adapter_goes(tmp_path):
    loop, client = make(tmp_path)
    for _ in range(3):  # register/use/delete cycles never pile up series
        assert client.post("/invocations", json={"inputs": "x"}, headers={HEADER: "adapter=a1"}).status_code == 200
        assert 'lmi_adapter_requests_total{adapter="a1"}' in client.get("/metrics").text
        assert client.delete("/adapters/a1").status_code == 200
        assert 'adapter="a1"' not in client.get("/metrics").text
        assert client.post(f"/adapters?name=a1&src={tmp_path / 'a1'}").status_code == 200
    assert client.delete("/adapters/a2").status_code == 200  # never served: nothing to drop


def test_s3_adapter_keys_leaving_the_download_dir_are_refused(s3_endpoint, tmp_path):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="lora-evil")
    for key, data in {"x/adapter_config.json": b'{"r": 8}', "x/adapter_model.safetensors": b"w",
                      "x/../../../../../victim": b"OVERWRITTEN by s3://lora-evil/x"}.items():
        s3.put_object(Bucket="lora-evil", Key=key, Body=data)
    (tmp_path / "victim").write_text("original")
    loop, client = make(tmp_path / "srv", adapters=(), AWS_ENDPOINT_URL_S3=s3_endpoint,
                        OPTION_RUNTIME_ADAPTER_SOURCES="s3://lora-evil")
    r = client.post("/adapters?name=x&src=s3://lora-evil/x")
    assert r.status_code == 400 and "S3 key 'x/../../../../../victim'" in r.json["error"], r.json
    r = client.post("/adapters?name=y&src=s3://lora-evil/../../../victim")
    assert r.status_code == 403, r.json
    assert (tmp_path / "victim").read_text() == "original" and loop.loras == {}
    assert not (tmp_path / "srv" / "dl").exists() or not any(p.is_file() for p in (tmp_path / "srv" / "dl").rglob("*"))
