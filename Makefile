# Everything runs inside .venv. torch is installed first, pinned to the CPU build that lies on this
# machine's disk: letting pip resolve torch through trl/transformers would download a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install sandbox demo test test-portable test-slow test-distributed lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed sandbox

# code_reward runs generated programs in a bubblewrap sandbox (setpriv, from util-linux, drops root to uid 65534).
sandbox:
	@command -v bwrap >/dev/null && command -v setpriv >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap util-linux; \
	  else \
	    echo "code_reward needs bubblewrap: install the 'bubblewrap' package (e.g. sudo apt-get install bubblewrap)"; \
	    exit 1; \
	  fi; }

# The demo needs no sandbox: it must run where bubblewrap cannot be installed.
demo: $(VENV)/.installed
	$(BIN)/python -m trl_diffusion.demo

# The suite runs on one pytest-xdist worker per core, at most 4: each worker holds its own tiny models, and the
# multi-process tests start two more processes each.
PYTEST_WORKERS ?= -n auto --maxprocesses 4
test: install
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# The suite again under ATEN_CPU_CAPABILITY=default (PyTorch's portable kernels, no SIMD): a number that holds only
# with this CPU's vector kernels or reduction order fails here as it would on another machine. The files left out
# build no model and compare no numbers (sandbox, rewards, tasks, configs, errors, Hub, model card, plots, terminal,
# the command line's parsing and the benchmarks' smoke runs): nothing in them depends on the kernels.
PORTABLE_SKIP := test_sandbox.py test_rewards.py test_tasks.py test_configs.py test_errors.py test_hub.py \
	test_model_card.py test_plotting.py test_terminal.py test_cli.py test_benchmarks.py
test-portable: install
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q $(PYTEST_WORKERS) $(addprefix --ignore=tests/,$(PORTABLE_SKIP))

# pytest exits 5 when it collects no test: with nothing marked `slow`, there is nothing to fail.
test-slow: install
	$(BIN)/python -m pytest -q -m slow; status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test-slow: no test is marked slow"; exit 0; fi; exit $$status

# The whole engine x trainer-family matrix on two CPU processes (DDP, DeepSpeed ZeRO-1/2/3, FSDP2; with and without
# LoRA), checkpoint resume under each engine and the two-machine launch: about 40 minutes on 2 cores. The default
# suite runs its fast core.
test-distributed: install
	$(BIN)/python -m pytest -q -m slow tests/test_distributed.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
