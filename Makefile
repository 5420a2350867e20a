# The README's two commands: `make demo` and `make test`. Each creates .venv when it is missing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

.PHONY: demo test bench
demo: $(STAMP)
	$(VENV)/bin/prophet-jax demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

bench: $(STAMP)
	$(VENV)/bin/python bench/scaling.py
