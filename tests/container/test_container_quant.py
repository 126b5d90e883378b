"""Quantized checkpoints through the real server (issue 12): GPTQ, AWQ and FP8 tiny models on the CPU.

Each checkpoint is a tiny random Llama quantized in `tests/support/quant_fixtures.py`; greedy tokens from
/invocations must be transformers' greedy tokens on the same model with the dequantised weights
in fp32, and the start-up log names the format. A malformed `quantization_config` stops the
start: `serve` exits 3 with the message naming the field on one line. The four servers start together.
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import requests
from lmi_server import LMIServer
from model_fixtures import build_tiny_model
from quant_fixtures import Format, write_quantized

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_NEW = 10
FORMATS = {
    "gptq": (Format("gptq", 4, 32, desc_act=True), "weights gptq int4, group 32, desc_act (g_idx), asym, v1 zeros"),
    "awq": (Format("awq", 4, 64), "weights awq int4, group 64, asym"),
    "fp8": (Format("fp8", per_channel=True), "weights fp8 e4m3 weights"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_ckpt")
    base = build_tiny_model("llama", root / "base")
    out = {name: write_quantized(base, root / name, fmt) for name, (fmt, _) in FORMATS.items()}
    bad = root / "bad"  # the GPTQ checkpoint with bits=3
    bad.mkdir()
    for f in out["gptq"].iterdir():
        if f.is_file() and f.name != "config.json":
            (bad / f.name).symlink_to(f)
    config = json.loads((out["gptq"] / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (bad / "config.json").write_text(json.dumps(config))
    out["bad"] = bad
    yield out
    shutil.rmtree(root, ignore_errors=True)  # ~700 MB of checkpoints: give the disk back


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """One server per checkpoint, started at once (each waits mostly on its own start-up)."""
    started: dict[str, LMIServer] = {}
    try:
        for name, path in checkpoints.items():
            env = {"HF_MODEL_ID": str(path), "OPTION_MAX_MODEL_LEN": "256"}
            if name != "bad":
                env["OPTION_QUANTIZE"] = name
            cwd = tmp_path_factory.mktemp(f"serve_{name}")
            started[name] = LMIServer(env, cwd, cwd / "serve.log")
        yield started
    finally:
        for srv in started.values():  # all drain at once, then each is waited for
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGTERM)
        for srv in started.values():
            srv.stop()


def _oracle_greedy(model_dir, ids: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens (EOS ignored) on the dequantised fp32 model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt = torch.tensor([list(ids)])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                             min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("name", list(FORMATS))
def test_served_greedy_tokens_equal_the_dequantised_oracle(name, checkpoints, servers):
    from transformers import AutoTokenizer

    path = checkpoints[name]
    ids = tuple(AutoTokenizer.from_pretrained(str(path)).encode(PROMPT))
    expected = _oracle_greedy(path / "oracle", ids)
    srv = servers[name]
    srv.wait(200)
    r = requests.post(srv.url + "/invocations", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW, "do_sample": False, "details": True}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    got = [t["id"] for t in details["tokens"]]
    if details["finish_reason"] == "eos_token":  # the oracle ignores EOS: compare up to it
        expected = expected[: len(got)]
    assert got == expected
    assert FORMATS[name][1] in srv.log()


def test_malformed_quantization_config_stops_the_start(servers):
    srv = servers["bad"]
    reason = srv.wait_failed_start()
    assert 200 not in srv.ping_history
    assert "bits=3 is not supported for GPTQ (supported: 4, 8)" in reason, reason
