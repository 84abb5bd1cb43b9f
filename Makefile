# `make test` sets up a fresh machine and runs the suite; `.ci/run` calls it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: test install plugins clean

test: install
	$(VENV)/bin/pytest -q tests

# Dependencies once (torch==2.13.0 first, so nothing pulls a CUDA build), then our three
# distributions reinstalled non-editable on every run, as a user installs them.
$(VENV)/.deps: pyproject.toml models/pyproject.toml plugins/cpu/pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip "setuptools>=77" wheel
	$(PIP) torch==2.13.0
	$(PIP) "./[test]" ./models ./plugins/cpu
	touch $@

install: $(VENV)/.deps
	$(PIP) --no-deps --no-build-isolation --force-reinstall ./ ./models ./plugins/cpu

plugins: install
	$(PY) -m chitu_core.plugins

clean:
	rm -rf $(VENV) build */build plugins/*/build *.egg-info */*.egg-info plugins/*/*.egg-info
