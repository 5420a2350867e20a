# The README's commands: `make demo`, `make test` and `make test-latest`. `make demo` and `make test` create
# .venv (this machine's Python; Python 3.11 resolves jax 0.10.2) when it is missing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST_ARGS := -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

# setuptools >= 77 and wheel in the venv too (what [build-system] names), so that `pip install
# --no-build-isolation -e .` works in it: Python 3.11's venv brings setuptools 65, which refuses the license string
$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip "setuptools>=77" wheel
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

.PHONY: demo test test-latest bench
demo: $(STAMP)
	$(VENV)/bin/prophet-jax demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The same suite on the newest jax, flax and optax on PyPI (jax >= 0.11 needs Python >= 3.12), in a Debian 13
# root (Python 3.13) built once under .latest/ and reused; compiles for GPUs with CUDA 13
# (LATEST_EXTRA=test for CUDA 12). Needs root, as CI runs. See .ci/latest.
test-latest:
	.ci/latest test $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python bench/scaling.py
