# Everything runs inside .venv. torch is installed first, pinned to the CPU build that lies on this
# machine's disk: letting pip resolve torch through trl/transformers would download a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install sandbox demo test test-slow lint clean

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

test: install
	$(BIN)/python -m pytest -q

# pytest exits 5 when it collects no test: with nothing marked `slow`, there is nothing to fail.
test-slow: install
	$(BIN)/python -m pytest -q -m slow; status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test-slow: no test is marked slow"; exit 0; fi; exit $$status

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
