"""Multi-LoRA through the real server (`container/serve`, SmolLM2 on the CPU): every way of naming
an adapter gives PEFT's greedy tokens for that adapter (oracle: `tests/support/lora_fixtures.py`), an
unknown adapter is a 404 naming no other adapter, and an adapter registered through DJL's management
API (on here: OPTION_RUNTIME_ADAPTER_SOURCES names its directory) serves at once and, removed while a stream runs on it, lets that stream finish on it.

One server: the default model's files linked into a directory whose `adapters/` holds r8 and r16
(registered at start, before /ping 200); r16_attn is registered over HTTP. The server runs its engine
in a process of its own (`option.engine_process=true`, serving/engine/engine_process.py).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from lmi_server import LMIServer
from lora_fixtures import peft_greedy

pytestmark = pytest.mark.slow
HEADER = "X-Amzn-SageMaker-Custom-Attributes"
SERVED = "smol-lora"
PROMPT = "The three most useful things to pack for a long hike are"
N = 6  # greedy tokens compared with PEFT's


@pytest.fixture(scope="module")
def setup(tmp_path_factory, lora_adapters):  # noqa: F811
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the PEFT oracle runs here beside the server: many threads spin 5-10x slower
    base, adapters = lora_adapters("default")
    cwd = tmp_path_factory.mktemp("lora")
    model = cwd / "model"
    (model / "adapters").mkdir(parents=True)
    for f in base.iterdir():
        (model / f.name).symlink_to(f)
    for name in ("r8", "r16"):
        (model / "adapters" / name).symlink_to(adapters[name], target_is_directory=True)
    # The engine in its own process (the GPU default; off by default on the CPU): every adapter call
    # below (start-up registration, the management API, the 404's list) crosses its pipe.
    env = {"HF_MODEL_ID": str(model), "OPTION_ENABLE_LORA": "true", "OPTION_SERVED_MODEL_NAME": SERVED,
           "OPTION_MAX_ROLLING_BATCH_SIZE": "8", "OPTION_ENGINE_PROCESS": "true",
           "OPTION_RUNTIME_ADAPTER_SOURCES": str(adapters["r16_attn"])}  # the management API, for this one
    srv = LMIServer(env, cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        from transformers import AutoTokenizer

        yield srv, base, adapters, AutoTokenizer.from_pretrained(str(base))
    finally:
        srv.stop()
        torch.set_num_threads(threads)


def oracle(base, adapter_dir, ids: list[int], n: int = N) -> list[int]:
    return list(peft_greedy(str(base), None if adapter_dir is None else str(adapter_dir), tuple(ids), n))


def invocations(url: str, body: dict, adapter: str | None = None) -> requests.Response:
    headers = {HEADER: f"x-trace=1; adapter={adapter}"} if adapter else {}
    return requests.post(url + "/invocations", json=body, headers=headers, timeout=120)


def lmi_body(inputs, n: int = N, **extra) -> dict:
    return {"inputs": inputs, "parameters": {"max_new_tokens": n, "details": True, "ignore_eos_token": True},
            **extra}


def test_start_up_adapters_are_listed(setup):
    srv, *_ = setup
    assert srv.ping_history[-1] == 200 and 200 not in srv.ping_history[:-1]
    assert [m["id"] for m in requests.get(srv.url + "/v1/models", timeout=5).json()["data"]] == [SERVED, "r16", "r8"]
    listed = requests.get(f"{srv.url}/models/{SERVED}/adapters", timeout=5).json()["adapters"]
    assert [a["name"] for a in listed] == ["r16", "r8"] and listed[1]["src"].endswith("adapters/r8")


def test_header_body_list_and_model_field_give_peft_tokens(setup):
    srv, base, adapters, tok = setup
    ids = tok.encode(PROMPT)
    r = invocations(srv.url, lmi_body(PROMPT), adapter="r8")
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == oracle(base, adapters["r8"], ids)
    r = invocations(srv.url, lmi_body(PROMPT, adapters="r16"))
    assert [t["id"] for t in r.json()["details"]["tokens"]] == oracle(base, adapters["r16"], ids)
    r = invocations(srv.url, lmi_body([PROMPT, PROMPT, PROMPT], adapters=["r16", "", "r8"]))
    got = [[t["id"] for t in out["details"]["tokens"]] for out in r.json()]
    want = [oracle(base, adapters["r16"], ids), oracle(base, None, ids), oracle(base, adapters["r8"], ids)]
    assert got == want and len({tuple(w) for w in want}) == 3  # three different continuations, each right
    r = requests.post(srv.url + "/v1/completions", json={"model": "r16", "prompt": PROMPT, "max_tokens": N,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.json()["choices"][0]["text"] == tok.decode(want[0]) and r.json()["model"] == SERVED


def test_unknown_adapter_is_a_404_naming_no_other(setup):
    srv, *_ = setup
    r = invocations(srv.url, lmi_body(PROMPT), adapter="nope")
    assert r.status_code == 404 and r.json()["error"].startswith("unknown adapter 'nope': no adapter of that name")
    assert "r16" not in r.text and "r8" not in r.text  # one tenant never learns the others' adapters
    r = requests.post(srv.url + "/v1/chat/completions", timeout=30,
                      json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "unknown adapter 'nope'" in r.json()["error"]["message"] and "r16" not in r.text
    r = invocations(srv.url, lmi_body(PROMPT, adapters="r16"), adapter="r8")
    assert r.status_code == 400 and "send one" in r.json()["error"]


def test_register_use_remove_while_a_stream_runs(setup):
    srv, base, adapters, tok = setup
    ids = tok.encode(PROMPT)
    url = f"{srv.url}/models/{SERVED}/adapters"
    r = requests.post(url, params={"name": "late", "src": str(adapters["r16_attn"])}, timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "Adapter late registered"}, r.text
    n = 24
    want = oracle(base, adapters["r16_attn"], ids, n)
    stream = requests.post(srv.url + "/invocations", json=lmi_body(PROMPT, n, stream=True),
                           headers={HEADER: "adapter=late"}, stream=True, timeout=120)
    got: list[tuple[float, dict]] = []  # (when it arrived, record)
    started = threading.Event()

    def read() -> None:
        for ln in stream.iter_lines():
            if ln:
                got.append((time.monotonic(), json.loads(ln)))
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    assert srv.metrics()['lmi_adapter_requests_total{adapter="late"}'] == 1.0
    r = requests.delete(f"{url}/late", timeout=30)  # the stream is running on it
    deleted_at = time.monotonic()
    assert r.status_code == 200 and r.json() == {"status": "Adapter late unregistered"}
    reader.join(120)
    assert got[-1][0] > deleted_at and "generated_text" in got[-1][1]  # it ran on after the DELETE ...
    assert [rec["token"]["id"] for _, rec in got] == want  # ... on the adapter, to its last token
    r = invocations(srv.url, lmi_body(PROMPT), adapter="late")
    assert r.status_code == 404 and "unknown adapter 'late'" in r.json()["error"]
    assert "late" not in [m["id"] for m in requests.get(srv.url + "/v1/models", timeout=5).json()["data"]]
    m = srv.wait_idle()
    assert not [k for k in m if 'adapter="late"' in k]  # its series went with it
