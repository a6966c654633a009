# Two commands for a newcomer: `make demo` (set up + run the main RL job) and `make test` (set up + run
# the whole suite). Both create .venv at the repo root when it is missing. See BUILD.md for GPU set-ups.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# torch is pinned in one place. GPU users: install their CUDA torch into the venv first and pass
# CONSTRAINTS=/dev/null (BUILD.md).
CONSTRAINTS ?= constraints.txt
EXTRAS ?= train,test,megatron,lora
NPROC ?= 2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.rlfunc-installed

.PHONY: venv demo test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -c $(CONSTRAINTS) torch
	$(PIP) -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	@touch $(STAMP)

venv: $(STAMP)

## The main job: GRPO on a synthetic arithmetic task, FSDP2 on $(NPROC) CPU ranks (a few minutes).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) experiments/grpo_arithmetic.py $(ARGS)

## The whole suite (unit, property, distributed and end-to-end tests).
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

## The fast set (about a minute): single-process unit and property tests, no spawned process groups.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not distributed" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
