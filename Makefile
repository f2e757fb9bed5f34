# The README's two commands: `make run` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch installed when none is importable in the venv: torch 2.13.0, on a machine with no CUDA
# device (no GPU in `nvidia-smi -L`, no /dev/nvidia0...) PyTorch's CPU build from its CPU wheel
# index where that index answers (PyPI's Linux wheel is a multi-GB CUDA one), else from your
# pip's configured index; `make torch-source` prints the choice and why. On a GPU box with
# another CUDA than PyPI's, install your CUDA torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# "cpu: why" or "configured: why", detected without torch; the index asked for 5 s at most.
TORCH_SOURCE = if nvidia-smi -L 2>/dev/null | grep -q '^GPU' || ls /dev/nvidia[0-9]* >/dev/null 2>&1; \
	then echo "configured: a CUDA device is here"; \
	elif $(PYTHON) -c 'import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1].rstrip("/") + "/torch/", method="HEAD"), timeout=5)' "$(TORCH_CPU_INDEX)" 2>/dev/null; \
	then echo "cpu: no CUDA device here"; \
	else echo "configured: no CUDA device here, but $(TORCH_CPU_INDEX) cannot be reached"; fi
ARGS ?=

.PHONY: setup torch-source run test test-gpu wheel-check lint format clean

# Each step says what it installs, and pip shows its downloads (a first setup takes ~2 minutes).
$(VENV)/.installed: pyproject.toml
	@echo "setup 1/4: virtualenv $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup 2/4: pip"
	$(PY) -m pip install --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then echo "setup 3/4: torch: the venv has one"; \
	else source=$$($(TORCH_SOURCE)); \
	case "$$source" in \
	cpu:*) echo "setup 3/4: torch: $${source#cpu: }: PyTorch's CPU build, $(TORCH_SPEC) from $(TORCH_CPU_INDEX)"; \
	  $(PY) -m pip install $(TORCH_SPEC) --index-url $(TORCH_CPU_INDEX);; \
	*) echo "setup 3/4: torch: $${source#configured: }: $(TORCH_SPEC) from pip's configured index"; \
	  $(PY) -m pip install $(TORCH_SPEC);; \
	esac || exit 1; fi
	@$(PY) -c "import torch; print('setup 3/4: torch', torch.__version__, 'for CUDA ' + torch.version.cuda if torch.version.cuda else '(a CPU build)')"
	@echo "setup 4/4: attngym and its dependencies (pyproject.toml), with the dev tools"
	$(PY) -m pip install -e ".[dev]"
	touch $@
	@echo "setup done: $(VENV)"

setup: $(VENV)/.installed

# Where setup takes torch from on this machine, and why (nothing is installed).
torch-source:
	@$(TORCH_SOURCE)

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
