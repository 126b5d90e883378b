"""Run the whole SageMaker path on one machine: a container process, moto, and the gateway.

``ContainerProcess`` starts ``container/serve serve`` as a subprocess on a free port (the way
SageMaker runs the image) and waits for ``/ping``. ``LocalSageMaker`` starts moto's server for the
control plane (CreateModel/EndpointConfig/Endpoint) and our gateway for the data plane, and hands out a
``sagemaker.Session`` wired to both. For tests, notebooks and laptops; nothing here is needed on AWS.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sdk.gateway import Gateway

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE = REPO_ROOT / "container" / "serve"
REGION = "us-east-1"
DUMMY_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model_dir() -> Path:
    """Where the container keeps the embedded default model (SmolLM2-135M-Instruct, HF format).

    Mirrors ``serving.checkpoint.default_model`` (``$OPEN_LMI_CACHE`` or ``~/.cache/open-lmi``) without importing
    it: the SDK must not depend on the server or torch.
    """
    root = os.environ.get("OPEN_LMI_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "open-lmi"
    return base / "smollm2-135m-instruct"


def ensure_default_model(python: str = sys.executable) -> Path:
    """Convert the default model once if needed (runs the server package in a subprocess)."""
    target = default_model_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    code = "from serving.checkpoint.default_model import default_model_path; print(default_model_path())"
    out = subprocess.run([python, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class ContainerProcess:
    """``container/serve serve`` as a child process; ``url`` once ``wait_ready()`` returns."""

    def __init__(self, env: Mapping[str, str] | None = None, *, port: int | None = None,
                 command: list[str] | None = None, log_path: str | Path | None = None) -> None:
        self.port = port or free_port()
        # OPEN_LMI_SERVE: another `serve` entrypoint (a different checkout, a wrapper script).
        self.command = command or [os.environ.get("OPEN_LMI_SERVE", str(SERVE)), "serve"]
        self.env = {**os.environ, **(env or {}), "SAGEMAKER_BIND_TO_PORT": str(self.port)}
        # The venv's bin first, so `serve` finds the same python as the caller.
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="open-lmi-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ContainerProcess:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, env=self.env, cwd=REPO_ROOT, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        atexit.register(self.stop)  # a failed notebook cell or test must not leave a server running
        return self

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 240.0) -> ContainerProcess:
        """Poll ``GET /ping`` until 200; raise with the log tail if the process dies or time runs out."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"container exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/ping", timeout=2).status_code == 200:
                    return self
            time.sleep(0.25)
        self.stop()  # never leave a half-started server behind
        raise TimeoutError(f"container not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (as SageMaker does), then SIGKILL after ``grace_s``; returns the exit code."""
        atexit.unregister(self.stop)
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(5)

    def __enter__(self) -> ContainerProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def patch_moto_instance_types() -> None:
    """moto validates InstanceType against an old list without g5/g6/p4d/p5; accept any type."""
    from moto.sagemaker import models

    models.FakeEndpointConfig.validate_instance_type = lambda self, instance_type: None  # type: ignore[method-assign]


@contextlib.contextmanager
def fast_sdk_waits(poll_s: float = 0.05) -> Iterator[None]:
    """Shorten the sagemaker SDK's polling (``_wait_until`` sleeps ``poll``=30 s before each look)."""
    import sagemaker.session as sm_session

    original = sm_session._wait_until

    def fast(callable_fn: Any, poll: float = 5) -> Any:
        return original(callable_fn, min(poll, poll_s))

    sm_session._wait_until = fast
    try:
        yield
    finally:
        sm_session._wait_until = original


def aws_credentials_available() -> bool:
    """True if boto3 finds credentials (env, profile, instance role) -- i.e. a real AWS run is possible."""
    import boto3

    return boto3.Session().get_credentials() is not None


class LocalSageMaker:
    """moto (control plane) + gateway (data plane) on 127.0.0.1, with container processes per endpoint."""

    def __init__(self, region: str = REGION, start_on_first_call: bool = False) -> None:
        """``start_on_first_call``: an endpoint's first invocation starts its container (its model
        Environment, as moto stored it) and waits for ``/ping``, as ``start_container`` would."""
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request access log
        patch_moto_instance_types()
        self.region = region
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.control_plane_url = f"http://{host}:{port}"
        self.gateway = Gateway().start()
        self.boto_session = boto3.Session(region_name=region, **DUMMY_CREDENTIALS)
        self.sagemaker_client = self.boto_session.client("sagemaker", endpoint_url=self.control_plane_url)
        self.runtime_client = self.boto_session.client("sagemaker-runtime", endpoint_url=self.gateway.url)
        self.containers: dict[str, ContainerProcess] = {}
        self._starting = threading.Lock()
        if start_on_first_call:
            self.gateway.upstreams.on_unknown = self._start_on_first_call

    def _start_on_first_call(self, endpoint_name: str) -> str | None:
        """The container of an endpoint moto knows, started now (one at a time); None if moto does not."""
        with self._starting:
            url = self.gateway.upstreams.endpoints.get(endpoint_name)
            if url is not None:
                return url
            try:
                self.sagemaker_client.describe_endpoint(EndpointName=endpoint_name)
            except self.sagemaker_client.exceptions.ClientError:
                return None
            return self.start_container(endpoint_name)

    @property
    def environ(self) -> dict[str, str]:
        """Env vars that point unchanged boto3/sagemaker code (``boto3.client("sagemaker-runtime")``,
        ``sagemaker.session.Session()``) at this local stack."""
        return {
            "AWS_DEFAULT_REGION": self.region, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_ENDPOINT_URL_SAGEMAKER": self.control_plane_url,
            "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": self.gateway.url,
        }

    def session(self) -> Any:
        """A ``sagemaker.Session`` whose clients talk to moto and to the gateway."""
        import sagemaker

        return sagemaker.Session(boto_session=self.boto_session, sagemaker_client=self.sagemaker_client,
                                 sagemaker_runtime_client=self.runtime_client)

    def create_role(self, name: str = "open-lmi-sagemaker-role") -> str:
        """An IAM role ARN in moto (SageMaker needs one to create a model)."""
        iam = self.boto_session.client("iam", endpoint_url=self.control_plane_url)
        with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
            iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")
        return iam.get_role(RoleName=name)["Role"]["Arn"]

    def model_environment(self, endpoint_name: str) -> dict[str, str]:
        """The Environment of the model behind ``endpoint_name``, as moto stored it."""
        from sdk.deploy import model_environment

        return model_environment(self.sagemaker_client, endpoint_name)

    def start_container(self, endpoint_name: str, extra_env: Mapping[str, str] | None = None,
                        timeout_s: float = 240.0, url: str | None = None) -> str:
        """Play SageMaker's part: run the endpoint's model Environment in a container process and route
        the endpoint name to it. With ``url``, route to that already running container instead."""
        if url is None:
            env = {**self.model_environment(endpoint_name), **(extra_env or {})}
            container = ContainerProcess(env).start()
            self.containers[endpoint_name] = container
            url = container.wait_ready(timeout_s).url
        self.gateway.upstreams.add(endpoint_name, url)
        return url

    def close(self) -> None:
        for container in self.containers.values():
            container.stop()
        self.gateway.stop()
        self._moto.stop()

    def __enter__(self) -> LocalSageMaker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


USAGE = """usage: python -m sdk.local SCRIPT [ARGS...]

Runs SCRIPT (your unchanged sagemaker / boto3 code) against a local SageMaker: moto for the control
plane (any instance type accepted, e.g. ml.g5.4xlarge), sdk.gateway for sagemaker-runtime, and for
each endpoint a `container/serve serve` process with its model's Environment, started on its first
invocation. The SDK's 30 s first wait is shortened. Everything stops when SCRIPT ends, on Ctrl-C and
on SIGTERM to this process."""


def main(argv: list[str] | None = None) -> int:
    """``python -m sdk.local SCRIPT [ARGS...]``: the SageMaker deploy flow on this machine, one command."""
    import runpy

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    script = args[0]

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the context managers: containers stopped

    signal.signal(signal.SIGTERM, stop)
    with LocalSageMaker(start_on_first_call=True) as local, fast_sdk_waits():
        os.environ.update(local.environ)
        sys.argv = list(args)
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
