"""Regenerate the three notebooks from the cell sources below: ``python notebooks/build_notebooks.py``.

The .ipynb files are committed without outputs; CI executes them with ``pytest --nbmake notebooks``
and the assert cells inside check what they produce.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

START_CONTAINER = '''\
import json, os, time
import requests
from sdk import StreamingClient
from sdk.local import ContainerProcess

BASE = os.environ.get("OPEN_LMI_URL")  # an already running container, e.g. `make serve`
container = None
if BASE:
    print(f"Using the running container at {BASE}")
else:
    # What `docker run -p 8080:8080 <image> serve` does on a machine with Docker; here a plain process.
    t0 = time.monotonic()
    container = ContainerProcess({"OPTION_MAX_ROLLING_BATCH_SIZE": "8"}).start().wait_ready()
    BASE = container.url
    print(f"Started container/serve at {BASE} in {time.monotonic() - t0:.1f} s (log: {container.log_path})")'''

QUICKSTART = [
    new_markdown_cell("""\
# 01 · Local quickstart

Start the container the way SageMaker does (`serve`), call it with plain HTTP (what `curl` sends),
then use the SDK for whole answers and token streams. With no `HF_MODEL_ID` the container serves its
embedded default model (SmolLM2-135M-Instruct), so this runs offline on a CPU.

Set `OPEN_LMI_URL=http://127.0.0.1:8080` to use a container that is already running
(`make serve`, or `docker run -p 8080:8080 <image> serve` on a machine with Docker)."""),
    new_code_cell(START_CONTAINER),
    new_markdown_cell("## Plain HTTP\n`curl http://127.0.0.1:8080/ping`"),
    new_code_cell('''\
r = requests.get(f"{BASE}/ping", timeout=5)
print(r.status_code, r.text)
assert r.status_code == 200'''),
    new_markdown_cell("""\
`curl -X POST http://127.0.0.1:8080/invocations -H 'Content-Type: application/json' -d '{"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12, "details": true}}'`"""),
    new_code_cell('''\
payload = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12, "details": True}}
r = requests.post(f"{BASE}/invocations", json=payload, timeout=120)
print(r.status_code, r.headers.get("Content-Type"))
body = r.json()
print(json.dumps(body, indent=1)[:1200])
assert r.status_code == 200 and body["generated_text"].strip()
assert body["details"]["finish_reason"] in ("length", "eos_token", "stop_sequence")'''),
    new_markdown_cell("Streaming: `curl -N ... -d '{\"inputs\": ..., \"stream\": true}'` gives JSON lines, one token each."),
    new_code_cell('''\
payload = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12}, "stream": True}
with requests.post(f"{BASE}/invocations", json=payload, stream=True, timeout=120) as r:
    print(r.headers.get("Content-Type"))
    records = [json.loads(line) for line in r.iter_lines() if line]
for record in records[:3]:
    print(record)
print("...")
print(records[-1])
assert "generated_text" in records[-1]
assert "".join(rec["token"]["text"] for rec in records) == records[-1]["generated_text"]'''),
    new_markdown_cell("OpenAI-style chat: `curl http://127.0.0.1:8080/v1/chat/completions -d '{\"messages\": [...]}'`"),
    new_code_cell('''\
chat = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Who won the world series in 2020?"}], "max_tokens": 8}
r = requests.post(f"{BASE}/v1/chat/completions", json=chat, timeout=120)
print(json.dumps(r.json(), indent=1))
assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip()'''),
    new_markdown_cell("## The SDK\n`StreamingClient.from_url()` for a local container; `from_endpoint()` for SageMaker (notebook 02)."),
    new_code_cell('''\
client = StreamingClient.from_url(BASE)
prompt = "The capital of France is"
params = {"max_new_tokens": 12, "do_sample": False}  # greedy
result = client.generate(prompt, params)
print(repr(result.generated_text), "| finish_reason:", result.finish_reason)
assert result.generated_text.strip()'''),
    new_code_cell('''\
stream = client.stream(prompt, params)
for token in stream:
    print(token.text, end="", flush=True)
print()
print(f"{len(stream.result.tokens)} tokens streamed")
# Greedy decoding: the streamed text must equal the whole answer.
assert stream.result.generated_text == result.generated_text, (stream.result.generated_text, result.generated_text)'''),
    new_code_cell('''\
reply = client.stream_chat([{"role": "user", "content": "Say hello in French."}], max_tokens=8)
print("".join(token.text for token in reply))
assert reply.result.generated_text.strip()'''),
    new_code_cell('''\
if container is not None:
    print("container exit code:", container.stop())'''),
]

DEPLOY = [
    new_markdown_cell("""\
