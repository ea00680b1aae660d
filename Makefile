# zerolab: everything installs into a local virtualenv (.venv) created from nothing.
#   make run         install, then the default job: a short 2-rank CPU run comparing strategies
#   make test        install, then the whole test suite (what CI runs)
#   make test-fast   install, then the unit tier only (no processes started; under 2 minutes)
#   make docs        the documentation site (MkDocs, offline, --strict) into site/
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install run test test-fast docs clean slurm-deps

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0 setuptools wheel
	# DeepSpeed ships as source and its build imports torch: build it against the torch above.
	$(PY) -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	# DeepSpeed's CPU ops compiled now, into $(VENV)/torch_extensions, so no run or test waits on
	# a first-use compile (zerolab/ds_ops.py). Minutes on 2 cores, once.
	$(PY) -m zerolab.ds_ops build
	touch $(STAMP)

install: $(STAMP)

# The default job: the strategy comparison, short, on 2 CPU ranks (conf/experiment/compare.yaml).
# Each strategy is its own torchrun job (hydra_plugins/zerolab_torchrun) in one sweep directory;
# the sweep ends by printing the report's table and the paths of its PNGs.
# Every registered strategy unless STRATEGIES names some (read from the registry when the recipe
# runs, after install).
STRATEGIES ?= $(shell $(PY) -c "from zerolab.strategies import all_names; print(all_names())")
run: install
	$(PY) train.py -m experiment=compare strategy=$(STRATEGIES) $(ARGS)

# The whole suite, cheap tier first: a broken formula fails in a minute, before the
# multi-process tier (torchrun, DeepSpeed, Slurm) spends its twenty minutes.
# (Exit 5 is pytest's "nothing collected": `ARGS="-k ddp"` may select nothing in one tier.)
# Three pytest workers (pytest-xdist), one test file each at a time (--dist loadfile: a file's
# module-scoped runs are made once): a test's ranks keep the 2 cores about a third busy (they
# wait on each other's collectives, start processes, read files); with two workers, beside a
# one-thread loop, the suite's processes used 28.5 CPU-minutes in 37 minutes of 2 cores
# (2026-12-06), so a third file fills more of what is left. Every test already holds beside a CPU-heavy job (docs/testing.md).
WORKERS ?= 3
PYTEST := $(PY) -m pytest -n $(WORKERS) --dist loadfile
test: install slurm-deps
	$(PYTEST) -m "not slow" $(ARGS) || [ $$? = 5 ]
	$(PYTEST) -m slow --durations=25 $(ARGS) || [ $$? = 5 ]

# The fast tier: unit and in-process tests, no torchrun, no DeepSpeed (tests/conftest.py: tiers).
test-fast: install
	$(PYTEST) -m "not slow" $(ARGS)

# The documentation site: docs/*.md and mkdocs.yml, built offline into site/; --strict fails on a
# broken link or anchor between pages (tests/test_docs.py checks the README's links, commands and
# paths). The `docs` extra of pyproject.toml (pinned MkDocs + mkdocs-material, nothing else) is
# installed into $(VENV) when missing or when pyproject.toml changed.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $$($(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs'])")
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The Slurm tests (tests/test_slurm.py) need Debian's slurm-wlm and munge: every binary below.
# Installed here when missing and we are root with apt-get (as in CI); a no-op when present.
# Otherwise the Slurm tests skip and say why, except on CI (CI=true), where a prerequisite that
# cannot be had fails here, naming what is missing (a skipped part would read as a pass).
SLURM_BINARIES := munged slurmctld slurmd sbatch srun scontrol scancel squeue
slurm-deps:
	@missing() { for b in $(SLURM_BINARIES); do command -v $$b >/dev/null || echo $$b; done; }; \
	if [ -z "$$(missing)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing slurm-wlm and munge for the Slurm tests (apt-get)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } \
	    || echo "apt-get could not install slurm-wlm/munge"; \
	fi; \
	still=$$(missing | tr '\n' ' '); \
	if [ -n "$$still" ]; then \
	  if [ "$$CI" = true ]; then echo "slurm-deps: missing $$still(CI=true: the Slurm tests must run)" >&2; exit 1; \
	  else echo "slurm-deps: missing $$still: the Slurm tests will skip"; fi; \
	fi

clean:
	rm -rf $(VENV) runs multirun outputs report
