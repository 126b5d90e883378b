"""The gateway speaks sagemaker-runtime: checked with real botocore (EventStreamBuffer, boto3 clients)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import requests
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer
from botocore.exceptions import ReadTimeoutError
from urllib3.exceptions import ReadTimeoutError as StreamReadTimeoutError

from fake_lmi import runtime_client
from sdk import eventstream
from sdk.gateway import Gateway
from sdk.iterators import LineIterator, ModelStreamError
from sdk.local import free_port

STREAM_BODY = json.dumps({"inputs": "alpha beta gamma", "stream": True}).encode()


def decode(data: bytes) -> list:
    buf = EventStreamBuffer()
    buf.add_data(data)
    return list(buf)


def test_encoder_frames_decode_with_botocore() -> None:
    frames = eventstream.payload_part(b'{"a": 1}\n') + eventstream.model_stream_error("boom", "StreamBroken")
    first, second = decode(frames)
    assert first.headers == {":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                             ":message-type": "event"}
    assert first.payload == b'{"a": 1}\n'
    assert second.headers[":exception-type"] == "ModelStreamError"
    assert json.loads(second.payload) == {"Message": "boom", "ErrorCode": "StreamBroken"}
    assert second.to_response_dict()["status_code"] == 400


def test_encoder_crc_is_checked() -> None:
    frame = bytearray(eventstream.payload_part(b"hello"))
    frame[-6] ^= 0xFF  # flip a payload byte: message CRC no longer matches
    with pytest.raises(ChecksumMismatch):
        decode(bytes(frame))


def test_invoke_endpoint_passes_headers(smr, fake_lmi) -> None:
    resp = smr.invoke_endpoint(EndpointName="my-ep", Body=json.dumps({"inputs": "hi there"}),
                               ContentType="application/json", Accept="application/json",
                               CustomAttributes="adapter=a1;x=y")
    assert json.loads(resp["Body"].read()) == {"generated_text": "hi there"}
    assert resp["ContentType"] == "application/json"
    assert resp["InvokedProductionVariant"] == "AllTraffic"
    assert resp["CustomAttributes"] == "adapter=a1;x=y"  # echoed back by the fake container
    seen = fake_lmi.requests[-1]
    assert seen["path"] == "/invocations"
    assert seen["headers"]["Content-Type"] == "application/json"
    assert seen["headers"]["Accept"] == "application/json"
    assert seen["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == "adapter=a1;x=y"


@pytest.mark.parametrize("status", [400, 503])
def test_upstream_error_becomes_model_error(smr, status: int) -> None:
    with pytest.raises(smr.exceptions.ModelError) as info:
        smr.invoke_endpoint(EndpointName="ep", Body=json.dumps({"inputs": f"error{status}"}),
                            ContentType="application/json")
    response = info.value.response
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert response["OriginalStatusCode"] == status
    assert json.loads(response["OriginalMessage"]) == {"error": f"fake failure {status}", "code": status}
    assert f"({status}) from primary" in response["Error"]["Message"]
    assert response["LogStreamArn"].startswith("arn:aws:logs:")


def test_stream_frames_parse_with_event_stream_buffer(gateway) -> None:
    resp = requests.post(gateway.url + "/endpoints/ep/invocations-response-stream", data=STREAM_BODY,
                         headers={"Content-Type": "application/json"})
    assert resp.headers["Content-Type"] == "application/vnd.amazon.eventstream"
    assert resp.headers["X-Amzn-SageMaker-Content-Type"] == "application/jsonlines"
    events = decode(resp.content)
    assert {e.headers[":event-type"] for e in events} == {"PayloadPart"}
    lines = b"".join(e.payload for e in events).splitlines()
    assert json.loads(lines[-1])["generated_text"] == "alpha beta gamma"


def test_stream_with_boto3_and_line_iterator(smr) -> None:
    resp = smr.invoke_endpoint_with_response_stream(EndpointName="ep", Body=STREAM_BODY,
                                                    ContentType="application/json", CustomAttributes="k=v")
    assert resp["ContentType"] == "application/jsonlines"
    assert resp["InvokedProductionVariant"] == "AllTraffic"
    assert resp["CustomAttributes"] == "k=v"
    records = [json.loads(line) for line in LineIterator(resp["Body"])]
    assert "".join(r["token"]["text"] for r in records) == "alpha beta gamma"
    assert records[-1]["generated_text"] == "alpha beta gamma"


def test_stream_accept_header_forwarded(smr, fake_lmi) -> None:
    resp = smr.invoke_endpoint_with_response_stream(EndpointName="ep", Body=STREAM_BODY,
                                                    ContentType="application/json", Accept="application/jsonlines")
    list(resp["Body"])
    assert fake_lmi.requests[-1]["headers"]["Accept"] == "application/jsonlines"


def test_upstream_breaking_mid_stream_gives_model_stream_error(smr) -> None:
    resp = smr.invoke_endpoint_with_response_stream(
        EndpointName="ep", Body=json.dumps({"inputs": "break", "stream": True}), ContentType="application/json")
    it = LineIterator(resp["Body"])
    with pytest.raises(ModelStreamError, match="broken"):
        list(it)


def test_stream_upstream_error_before_first_byte_is_model_error(smr) -> None:
    with pytest.raises(smr.exceptions.ModelError) as info:
        smr.invoke_endpoint_with_response_stream(
            EndpointName="ep", Body=json.dumps({"inputs": "error400", "stream": True}), ContentType="application/json")
    assert info.value.response["OriginalStatusCode"] == 400


def test_endpoint_mapping_and_unknown_endpoint(fake_lmi) -> None:
    with Gateway(endpoints={"known": fake_lmi.url}) as gw:
        client = runtime_client(gw.url)
        body = client.invoke_endpoint(EndpointName="known", Body=b'{"inputs": "a"}', ContentType="application/json")
        assert json.loads(body["Body"].read())["generated_text"] == "a"
        with pytest.raises(client.exceptions.ValidationError, match="unknown-ep"):
            client.invoke_endpoint(EndpointName="unknown-ep", Body=b"{}", ContentType="application/json")


def test_unreachable_upstream_is_model_error() -> None:
    with Gateway(f"http://127.0.0.1:{free_port()}") as gw:
        client = runtime_client(gw.url)
        with pytest.raises(client.exceptions.ModelError, match="Could not reach"):
            client.invoke_endpoint(EndpointName="ep", Body=b"{}", ContentType="application/json")


def test_cli_serves(fake_lmi) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sdk.gateway", "--upstream", fake_lmi.url, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        client = runtime_client(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while True:
            try:
                resp = client.invoke_endpoint(EndpointName="cli", Body=b'{"inputs": "x y"}', ContentType="application/json")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert json.loads(resp["Body"].read())["generated_text"] == "x y"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("stream", [False, True])
def test_client_hanging_up_closes_the_upstream_request(gateway, fake_lmi, caplog, capfd, stream) -> None:
    """boto3 gives up (read timeout) on a request the container is still working on: the gateway
    closes its upstream request at once (the container then aborts it) and logs one line."""
    caplog.set_level(logging.INFO, logger="sdk.gateway")
    before = len(fake_lmi.hung_up)
    client = runtime_client(gateway.url, read_timeout=1)
    body = json.dumps({"inputs": "slow", "stream": stream})
    with pytest.raises((ReadTimeoutError, StreamReadTimeoutError)):  # botocore's, or the raw stream's
        if stream:
            resp = client.invoke_endpoint_with_response_stream(EndpointName="ep", Body=body,
                                                               ContentType="application/json")
            try:
                list(resp["Body"])
            finally:
                resp["Body"].close()
        else:
            client.invoke_endpoint(EndpointName="ep", Body=body, ContentType="application/json")
    gave_up = time.monotonic()
    while len(fake_lmi.hung_up) == before and time.monotonic() < gave_up + 3:
        time.sleep(0.05)
    assert len(fake_lmi.hung_up) == before + 1 and fake_lmi.hung_up[-1] - gave_up < 1.5
    time.sleep(0.3)  # the gateway's handler thread finishes
    gone = [r for r in caplog.records if r.name == "sdk.gateway" and "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].exc_info is None, [r.getMessage() for r in caplog.records]
    assert "Traceback" not in capfd.readouterr().err
