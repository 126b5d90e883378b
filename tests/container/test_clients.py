"""The client libraries users already have, unchanged, against the real server (`container/serve`,
the default model on CPU): the openai SDK, langchain-openai, litellm, huggingface_hub and a real
browser on the chat page at `/`. One server for the module.

Each check compares the library's view with an oracle from the same server: a streamed answer
(tool calls included) with the greedy non-streamed one, a token count with the usage the
completions route reports, and so on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import requests
from lmi_server import running_server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 256
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# auto: the model decides; one worked example makes the small default model answer with a call block
ASK_TIME = [{"role": "system", "content": 'You call functions. To call one, answer only with <tool_call>{"name": '
                                          '..., "arguments": {...}}</tool_call>.'},
            {"role": "user", "content": "What time is it in UTC?"},
            {"role": "assistant", "content": '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'},
            {"role": "user", "content": "What is the time in CET?"}]
CHOICES = {"required": ("required", ASK_WEATHER), "auto": ("auto", ASK_TIME),
           "named": ({"type": "function", "function": {"name": "get_weather"}}, ASK_WEATHER)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # noqa: ANN001, ANN201
    with running_server(tmp_path_factory, {"OPTION_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}, name="clients") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, dict]]:  # noqa: ANN001
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_openai_stream_helper_tool_calls_equal_the_plain_answer(client, choice: str) -> None:  # noqa: ANN001
    tool_choice, messages = CHOICES[choice]
    kw = dict(model="m", messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=64,
              temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    pieces: dict[int, int] = {}
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces[event.index] = pieces.get(event.index, 0) + 1
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == plain.finish_reason
    assert _calls(final.message) == _calls(plain.message)
    assert (final.message.content or None) == (plain.message.content or None)
    assert _calls(plain.message) and all(pieces.get(i, 0) > 1 for i in range(len(plain.message.tool_calls)))
    assert plain.finish_reason == ("stop" if choice == "named" else "tool_calls")  # as OpenAI


def test_auto_tool_choice_answering_in_text_streams_the_text(client) -> None:  # noqa: ANN001
    kw = dict(model="m", messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert not plain.message.tool_calls and len(texts) > 1 and "".join(texts) == plain.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def _chat_model(server):  # noqa: ANN001, ANN202
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="m", temperature=0,
                                       max_tokens=64, max_retries=0, timeout=120)


def test_langchain_bind_tools_stream_equals_invoke(server) -> None:  # noqa: ANN001
    model = _chat_model(server).bind_tools([WEATHER, TIME], tool_choice="get_weather")
    plain = model.invoke(ASK_WEATHER)
    chunks = list(model.stream(ASK_WEATHER))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2  # the arguments arrived in pieces
    got = [(c["name"], c["args"]) for c in whole.tool_calls]
    assert got == [(c["name"], c["args"]) for c in plain.tool_calls] and got[0][0] == "get_weather"


def test_context_overflow_is_openais_error_for_langchain_and_litellm(server, client) -> None:  # noqa: ANN001
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=long, max_tokens=8)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    assert exc.value.body["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                                                "However, you requested ")
    from langchain_core.exceptions import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        _chat_model(server).invoke(long)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no download
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="openai/m", api_base=server.url + "/v1", api_key="unused", messages=long,
                           max_tokens=8, num_retries=0)
    ok = litellm.completion(model="openai/m", api_base=server.url + "/v1", api_key="unused", max_tokens=4,
                            messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].message.content and ok.usage.completion_tokens <= 4


def test_health_version_tokenize_detokenize(server) -> None:  # noqa: ANN001
    for _ in range(3):  # the poller's fast path (keep-alive) and a fresh connection each time
        r = requests.get(server.url + "/health", timeout=5)
        assert r.status_code == 200 and r.content == b""
    assert requests.head(server.url + "/health", timeout=5).status_code == 200
    assert isinstance(requests.get(server.url + "/version", timeout=5).json()["version"], str)
    prompt = "The quick brown fox jumps over the lazy dog"
    tok = requests.post(server.url + "/tokenize", json={"model": "m", "prompt": prompt}, timeout=30).json()
    usage = requests.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                          timeout=60).json()["usage"]
    assert tok["count"] == len(tok["tokens"]) == usage["prompt_tokens"] and tok["max_model_len"] == MAX_MODEL_LEN
    back = requests.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()
    assert back == {"prompt": prompt}
    chat = [{"role": "user", "content": "Hi there"}]
    tok = requests.post(server.url + "/tokenize", json={"messages": chat}, timeout=30).json()
    usage = requests.post(server.url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 1},
                          timeout=60).json()["usage"]
    assert tok["count"] == usage["prompt_tokens"]
    r = requests.post(server.url + "/detokenize", json={"tokens": [-1]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_huggingface_hub_text_generation_on_tgi_routes(server, monkeypatch) -> None:  # noqa: ANN001
    hub = pytest.importorskip("huggingface_hub")
    # tests/conftest.py sets the hub offline (no downloads); this server is local: let the client reach it
    monkeypatch.setattr(pytest.importorskip("huggingface_hub.constants"), "HF_HUB_OFFLINE", False)
    tgi = hub.InferenceClient(base_url=server.url, timeout=120)
    prompt = "The capital of France is"
    text = tgi.text_generation(prompt, max_new_tokens=12)
    detailed = tgi.text_generation(prompt, max_new_tokens=12, details=True, decoder_input_details=True)
    pieces = list(tgi.text_generation(prompt, max_new_tokens=12, stream=True))
    events = list(tgi.text_generation(prompt, max_new_tokens=12, stream=True, details=True))
    assert text and detailed.generated_text == text == "".join(pieces) == events[-1].generated_text
    assert detailed.details.generated_tokens == len(detailed.details.tokens) == len(events) <= 12
    assert "".join(t.text for t in detailed.details.tokens) == text and detailed.details.prefill
    assert events[-1].details.finish_reason == detailed.details.finish_reason in ("length", "eos_token")
    assert [e.token.id for e in events] == [t.id for t in detailed.details.tokens]
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12}}
    one = requests.post(server.url + "/generate", json=body, timeout=60).json()  # TGI's body: one object
    assert one == {"generated_text": text}
    r = requests.post(server.url + "/generate_stream", json=body, stream=True, timeout=60)
    datas = [json.loads(ln[5:]) for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")]
    assert r.headers["Content-Type"].startswith("text/event-stream") and datas[-1]["generated_text"] == text
    vllm = requests.post(server.url + "/generate", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                         timeout=60).json()  # vLLM's body on the same route
    assert vllm == {"text": [prompt + text]}


def test_openai_responses_api_plain_and_streamed(client) -> None:  # noqa: ANN001
    kw = dict(model="m", instructions="Answer in one short sentence.", temperature=0, max_output_tokens=40)
    plain = client.responses.create(input="Reply with one word: yes or no?", **kw)
    assert plain.status == "completed" and plain.output_text and plain.usage.output_tokens <= 40
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "Reply with one word: yes or no?"}]}]
    with client.responses.stream(input=msgs, **kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == plain.output_text == "".join(deltas) and final.usage == plain.usage
    cut = client.responses.create(input="Tell me a long story.", **{**kw, "max_output_tokens": 5})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.responses.create(input="hi", tools=[{"type": "function", "name": "f", "parameters": {}}], **kw)


# ---- the chat page at GET /, in a real browser ------------------------------------------------

CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright drives it (no browser download)
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SKIP_BROWSER = "OPEN_LMI_SKIP_BROWSER_TEST"  # =1: no chromium installed, the browser test skipped
SHOT_DIR_VAR = "OPEN_LMI_TEST_OUTPUT"  # where the chat page's screenshot goes (default: the temp dir)


def _chromium(config: pytest.Config) -> str:
    """Debian's chromium, installed with apt-get (said first) when missing; skips saying why if it cannot be."""
    if os.environ.get(SKIP_BROWSER, "") not in ("", "0"):
        pytest.skip(f"{SKIP_BROWSER} is set: the chat page's browser test is skipped")
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("[browser test] installing Debian's chromium with apt-get (as root) for the chat "
                            f"page's test; {SKIP_BROWSER}=1 skips it", yellow=True, bold=True)
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("the chat page's browser test needs Debian's chromium: apt-get install -y chromium (as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 and cmd[1] == "install":
            pytest.skip(f"apt-get install chromium failed ({done.returncode}): {done.stderr[-500:]}")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"apt-get installed chromium but {CHROMIUM} is not there")
    return CHROMIUM