# 02 · Deploy on SageMaker (the seed walkthrough, with our image)

`sagemaker.Model(...).deploy(...)`, `Predictor.predict`, then streaming with
`invoke_endpoint_with_response_stream` + `LineIterator` (ours: no infinite loop on a last line without
`\\n`, no `TypeError` on unknown events).

* **AWS mode** (credentials found and `OPEN_LMI_IMAGE_URI` set to our image in ECR; role from
  `SAGEMAKER_ROLE_ARN` or `sagemaker.get_execution_role()`): real endpoint, billed. Model from
  `OPEN_LMI_MODEL_ID` (default `microsoft/Phi-3-mini-4k-instruct`).
* **Local mode** (otherwise): moto is the control plane, `sdk.gateway` the `sagemaker-runtime` data plane
  and `container/serve` runs as a process with the deployed model's Environment. The seed's code is
  unchanged: `AWS_ENDPOINT_URL_SAGEMAKER` / `AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME` point it at the local stack.

Uses sagemaker 2.x (`sagemaker<3`); see `sdk/deploy.py` for the 3.x equivalent."""),
    new_code_cell('''\
import contextlib, io, json, os, time
import boto3
import sagemaker
from sdk import local as sdk_local
from sdk.iterators import LineIterator

MODE = os.environ.get("OPEN_LMI_MODE") or (
    "aws" if os.environ.get("OPEN_LMI_IMAGE_URI") and sdk_local.aws_credentials_available() else "local")
cleanup = contextlib.ExitStack()
if MODE == "aws":
    image_uri = os.environ["OPEN_LMI_IMAGE_URI"]
    model_id = os.environ.get("OPEN_LMI_MODEL_ID", "microsoft/Phi-3-mini-4k-instruct")
    role = os.environ.get("SAGEMAKER_ROLE_ARN") or sagemaker.get_execution_role()
    MAX_NEW_TOKENS = 256
    print(f"MODE: AWS -- a real SageMaker endpoint with {image_uri} (billed until deleted below)")
else:
    local = cleanup.enter_context(sdk_local.LocalSageMaker())
    cleanup.enter_context(sdk_local.fast_sdk_waits())  # the SDK sleeps 30 s per poll; moto is instant
    os.environ.update(local.environ)  # unchanged boto3 / sagemaker code now talks to the local stack
    image_uri = "open-lmi:local"
    model_id = str(sdk_local.ensure_default_model())
    role = "arn:aws:iam::1111111111:role/service-role/AmazonSageMaker-ExecutionRole-00000000T000000"
    MAX_NEW_TOKENS = 16
    print("MODE: LOCAL -- moto (control plane) + sdk.gateway (data plane) + container/serve process")
    print(f"  control plane {local.control_plane_url}, runtime {local.gateway.url}")
print(f"  image {image_uri}, model {model_id}")'''),
    new_markdown_cell("## The seed's deployment code (image URI and model id substituted)"),
    new_code_cell('''\
iam_role = role
# manages interactions with the sagemaker apis
sagemaker_session = sagemaker.session.Session()
region = sagemaker_session._region_name
# boto3 Sagemaker runtime client to invoke the endpoint
# with streaming response
smr_client = boto3.client("sagemaker-runtime")
# our image instead of sagemaker.image_uris.retrieve(framework="djl-lmi", version="0.28.0", region=region)
container_uri = image_uri
# instance type you will deploy your model to
instance_type = "ml.g5.4xlarge"
# create a unique endpoint name
endpoint_name = sagemaker.utils.name_from_base("phi3-4k-lmi-endpoint")
# create your SageMaker Model
model = sagemaker.Model(
    image_uri=container_uri,
    role=iam_role,
    # specify all environment variable configs in this map
    env={
        "HF_MODEL_ID": model_id,
        "OPTION_ROLLING_BATCH": "vllm",
        "TENSOR_PARALLEL_DEGREE": "max",
        "OPTION_MAX_ROLLING_BATCH_SIZE": "2",
        "OPTION_DTYPE": "fp16",
        # Streaming will work without this variable
        # "OPTION_ENABLE_STREAMING":"true"
    },
)
# deploy your model
t0 = time.monotonic()
model.deploy(
    instance_type=instance_type,
    initial_instance_count=1,
    endpoint_name=endpoint_name,
)
print(f"\\n{endpoint_name}: {sagemaker_session.sagemaker_client.describe_endpoint(EndpointName=endpoint_name)['EndpointStatus']}"
      f" after {time.monotonic() - t0:.1f} s")'''),
    new_markdown_cell("In local mode we play SageMaker's part: start the container with the model's Environment."),
    new_code_cell('''\
if MODE == "local":
    env = local.model_environment(endpoint_name)
    print("container Environment:", env)
    t0 = time.monotonic()
    url = local.start_container(endpoint_name)
    print(f"container ready at {url} in {time.monotonic() - t0:.1f} s")'''),
    new_markdown_cell("## Non-streaming prediction (seed code)"),
    new_code_cell('''\
# Get a predictor for your endpoint
predictor = sagemaker.Predictor(
    endpoint_name=endpoint_name,
    sagemaker_session=sagemaker_session,
    serializer=sagemaker.serializers.JSONSerializer(),
    deserializer=sagemaker.deserializers.JSONDeserializer(),
)
# Make a prediction with your endpoint
outputs = predictor.predict(
    {
        "inputs": "The meaning of life is",
        "parameters": {"do_sample": True, "max_new_tokens": MAX_NEW_TOKENS},
    }
)
print(outputs["generated_text"])
assert outputs["generated_text"].strip()'''),
    new_markdown_cell("## Streaming (seed loop, with `sdk.iterators.LineIterator`)"),
    new_code_cell('''\
stop_token = "\\n""\\n"
# Create body object and pass 'stream' to True
body = {
    "inputs": "The meaning of life",
    "parameters": {
        "max_new_tokens": MAX_NEW_TOKENS,
    },
    "stream": True,
}
# Invoke the endpoint
resp = smr_client.invoke_endpoint_with_response_stream(
    EndpointName=endpoint_name, Body=json.dumps(body), ContentType="application/json"
)
print("ContentType:", resp["ContentType"])
# Parse the streaming response
event_stream = resp["Body"]
start_json = b"{"
streamed = []
for line in LineIterator(event_stream):
    if line != b"" and start_json in line:
        data = json.loads(line[line.find(start_json) :].decode("utf-8"))
        streamed.append(data)
        if data["token"]["text"] != stop_token:
            print(data["token"]["text"], end="")
print()
assert streamed and "generated_text" in streamed[-1]
assert "".join(d["token"]["text"] for d in streamed) == streamed[-1]["generated_text"]'''),
    new_markdown_cell("A container error reaches boto3 as SageMaker's `ModelError` (HTTP 424 with the original status)."),
    new_code_cell('''\
try:
    smr_client.invoke_endpoint(EndpointName=endpoint_name, ContentType="application/json",
                               Body=json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": -5}}))
    raise AssertionError("expected a ModelError")
except smr_client.exceptions.ModelError as err:
    print("OriginalStatusCode:", err.response["OriginalStatusCode"])
    print("OriginalMessage:", err.response["OriginalMessage"][:300])
    assert 400 <= err.response["OriginalStatusCode"] < 500'''),
    new_markdown_cell("## Clean up"),
    new_code_cell('''\
predictor.delete_endpoint()
model.delete_model()
cleanup.close()  # local mode: stops the container, the gateway and moto
print("deleted", endpoint_name)'''),
]

THROUGHPUT = [
    new_markdown_cell("""\
