# The two commands of the README: `make demo` (set up + run the main job, no GPU) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.specctl-stamp

$(VENV)/.specctl-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip
	$(PY) -m pip install --disable-pip-version-check -q -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/specctl demo

# the sglang CPU environments (0.5.17 and 0.5.23) for the plugin tests, then every test
test: setup
	bash scripts/setup_sglang_cpu.sh
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) benchmarks/control_loop.py all

clean:
	rm -rf $(VENV) .cache build *.egg-info
