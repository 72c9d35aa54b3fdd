# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NPROC   ?= 4

.PHONY: demo test test-fast test-torch-next gpu-check print-next-venv lint docs bench install clean

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

# ruff, then the layer and no-circle contracts of pyproject.toml (import-linter) and no private name imported
# across files (tools/check_private_imports.py): docs/layout.md.
lint: $(STAMP) docs
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python tools/check_private_imports.py src/meshwise

# The documentation site with the API reference from the docstrings (mkdocs.yml; a few seconds), into site/:
# --strict fails on a broken link or anchor and on an API block that no longer resolves. `make lint` builds it.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict -d site  # not -q: it hides the warnings that --strict counts

test: lint
	$(BIN)/python -c "import torch; print('make test: torch', torch.__version__)"
	$(BIN)/python -m pytest -q -x --timeout=300 -n 2 --dist loadfile tests

# The edit loop (about 1.5 minutes on 2 cores): the one-process tests and the quick multi-process files, without
# `slow` tests. It leaves out the files that start `meshwise run`/torchrun or fresh interpreters (checkpoint fault
# and resume, debug, dry runs, the examples, multinode, physicsnemo, quickstart, topology's CLI runs) and the long
# equivalence files; docs/dev/test-durations.md lists what each file costs. `make test` stays the gate.
FAST_TESTS := compat data_sampler data_parts data_edges checkpoint_format checkpoint_security trainer_habits \
	hf_export hf_loss engine ignite_metrics context_routing hf_pipeline checkpoint_engine physicsnemo_ops \
	evaluation data_dist ignite_checkpoint hf_finetune slurm_env
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=300 -m "not slow" $(FAST_TESTS:%=tests/test_%.py)

# The newest torch that installs here, in a venv of its own: the suite on the other end of the supported range.
# PyPI's Linux wheels of it are CUDA builds (several GB), so this venv also runs `make gpu-check`. The stamp names
# the version: `make test-torch-next NEXT_TORCH=x.y.z` installs x.y.z over the old one (NEXT=dir: elsewhere).
NEXT       ?= .venv-torch-next
NEXT_TORCH ?= 2.14.1
NEXT_STAMP := $(NEXT)/.installed-$(NEXT_TORCH)
$(NEXT_STAMP): pyproject.toml
	test -x $(NEXT)/bin/python || $(PY) -m venv $(NEXT)
	$(NEXT)/bin/python -m pip install -q --upgrade pip
	$(NEXT)/bin/python -m pip install -q torch==$(NEXT_TORCH)
	$(NEXT)/bin/python -m pip install -q -e '.[dev]'
	$(NEXT)/bin/python -m pip install -q --no-deps nvidia-physicsnemo==2.2.2
	$(NEXT)/bin/python -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(v != '$(NEXT_TORCH)' and f'torch {v} in $(NEXT), not $(NEXT_TORCH)')"
	rm -f $(NEXT)/.installed*
	touch $@

test-torch-next: $(NEXT_STAMP)
	$(NEXT)/bin/python -c "import torch; print('make test-torch-next: torch', torch.__version__)"
	$(NEXT)/bin/python -m pytest -q -x --timeout=300 -n 2 --dist loadfile tests

print-next-venv:
	@echo $(NEXT)

# The CUDA/NCCL checks (tests/test_cuda.py, docs/gpu.md) on every GPU of this machine, on the CUDA build of the
# next-torch venv (.venv has torch's CPU build). Refuses to pass without a GPU instead of skipping everything;
# `make gpu-check MESHWISE_CHECK_DEVICE=cpu` runs the same scripts on CPU/gloo (MESHWISE_CHECK_NPROC ranks).
MESHWISE_CHECK_DEVICE ?= cuda
gpu-check: $(NEXT_STAMP)
	$(NEXT)/bin/python -c "import torch, sys; print('make gpu-check: torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count()); sys.exit('$(MESHWISE_CHECK_DEVICE)' == 'cuda' and not torch.cuda.is_available() and 'no CUDA device here: run it on a GPU machine (or MESHWISE_CHECK_DEVICE=cpu for the CPU/gloo run)')"
	MESHWISE_CHECK_DEVICE=$(MESHWISE_CHECK_DEVICE) $(NEXT)/bin/python -m pytest -q -s -rs -m cuda --timeout=300 tests/test_cuda.py

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(NEXT) runs .pytest_cache .ruff_cache

# ignite's own metric tests (tests/ignite/metrics of the installed pytorch-ignite, from its source distribution on
# the package index, kept in .ignite-tests/) run plainly and with meshwise's adoption of ignite metrics active
# (tests/ignite_suite/meshwise_adoption.py): in one process, and on 2 gloo ranks through ignite's own distributed
# fixtures (a plain dp mesh). Any difference in outcome that is not a documented refusal fails the target
# (tests/ignite_suite/compare.py, docs/ignite.md). About 7 minutes of tests on 2 cores.
.PHONY: test-ignite-metrics
IGNITE_TESTS := .ignite-tests
IGNITE_SUITE ?= tests/ignite/metrics
IGNITE_PYTEST = CUDA_VISIBLE_DEVICES= $(CURDIR)/$(BIN)/python -m pytest -q -p no:cacheprovider \
	--continue-on-collection-errors --timeout=120 $(IGNITE_SUITE)
