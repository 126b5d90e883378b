"""`python -m sdk.local SCRIPT`: the seed's SageMaker deploy-and-invoke code (seed-code.md §1, only the
image URI and model id changed), run unchanged by one command: moto accepts ml.g5.4xlarge, the first
invocation starts a real `container/serve` with the deployed Environment, and nothing outlives the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdk.local import SERVE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SERVE.exists(), reason="container/serve missing")]

SEED = '''
import json
import boto3
import sagemaker

iam_role = "arn:aws:iam::1111111111:role/service-role/AmazonSageMaker-ExecutionRole-00000000T000000"
sagemaker_session = sagemaker.session.Session()
region = sagemaker_session._region_name
smr_client = boto3.client("sagemaker-runtime")
container_uri = "open-lmi:local"
instance_type = "ml.g5.4xlarge"
endpoint_name = sagemaker.utils.name_from_base("phi3-4k-lmi-endpoint")
model = sagemaker.Model(
    image_uri=container_uri,
    role=iam_role,
    env={
        "HF_MODEL_ID": MODEL_DIR,
        "OPTION_ROLLING_BATCH": "vllm",
        "TENSOR_PARALLEL_DEGREE": "max",
        "OPTION_MAX_ROLLING_BATCH_SIZE": "2",
        "OPTION_DTYPE": "fp16",
    },
)
model.deploy(instance_type=instance_type, initial_instance_count=1, endpoint_name=endpoint_name)
predictor = sagemaker.Predictor(
    endpoint_name=endpoint_name,
    sagemaker_session=sagemaker_session,
    serializer=sagemaker.serializers.JSONSerializer(),
    deserializer=sagemaker.deserializers.JSONDeserializer(),
)
outputs = predictor.predict({"inputs": "The meaning of life is", "parameters": {"do_sample": True, "max_new_tokens": 8}})
print("GENERATED", json.dumps(outputs["generated_text"]))
'''


def test_one_command_runs_the_seed_deploy_flow_and_leaves_nothing_running(smollm2_path, tmp_path):
    script = tmp_path / "seed004.py"
    script.write_text(SEED.replace("MODEL_DIR", repr(str(smollm2_path))))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "HF_MODEL", "AWS_"))}
    env.update(OMP_NUM_THREADS="1", OPTION_KV_CACHE_MEMORY_GB="0.25", OPTION_MAX_MODEL_LEN="512")
    p = subprocess.run([sys.executable, "-m", "sdk.local", str(script)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=400, start_new_session=True)
    assert p.returncode == 0, p.stderr[-4000:]
    generated = json.loads(p.stdout.split("GENERATED ", 1)[1].splitlines()[0])  # after deploy's "!" progress
    assert isinstance(generated, str) and generated.strip()
    assert not _servers_started_here(), "a container process outlived the command"
    h = subprocess.run([sys.executable, "-m", "sdk.local", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert h.returncode == 0 and h.stdout.startswith("usage: python -m sdk.local SCRIPT")


def _servers_started_here() -> list[int]:
    """gunicorn processes whose working dir is this checkout (where sdk.local starts its containers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and b"serving.server.wsgi" in (proc / "cmdline").read_bytes()
                    and Path(os.readlink(proc / "cwd")) == ROOT):
                found.append(int(proc.name))
        except OSError:
            continue
    return found