# 03 · Throughput: the seed's 59-question TPS measurement

Send the 59 questions one by one to `/v1/chat/completions` (system prompt "You are a helpful
assistant."), record `completion_tokens / elapsed` per request and the cumulative TPS the seed prints,
and plot them. CI defaults keep it short: `OPEN_LMI_TPS_MAX_TOKENS` (default 8) and a time budget
`OPEN_LMI_TPS_BUDGET_S` (default 30 s: questions are sent in order until it is spent, at least 3).
For the full seed run set `OPEN_LMI_TPS_QUESTIONS=59` (no budget), e.g. with `OPEN_LMI_TPS_MAX_TOKENS=256`
and `OPEN_LMI_URL` pointing at a GPU container."""),
    new_code_cell(START_CONTAINER),
    new_code_cell('''\
import tempfile
from pathlib import Path
import matplotlib.pyplot as plt
from sdk.local import REPO_ROOT

questions = json.loads((REPO_ROOT / "notebooks" / "data" / "questions-59.json").read_text())
assert len(questions) == 59
MAX_TOKENS = int(os.environ.get("OPEN_LMI_TPS_MAX_TOKENS", "8"))
if os.environ.get("OPEN_LMI_TPS_QUESTIONS"):
    questions = questions[: int(os.environ["OPEN_LMI_TPS_QUESTIONS"])]
    BUDGET_S = float("inf")
else:
    BUDGET_S = float(os.environ.get("OPEN_LMI_TPS_BUDGET_S", "30"))
print(f"up to {len(questions)} questions, max_tokens={MAX_TOKENS}, time budget {BUDGET_S} s")'''),
    new_code_cell('''\
session = requests.Session()
rows = []
total_tokens, total_elapsed = 0, 0.0
print(f"{'#':>3} {'tokens':>6} {'seconds':>8} {'tok/s':>7} {'cum TPS':>8}  question")
for i, question in enumerate(questions, 1):
    if total_elapsed > BUDGET_S and i > 3:
        print(f"... time budget spent: {len(questions) - i + 1} questions not sent")
        break
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": question}]
    t0 = time.perf_counter()
    r = session.post(f"{BASE}/v1/chat/completions", timeout=300,
                     json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    tokens = r.json()["usage"]["completion_tokens"]
    total_tokens += tokens
    total_elapsed += elapsed
    rows.append({"tokens": tokens, "seconds": elapsed, "tps": tokens / elapsed, "cum_tps": total_tokens / total_elapsed})
    print(f"{i:>3} {tokens:>6} {elapsed:>8.3f} {tokens / elapsed:>7.1f} {total_tokens / total_elapsed:>8.1f}  {question[:50]}")
print(f"\\nTPS (seed's figure: completion tokens / elapsed): {total_tokens / total_elapsed:.1f} "
      f"over {len(rows)} requests, {total_tokens} tokens, {total_elapsed:.1f} s")
assert all(row["tokens"] > 0 for row in rows)
assert total_tokens / total_elapsed > 0'''),
    new_code_cell('''\
out_dir = Path(os.environ.get("OPEN_LMI_NOTEBOOK_OUT", tempfile.gettempdir()))
out_dir.mkdir(parents=True, exist_ok=True)
fig, ax = plt.subplots(figsize=(10, 4))
ax.bar(range(1, len(rows) + 1), [row["tps"] for row in rows], label="tokens/s per request")
ax.plot(range(1, len(rows) + 1), [row["cum_tps"] for row in rows], color="C1", marker=".", label="cumulative TPS")
ax.set_xlabel("question #")
ax.set_ylabel("tokens / s")
ax.set_title(f"Sequential chat completions ({len(rows)} questions, max_tokens={MAX_TOKENS})")
ax.legend()
chart = out_dir / "throughput.png"
fig.savefig(chart, dpi=100, bbox_inches="tight")
plt.show()
print("saved", chart)
assert chart.stat().st_size > 1000'''),
    new_code_cell('''\
if container is not None:
    print("container exit code:", container.stop())'''),
]


def write(name: str, cells: list) -> None:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("01_local_quickstart.ipynb", QUICKSTART)
    write("02_deploy_sagemaker.ipynb", DEPLOY)
    write("03_throughput.ipynb", THROUGHPUT)
