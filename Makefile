# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NPROC   ?= 4

.PHONY: demo test test-torch-next lint bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps nvidia-physicsnemo==2.2.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/gpt/demo.py --nproc $(NPROC)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -x --timeout=300 tests

# The newest torch that installs here, in a venv of its own: the suite on the other end of the supported range.
NEXT       := .venv-torch-next
NEXT_TORCH ?= 2.14.1
$(NEXT)/.installed: pyproject.toml
	test -x $(NEXT)/bin/python || $(PY) -m venv $(NEXT)
	$(NEXT)/bin/python -m pip install -q --upgrade pip
	$(NEXT)/bin/python -m pip install -q torch==$(NEXT_TORCH)
	$(NEXT)/bin/python -m pip install -q -e '.[dev]'
	$(NEXT)/bin/python -m pip install -q --no-deps nvidia-physicsnemo==2.2.2
	touch $@

test-torch-next: $(NEXT)/.installed
	$(NEXT)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(NEXT)/bin/python -m pytest -q -x --timeout=300 tests

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(NEXT) runs .pytest_cache .ruff_cache