def test_chat_page_streams_in_a_real_browser(server, client, request, tmp_path) -> None:  # noqa: ANN001
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = _chromium(request.config)
    out_dir = Path(os.environ.get(SHOT_DIR_VAR) or tempfile.gettempdir())  # kept after the run (tmp_path is not)
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "open-lmi-chat-page.png"
    system, question = "You are a helpful assistant. Answer in one sentence.", "What is the capital of France?"
    want = client.chat.completions.create(  # the oracle: the same request, not streamed
        model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0, max_tokens=40)
    stop = "France"
    want_stopped = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0, max_tokens=40, stop=[stop]).choices[0].message.content
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, args=BROWSER_FLAGS,
            viewport={"width": 1100, "height": 640})
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('model: ') && "
                                   "!document.getElementById('model').textContent.includes('…')")
            page.fill("#system", system)
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "40")
            page.fill("#prompt", question)
            # Count the answer's text updates as they happen: streamed text arrives in many.
            page.evaluate("""() => { window.updates = 0; new MutationObserver((ms) => { for (const m of ms)
                if (m.type === 'characterData' || m.type === 'childList') window.updates += 1; })
                .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }""")
            page.click("#send")
            page.wait_for_selector(".msg.assistant .metrics", timeout=120_000)
            answer = page.inner_text(".msg.assistant span")
            metrics = page.inner_text(".msg.assistant .metrics")
            updates = page.evaluate("window.updates")
            page.screenshot(path=str(shot))
            # Stop sequences: a new conversation, the same question, cut where the oracle cuts it
            page.click("#clear")
            page.fill("#stop", stop)
            page.fill("#prompt", question)
            page.click("#send")
            page.wait_for_selector(".msg.assistant .metrics", timeout=120_000)
            stopped = page.inner_text(".msg.assistant span")
            # An error is shown as an error: a request longer than the context
            page.fill("#max-tokens", str(MAX_MODEL_LEN * 4))
            page.fill("#prompt", "Hello again")
            page.click("#send")
            page.wait_for_selector(".msg.error", timeout=60_000)
            error = page.inner_text(".msg.error")
        finally:
            browser.close()
    print(f"chat page screenshot: {shot}")
    assert answer == want.choices[0].message.content and updates > 3
    assert stop in answer and stopped == want_stopped and stop not in stopped
    m = re.fullmatch(r"prompt (\d+) tok · completion (\d+) tok · TTFT (\d+) ms · ([\d.]+) tok/s · finish (\w+)",
                     metrics)
    assert m, metrics
    assert (int(m[1]), int(m[2]), m[5]) == (want.usage.prompt_tokens, want.usage.completion_tokens,
                                            want.choices[0].finish_reason)
    assert float(m[4]) > 0 and error.startswith("Error: This model's maximum context length is")
