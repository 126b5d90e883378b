"""Deploy helpers on the sagemaker SDK 2.x API (``sagemaker<3``; tested with 2.257.7).

``lmi_env()`` builds the LMI environment map; ``deploy()`` runs ``sagemaker.Model(...).deploy(...)``
with ``wait=False`` and then our own ``DescribeEndpoint`` poll (the SDK's wait sleeps 30 s before its
first look, which is needless under moto); the returned ``Deployment`` gives a ``Predictor``, a
``StreamingClient`` and ``delete()``.

SDK 3.x removed ``sagemaker.Model`` / ``Predictor``. The 3.x equivalent of ``deploy()`` is::

    from sagemaker.core.resources import Model, EndpointConfig, Endpoint
    from sagemaker.core.shapes import ContainerDefinition, ProductionVariant
    Model.create(model_name=name, execution_role_arn=role,
                 primary_container=ContainerDefinition(image=image_uri, environment=env))
    EndpointConfig.create(endpoint_config_name=name, production_variants=[ProductionVariant(
        variant_name="AllTraffic", model_name=name, instance_type=instance_type, initial_instance_count=1)])
    endpoint = Endpoint.create(endpoint_name=name, endpoint_config_name=name)
    endpoint.wait_for_status(target_status="InService")
    endpoint.invoke(body=..., content_type="application/json")           # Predictor.predict
    endpoint.invoke_with_response_stream(body=..., content_type=...)     # + sdk.iterators.LineIterator

(or ``sagemaker.serve.ModelBuilder(...).build().deploy()``); plain boto3 works with either SDK.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sdk.client import StreamingClient

DEFAULT_INSTANCE_TYPE = "ml.g5.4xlarge"


class DeploymentError(RuntimeError):
    """The endpoint ended in a status other than InService, or did not get there in time."""


def lmi_env(
    model_id: str, *, rolling_batch: str = "vllm", tensor_parallel_degree: str | int = "max",
    max_rolling_batch_size: int | None = None, dtype: str | None = None, **options: Any,
) -> dict[str, str]:
    """The LMI environment map: ``HF_MODEL_ID`` plus ``OPTION_<NAME>`` for each option.

    >>> lmi_env("/opt/ml/model", dtype="fp16", max_model_len=4096)["OPTION_MAX_MODEL_LEN"]
    '4096'
    """
    env = {
        "HF_MODEL_ID": model_id,
        "OPTION_ROLLING_BATCH": rolling_batch,
        "TENSOR_PARALLEL_DEGREE": str(tensor_parallel_degree),
    }
    if max_rolling_batch_size is not None:
        options["max_rolling_batch_size"] = max_rolling_batch_size
    if dtype is not None:
        options["dtype"] = dtype
    for key, value in options.items():
        if value is not None:
            env[f"OPTION_{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def wait_for_endpoint(
    sagemaker_client: Any, endpoint_name: str, *, poll_interval_s: float = 30.0, timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Poll DescribeEndpoint until InService (returned) or a final failure (DeploymentError).

    Unlike the SDK's ``Session.wait_for_endpoint``, this looks before it sleeps.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        desc = sagemaker_client.describe_endpoint(EndpointName=endpoint_name)
        status = desc["EndpointStatus"]
        if status == "InService":
            return desc
        if status not in ("Creating", "Updating", "SystemUpdating"):
            raise DeploymentError(f"endpoint {endpoint_name} is {status}: {desc.get('FailureReason')}")
        if time.monotonic() > deadline:
            raise DeploymentError(f"endpoint {endpoint_name} still {status} after {timeout_s:.0f} s")
        time.sleep(poll_interval_s)


@dataclass
class Deployment:
    """A deployed endpoint and the objects to use and remove it."""

    model: Any  # sagemaker.Model
    endpoint_name: str
    session: Any  # sagemaker.Session

    def predictor(self) -> Any:
        """A JSON-in/JSON-out ``sagemaker.Predictor`` (the base Model's deploy returns None)."""
        import sagemaker

        return sagemaker.Predictor(
            endpoint_name=self.endpoint_name, sagemaker_session=self.session,
            serializer=sagemaker.serializers.JSONSerializer(),
            deserializer=sagemaker.deserializers.JSONDeserializer(),
        )

    def client(self) -> StreamingClient:
        """A StreamingClient over the session's ``sagemaker-runtime`` client."""
        return StreamingClient.from_endpoint(self.endpoint_name, client=self.session.sagemaker_runtime_client)

    def describe(self) -> dict[str, Any]:
        return self.session.sagemaker_client.describe_endpoint(EndpointName=self.endpoint_name)

    def environment(self) -> dict[str, str]:
        """The container Environment SageMaker will start the model with."""
        return model_environment(self.session.sagemaker_client, self.endpoint_name)

    def delete(self) -> None:
        """Delete the endpoint, its config and the model."""
        client = self.session.sagemaker_client
        config = self.describe().get("EndpointConfigName", self.endpoint_name)
        client.delete_endpoint(EndpointName=self.endpoint_name)
        client.delete_endpoint_config(EndpointConfigName=config)
        self.model.delete_model()


def model_environment(sagemaker_client: Any, endpoint_name: str) -> dict[str, str]:
    """Endpoint -> endpoint config -> first variant's model -> its container Environment."""
    config_name = sagemaker_client.describe_endpoint(EndpointName=endpoint_name)["EndpointConfigName"]
    config = sagemaker_client.describe_endpoint_config(EndpointConfigName=config_name)
    model_name = config["ProductionVariants"][0]["ModelName"]
    model = sagemaker_client.describe_model(ModelName=model_name)
    container = model.get("PrimaryContainer") or (model.get("Containers") or [{}])[0]
    return dict(container.get("Environment") or {})


def deploy(
    image_uri: str, role: str, env: dict[str, str], instance_type: str = DEFAULT_INSTANCE_TYPE, *,
    initial_instance_count: int = 1, endpoint_name: str | None = None, sagemaker_session: Any = None,
    model_data: Any = None, container_startup_health_check_timeout: int | None = None,
    wait: bool = True, poll_interval_s: float = 30.0, timeout_s: float = 3600.0, **deploy_kwargs: Any,
) -> Deployment:
    """``sagemaker.Model(image_uri, role, env).deploy(...)``, then wait with our own poll.

    Args:
        env: the container environment, e.g. ``lmi_env(...)``.
        endpoint_name: defaults to ``name_from_base("open-lmi")``.
        poll_interval_s: seconds between DescribeEndpoint calls (use ~0.1 under moto).
        deploy_kwargs: passed to ``Model.deploy`` (volume_size, model_data_download_timeout, ...).
    """
    import sagemaker

    session = sagemaker_session or sagemaker.Session()
    endpoint_name = endpoint_name or sagemaker.utils.name_from_base("open-lmi")
    model = sagemaker.Model(
        image_uri=image_uri, role=role, env=dict(env), model_data=model_data, sagemaker_session=session,
    )
    if container_startup_health_check_timeout is not None:
        deploy_kwargs["container_startup_health_check_timeout"] = container_startup_health_check_timeout
    model.deploy(
        initial_instance_count=initial_instance_count, instance_type=instance_type,
        endpoint_name=endpoint_name, wait=False, **deploy_kwargs,
    )
    if wait:
        wait_for_endpoint(session.sagemaker_client, endpoint_name, poll_interval_s=poll_interval_s, timeout_s=timeout_s)
    return Deployment(model=model, endpoint_name=endpoint_name, session=session)
