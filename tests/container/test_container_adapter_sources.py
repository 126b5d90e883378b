"""Where the real server (`container/serve`, a tiny Llama on the CPU) may fetch and write, against a
moto S3 endpoint: no download writes outside its directory, the adapter management API is off
unless the operator sets OPTION_RUNTIME_ADAPTER_SOURCES and then loads only from its allow-list,
adapters registered over HTTP come back when gunicorn replaces a dead worker, and a fuzz run over
registration bodies never writes outside the download directory nor leaves the server unhealthy.

Three servers start together: `open` (model from S3, LoRA on, the option allowing one local dir
and one S3 prefix), `closed` (the local model, the option unset, as by default: the management
routes' 403) and `evil` (its S3 model prefix holds a key climbing out of the mirror: the start
fails naming the key and `serve` exits).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import boto3
import pytest
import requests
from lmi_server import LMIServer

pytestmark = pytest.mark.slow
HEADER = "X-Amzn-SageMaker-Custom-Attributes"
SERVED = "tiny"
OPTION = "OPTION_RUNTIME_ADAPTER_SOURCES"
AWS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
ESCAPE = "../" * 12  # enough '..' to leave any directory under the test's
# Keys aimed at <root>/victim from each mirror: <root>/evil-dl/s3/evil/m and <root>/open-dl/s3/loras/allowed/evil.
MODEL_KEY = "m/" + "../" * 4 + "victim"
ADAPTER_KEY = "allowed/evil/" + "../" * 5 + "victim"


def _upload(s3, bucket: str, prefix: str, directory: Path) -> None:
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{f.relative_to(directory)}", Body=f.read_bytes())


def _files(root: Path, skip: tuple[Path, ...]) -> dict[str, bytes]:
    """{path: bytes} of every file under `root` but those under `skip` (symlinks as '<link>')."""
    out = {}
    for p in sorted(root.rglob("*")):
        if any(p == s or s in p.parents for s in skip):
            continue
        if p.is_symlink():
            out[str(p)] = b"<link>"
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory, lora_adapters, monkeypatch_module):  # noqa: F811
    """The moto endpoint, the buckets, and the two servers (started together, stopped after)."""
    from moto.server import ThreadedMotoServer

    for k, v in AWS.items():
        monkeypatch_module.setenv(k, v)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    base, adapters = lora_adapters("llama")
    root = tmp_path_factory.mktemp("sources")
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for bucket in ("models", "loras", "evil"):
        s3.create_bucket(Bucket=bucket)
    _upload(s3, "models", "tiny", base)
    _upload(s3, "loras", "allowed/r8", adapters["r8"])
    _upload(s3, "loras", "other/r8", adapters["r8"])  # a bucket the option does not name, same files
    _upload(s3, "loras", "allowed/evil", adapters["r8"])
    s3.put_object(Bucket="loras", Key=ADAPTER_KEY, Body=b"OVERWRITTEN by s3://loras/allowed/evil")
    _upload(s3, "evil", "m", base)
    s3.put_object(Bucket="evil", Key=MODEL_KEY, Body=b"OVERWRITTEN by s3://evil/m")
    local = root / "local-loras"
    local.mkdir()
    shutil.copytree(adapters["r16"], local / "r16")
    (local / "link").symlink_to(adapters["r8"], target_is_directory=True)  # resolves outside: refused
    (root / "victim").write_text("original")
    common = {**AWS, "AWS_ENDPOINT_URL_S3": endpoint, "OPTION_ENABLE_LORA": "true", "OPTION_SERVED_MODEL_NAME": SERVED,
              "OPTION_MAX_ROLLING_BATCH_SIZE": "4"}
    specs = {
        "open": {**common, "HF_MODEL_ID": "s3://models/tiny/", "SERVING_DOWNLOAD_DIR": str(root / "open-dl"),
                 OPTION: f"{local},s3://loras/allowed"},
        "evil": {**common, "HF_MODEL_ID": "s3://evil/m/", "SERVING_DOWNLOAD_DIR": str(root / "evil-dl")},
        "closed": {**common, "HF_MODEL_ID": str(base), "SERVING_DOWNLOAD_DIR": str(root / "closed-dl")},
    }
    servers = {}
    try:
        for name, env in specs.items():
            (root / name).mkdir()
            servers[name] = LMIServer(env, root / name, root / name / "serve.log")
        evil_reason = servers["evil"].wait_failed_start()
        servers["open"].wait(200)
        servers["closed"].wait(200)
        servers["evil"].failed_start_reason = evil_reason
        yield root, servers, adapters, s3
    finally:
        for srv in servers.values():
            srv.stop()
        moto.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _outside_download_dirs(root: Path) -> dict[str, bytes]:
    return _files(root, tuple(root / f"{n}-dl" for n in ("open", "evil", "closed")) +
                  tuple(root / n / "serve.log" for n in ("open", "evil", "closed")))


def test_a_model_key_leaving_the_mirror_fails_the_start_naming_it(world):
    root, servers, *_ = world
    reason = servers["evil"].failed_start_reason
    assert f"S3 key {MODEL_KEY!r}" in reason, reason
    assert (root / "victim").read_text() == "original"
    assert not list((root / "evil-dl").rglob("config.json"))  # refused before any write


def test_management_routes_are_403_by_default(world):
    _, servers, adapters, _ = world
    url = servers["closed"].url  # the option unset
    for method, path in [("POST", f"/models/{SERVED}/adapters?name=a&src={adapters['r8']}"),
                         ("POST", "/adapters?name=a&src=s3://loras/allowed/r8"), ("GET", f"/models/{SERVED}/adapters"),
                         ("GET", "/adapters/a"), ("DELETE", "/adapters/a")]:
        r = requests.request(method, url + path, timeout=10)
        assert r.status_code == 403 and OPTION in r.json()["error"], (path, r.text)


def test_allow_list_and_traversal_on_the_open_server(world):
    root, servers, adapters, _ = world
    url = servers["open"].url
    before = _outside_download_dirs(root)
    r = requests.post(url + "/adapters", params={"name": "s3r8", "src": "s3://loras/allowed/r8"}, timeout=60)
    assert r.status_code == 200, r.text
    r = requests.post(url + "/adapters", params={"name": "locr16", "src": str(root / "local-loras" / "r16")}, timeout=60)
    assert r.status_code == 200, r.text
    for src in ["s3://loras/other/r8", f"s3://loras/allowed/{ESCAPE}tmp", "s3://loras/allowed/../other/r8",
                str(adapters["r8"]), str(root / "local-loras" / "link"), f"{root / 'local-loras'}/../local-loras-x", "https://example.com/r8"]:
        r = requests.post(url + "/adapters", params={"name": "x", "src": src}, timeout=30)
        assert r.status_code == 403 and OPTION in r.json()["error"], (src, r.text)
    r = requests.post(url + "/adapters", params={"name": "evil", "src": "s3://loras/allowed/evil"}, timeout=30)
    assert r.status_code == 400 and f"S3 key {ADAPTER_KEY!r}" in r.json()["error"], r.text
    assert _outside_download_dirs(root) == before  # nothing written outside any download dir
    for name in ("s3r8", "locr16"):
        r = requests.post(url + "/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                          headers={HEADER: f"adapter={name}"}, timeout=60)
        assert r.status_code == 200, r.text
    r = requests.post(url + "/invocations", json={"inputs": "hi"}, headers={HEADER: "adapter=nope"}, timeout=30)
    assert r.status_code == 404 and "s3r8" not in r.text and "locr16" not in r.text  # no tenant sees the others


def _worker_pid(master: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master:
            return int(stat.parent.name)
    raise AssertionError(f"no worker under gunicorn master {master}")


def test_api_adapters_come_back_when_gunicorn_replaces_a_dead_worker(world):
    _, servers, *_ = world
    srv = servers["open"]
    url = srv.url
    r = requests.post(url + "/adapters", params={"name": "keep", "src": "s3://loras/allowed/r8"}, timeout=60)
    assert r.status_code == 200, r.text
    assert requests.post(url + "/adapters", params={"name": "gone", "src": "s3://loras/allowed/r8"},
                         timeout=60).status_code == 200
    assert requests.delete(url + "/adapters/gone", timeout=30).status_code == 200
    old = _worker_pid(srv.proc.pid)
    os.kill(old, signal.SIGKILL)  # the worker dies (as when its engine dies): gunicorn starts another
    deadline = time.monotonic() + 60
    while _worker_pid(srv.proc.pid) == old and time.monotonic() < deadline:
        time.sleep(0.2)
    srv.ping_history.clear()
    srv.wait(200)
    assert 200 not in srv.ping_history[:-1]  # 503 until the adapters were registered again
    names = [a["name"] for a in requests.get(url + "/adapters", timeout=10).json()["adapters"]]
    assert "keep" in names and "gone" not in names, names
    r = requests.post(url + "/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                      headers={HEADER: "adapter=keep"}, timeout=60)
    assert r.status_code == 200, r.text
    assert srv.log_has("registered again after a worker restart")


def _fuzz_body(rng: random.Random, root: Path) -> tuple[dict, dict | None]:
    """(query params, JSON body or None) of one random registration."""
    names = ["a", "x" * rng.randint(1, 300), "../up", "a/b", "a;b=c", "", " ", "é", "\x00", "-lead", "ok.1_2-3",
             str(rng.random()), "%2e%2e", "tiny", "name" + "%" * rng.randint(0, 40)]
    srcs = [str(root / "local-loras" / "r16"), f"{root / 'local-loras'}/{ESCAPE}etc",
            f"{root / 'local-loras'}/" + "/".join(rng.choice(["..", ".", "", "r16", "x"]) for _ in range(rng.randint(1, 12))),
            "s3://loras/allowed/" + "/".join(rng.choice(["..", ".", "", "r8", "evil", "z"]) for _ in range(rng.randint(1, 8))),
            "s3://loras/allowed/r8", "s3://loras/allowed/evil", "s3://" + rng.choice(["", "..", "loras", "a" * 300]) + "/x",
            "/", "/etc/passwd", "~", "file:///etc", "http://127.0.0.1:1/x", "\x00", "s3://loras/allowed/r8/" + "y" * 5000,
            rng.choice(["", " ", "\t"]) + "s3://loras/allowed/r8"]
    name, src = rng.choice(names), rng.choice(srcs)
    if rng.random() < 0.5:
        return {"name": name, "src": src}, None
    body = {"name": rng.choice([name, 7, None, [name], {"n": name}]), "src": rng.choice([src, 3.5, None, [src]])}
    if rng.random() < 0.2:
        body["pad"] = "p" * rng.choice([10, 10_000, 7 * 2**20])  # sizes up to over max_request_size
    return {}, body


def test_fuzz_registration_bodies(world):
    root, servers, *_ = world
    url = servers["open"].url
    rng = random.Random(31)
    before = _outside_download_dirs(root)
    registered = requests.get(url + "/adapters", timeout=10).json()
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + 3.0  # seeded: the same bodies, as many as 3 s allow
    while time.monotonic() < deadline:
        params, body = _fuzz_body(rng, root)
        kwargs = {"params": params} if body is None else {"data": json.dumps(body),
                                                          "headers": {"Content-Type": "application/json"}}
        r = requests.post(url + rng.choice(["/adapters", f"/models/{SERVED}/adapters"]), timeout=60, **kwargs)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 403, 404, 409, 413), (params, body and str(body)[:300], r.text[:300])
        if r.status_code == 200:
            name = params.get("name") or body["name"]
            assert requests.delete(f"{url}/adapters/{name}", timeout=30).status_code == 200
    assert sum(statuses.values()) >= 20 and statuses.get(403, 0) and statuses.get(400, 0), statuses
    assert _outside_download_dirs(root) == before  # nothing written outside the download directories
    assert requests.get(url + "/ping", timeout=5).status_code == 200
    assert requests.get(url + "/adapters", timeout=10).json() == registered  # each accepted one was deleted again
    r = requests.post(url + "/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