IGNITE_MESHWISE = PYTHONPATH=$(CURDIR)/tests/ignite_suite MESHWISE_IGNITE_REPORT=../adoption.txt
IGNITE_DIST = -m distributed --dist=each --tx 2*popen//python=$(CURDIR)/$(BIN)/python
test-ignite-metrics: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,ignite-tests]'
	set -e; v=$$($(BIN)/python -c "import ignite; print(ignite.__version__)"); d=$(IGNITE_TESTS)/$$v; \
	if [ ! -d $$d ]; then \
		rm -rf $(IGNITE_TESTS)/tmp; mkdir -p $(IGNITE_TESTS)/tmp; \
		$(BIN)/python -m pip download -q --no-binary :all: --no-deps pytorch-ignite==$$v -d $(IGNITE_TESTS)/tmp; \
		tar xzf $(IGNITE_TESTS)/tmp/pytorch_ignite-$$v.tar.gz -C $(IGNITE_TESTS)/tmp \
			pytorch_ignite-$$v/tests pytorch_ignite-$$v/pyproject.toml; \
		mv $(IGNITE_TESTS)/tmp/pytorch_ignite-$$v $$d; rm -rf $(IGNITE_TESTS)/tmp; \
	fi; \
	cd $$d; rm -f ../adoption.txt ../*.xml; echo "make test-ignite-metrics: pytorch-ignite $$v"; \
	$(IGNITE_PYTEST) -m "not distributed and not tpu and not multinode_distributed" --junitxml=../plain-1.xml || true; \
	$(IGNITE_MESHWISE) $(IGNITE_PYTEST) -p meshwise_adoption \
		-m "not distributed and not tpu and not multinode_distributed" --junitxml=../meshwise-1.xml || true; \
	WORLD_SIZE=2 $(IGNITE_PYTEST) $(IGNITE_DIST) --junitxml=../plain-2.xml || true; \
	WORLD_SIZE=2 $(IGNITE_MESHWISE) $(IGNITE_PYTEST) -p meshwise_adoption $(IGNITE_DIST) --junitxml=../meshwise-2.xml || true; \
	cat ../adoption.txt; \
	echo "== one process"; $(CURDIR)/$(BIN)/python $(CURDIR)/tests/ignite_suite/compare.py ../plain-1.xml ../meshwise-1.xml; \
	echo "== 2 gloo ranks (dp=2)"; $(CURDIR)/$(BIN)/python $(CURDIR)/tests/ignite_suite/compare.py ../plain-2.xml ../meshwise-2.xml

# The conformance sweep (issue 34, tests/sweep/): every causal-LM family of the installed transformers (its auto
# mapping), built tiny in float64 and trained through meshwise's public road at tp=2, dp=2 x tp=2, cp=2 and pp=2
# against one process: equal, or refused with a MeshwiseError, or the target fails. A few gloo launches; the
# results go to SWEEP_RESULTS, and `make sweep-table` writes them into docs/hf-sweep.md's table (which
# tests/test_sweep_table.py, in `make test`, checks against the installed families).
.PHONY: test-sweep sweep-table
SWEEP_RESULTS ?= runs/sweep/results.json
test-sweep: $(STAMP)
	$(BIN)/python tests/sweep/run.py --out $(SWEEP_RESULTS)

sweep-table:
	$(BIN)/python tests/sweep/table.py $(SWEEP_RESULTS)

# meshwise under a real SLURM (issue 43, docs/cluster.md): tools/slurm/start.sh installs slurm-wlm + munge with apt
# and starts a single-host SLURM 22.05 with two slurmd's in a temporary folder; tests/slurm/real_slurm.py (not named
# test_*.py, so `make test` does not collect it) submits quickstart under srun -n 4 (equal to one process), the
# no-srun slip (refused in seconds), srun -m cyclic (placement warned), scancel (no process left), both
# GPT examples/slurm/*.sbatch as their CPU lines (equal to one process), scontrol requeue and the time limit's
# SIGUSR1 warning to examples/slurm/requeue.sbatch (each resumed, equal to an unbroken run); tools/slurm/stop.sh
# stops it all. Skips, with the reason, where it cannot run (not root, no apt-get).
# About 2.5 to 3 minutes on 2 cores.
.PHONY: test-slurm
test-slurm: $(STAMP)
	$(BIN)/python -m pytest -q -s -rs --timeout=300 tests/slurm/real_slurm.py

# Elastic runs with real torchrun agents on loopback (tests/elastic/): a node lost (its agent and workers SIGKILLed),
# a node joining, SIGTERM mid-epoch, a hung node, hung workers; each run's final weights equal one process's.
# About 3.5 minutes on 2 cores.
.PHONY: test-elastic
test-elastic: $(STAMP)
	$(BIN)/python -m pytest -q -s -rs --timeout=300 tests/elastic/real_agents.py
