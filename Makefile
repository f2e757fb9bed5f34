# The README's two commands: `make run` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch installed when none is importable in the venv: torch 2.13.0 as your pip's index has it
# (a CPU build where a CPU wheel is the one pip finds; PyPI's Linux wheel is a multi-GB CUDA one).
# For a CPU build from PyTorch's index: make setup TORCH_SPEC="torch --index-url
# https://download.pytorch.org/whl/cpu". On a GPU box, install your CUDA torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: setup run test test-gpu wheel-check lint format clean

# Each step says what it installs, and pip shows its downloads (a first setup takes ~2 minutes).
$(VENV)/.installed: pyproject.toml
	@echo "setup 1/4: virtualenv $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup 2/4: pip"
	$(PY) -m pip install --upgrade pip
	@echo "setup 3/4: torch (skipped when the venv already has one; else $(TORCH_SPEC))"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_SPEC)
	@echo "setup 4/4: attngym and its dependencies (pyproject.toml), with the dev tools"
	$(PY) -m pip install -e ".[dev]"
	touch $@
	@echo "setup done: $(VENV)"

setup: $(VENV)/.installed

run: setup
	$(PY) -m attngym $(ARGS)

lint: setup
	$(PY) -m ruff check attngym hydra_plugins tests scripts experiments
	$(PY) -m ruff format --check attngym hydra_plugins tests scripts experiments

format: setup
	$(PY) -m ruff format attngym hydra_plugins tests scripts experiments
	$(PY) -m ruff check --fix attngym hydra_plugins tests scripts experiments

# The suite on two pytest-xdist workers, then the fault-injection tests (tests/faults: stopped
# and killed ranks, timeouts of a few seconds) alone, so no other work delays their clocks, then
# the SLURM tests (tests/slurm: a real cluster they start, whose jobs run on these cores).
test: lint
ifeq ($(strip $(ARGS)),)
	$(PY) -m pytest -q -n 2 --ignore=tests/faults --ignore=tests/slurm
	$(PY) -m pytest -q tests/faults
	$(PY) -m pytest -q tests/slurm
else
	$(PY) -m pytest -q $(ARGS)
endif

# The GPU suite (tests marked gpu or multigpu) on this machine's GPUs, in one go: GPU_WORKERS
# pytest workers share the GPU(s) (their compiles run side by side); ranks share one GPU where a
# transport can (copy_engine over gloo), and the rest skip with their reason (nccl and multigpu
# want a GPU per rank). pytest's summary of failures and skips ends it. On a machine whose Python
# already has torch and attngym's needs (a GPU image), skip the venv: make test-gpu PY=python3.
GPU_WORKERS ?= 4
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
	NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 $(PY) -m pytest -q -n $(GPU_WORKERS) \
	  -m "gpu or multigpu" -rfEs --durations=10 -p no:cacheprovider tests $(ARGS)

# Build the wheel, install it into a fresh venv and run it from outside the repository (CI).
wheel-check: setup
	PY=$(PY) .ci/check_wheel

clean:
	rm -rf $(VENV) outputs multirun build .pytest_cache .ruff_cache
