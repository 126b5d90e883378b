"""Issue 10: one request must never take the server down (nor its metrics, nor its memory).

One server for the module, started with a small job queue. Covers the bounded `route` label of
`lmi_requests_total` (unknown paths and methods share one bucket).
"""

from __future__ import annotations

import re
import uuid

import pytest
import requests
from lmi_server import LMIServer

pytestmark = pytest.mark.slow
QUEUE = 8  # job_queue_size of the module's server
ROUTES = {"/invocations", "/v1/completions", "/v1/chat/completions"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("reliability")
    srv = LMIServer({"SERVING_JOB_QUEUE_SIZE": str(QUEUE)}, cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def _metrics_text(server) -> str:
    return requests.get(server.url + "/metrics", timeout=10).text


def _route_labels(text: str) -> dict[tuple[str, str], float]:
    pairs = re.findall(r'^lmi_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M)
    return {(route, status): float(value) for route, status, value in pairs}


def test_metrics_route_label_is_the_route_template_or_one_bucket(server):
    """300 distinct unknown paths and unknown methods add no time series to /metrics."""
    before_text = _metrics_text(server)
    before = _route_labels(before_text)
    tag = uuid.uuid4().hex[:8]
    with requests.Session() as s:
        for i in range(150):
            assert s.get(f"{server.url}/no/such/{tag}/{i}", timeout=10).status_code == 404
            assert s.post(f"{server.url}/v1/{tag}-{i}", json={}, timeout=10).status_code == 404
        assert s.request("BREW", server.url + "/invocations", timeout=10).status_code == 405
        assert s.get(server.url + "/v1/completions", timeout=10).status_code == 405
        assert s.post(server.url + "/invocations", data=b"{", timeout=10).status_code == 400
    text = _metrics_text(server)
    after = _route_labels(text)
    assert {route for route, _ in after} <= ROUTES | {"unmatched"}, sorted(after)
    assert tag not in text
    assert after[("unmatched", "404")] - before.get(("unmatched", "404"), 0) == 300
    assert after[("unmatched", "405")] - before.get(("unmatched", "405"), 0) == 2
    assert after[("/invocations", "400")] - before.get(("/invocations", "400"), 0) == 1
    assert len(text) < len(before_text) + 500  # at most the new buckets' lines, not one per path
