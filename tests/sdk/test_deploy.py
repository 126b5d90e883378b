"""Deploy helpers on sagemaker 2.x under moto (control plane) + the gateway (data plane, fake container)."""

from __future__ import annotations

import json
import time

import pytest

from sdk.deploy import DeploymentError, deploy, lmi_env, wait_for_endpoint
from sdk.iterators import LineIterator
from sdk.local import LocalSageMaker


@pytest.fixture(scope="module")
def local():
    with LocalSageMaker() as stack:
        yield stack


def test_lmi_env() -> None:
    env = lmi_env("/opt/ml/model", max_rolling_batch_size=2, dtype="fp16", enable_prefix_caching=True, max_model_len=None)
    assert env == {"HF_MODEL_ID": "/opt/ml/model", "OPTION_ROLLING_BATCH": "vllm", "TENSOR_PARALLEL_DEGREE": "max",
                   "OPTION_MAX_ROLLING_BATCH_SIZE": "2", "OPTION_DTYPE": "fp16", "OPTION_ENABLE_PREFIX_CACHING": "true"}


def test_deploy_predict_stream_delete(local, fake_lmi) -> None:
    env = lmi_env("/opt/ml/model", dtype="fp16")
    t0 = time.monotonic()
    dep = deploy("local/open-lmi:test", local.create_role(), env, "ml.g5.4xlarge", endpoint_name="dep-test",
                 sagemaker_session=local.session(), poll_interval_s=0.05, container_startup_health_check_timeout=600)
    assert time.monotonic() - t0 < 10  # no 30 s SDK sleep
    assert dep.describe()["EndpointStatus"] == "InService"
    assert dep.environment() == env
    config = local.sagemaker_client.describe_endpoint_config(EndpointConfigName="dep-test")
    variant = config["ProductionVariants"][0]
    assert variant["InstanceType"] == "ml.g5.4xlarge"
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 600
    local.start_container("dep-test", url=fake_lmi.url)
    assert dep.predictor().predict({"inputs": "a b c"}) == {"generated_text": "a b c"}
    assert dep.client().stream("x y").text == "x y"
    # The SDK's own streaming entry point accepts our iterator class.
    lines = list(dep.predictor().predict_stream({"inputs": "p q", "stream": True}, iterator=LineIterator))
    assert json.loads(lines[-1])["generated_text"] == "p q"
    dep.delete()
    names = [e["EndpointName"] for e in local.sagemaker_client.list_endpoints()["Endpoints"]]
    assert "dep-test" not in names


def test_wait_for_endpoint_failure() -> None:
    class Client:
        def describe_endpoint(self, EndpointName: str) -> dict:
            return {"EndpointStatus": "Failed", "FailureReason": "CapacityError: none left"}

    with pytest.raises(DeploymentError, match="CapacityError"):
        wait_for_endpoint(Client(), "x", poll_interval_s=0)
