# zerolab: everything installs into a local virtualenv (.venv) created from nothing.
#   make run    install, then the default job: a short 2-rank CPU run comparing strategies
#   make test   install, then the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install run test clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0 setuptools wheel
	# DeepSpeed ships as source and its build imports torch: build it against the torch above.
	$(PY) -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 train.py trainer.max_steps=200 $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) runs multirun outputs report
