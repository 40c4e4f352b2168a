# The two commands of the README: `make demo` (set up + run the main job, no GPU) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.specctl-stamp

$(VENV)/.specctl-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip
	@# a .venv from before the distribution was named sglang-specctl holds `specctl`: one copy of the plugin only
	-$(PY) -m pip uninstall --disable-pip-version-check -q -y specctl 2>/dev/null
	$(PY) -m pip install --disable-pip-version-check -q -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/specctl demo

SGLANG_VERSIONS ?= 0.5.17 0.5.23
TEST_JOBS ?= 4

# every test; then the plugin against the real sglang modules of each supported release
# (CPU environments under .cache/, built by scripts/setup_sglang_cpu.sh while the suite runs)
test: setup
	PY=$(PY) TEST_JOBS=$(TEST_JOBS) SGLANG_VERSIONS="$(SGLANG_VERSIONS)" bash scripts/test_all.sh

# the quick tests of this interpreter (no sglang environments)
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not sglang and not sglang_sources"

bench: setup
	$(PY) benchmarks/control_loop.py all

clean:
	rm -rf $(VENV) .cache build *.egg-info
