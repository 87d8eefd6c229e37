# Two commands set everything up on a fresh machine with Python 3.11:
#   make train   -- create .venv if missing, install pinned deps, run the tiny GRPO job on CPU
#   make test    -- same set-up, then the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
ARGS   ?=

.PHONY: venv train test soak parity bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

train: $(STAMP)
	$(BIN)/async-rl train --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not soak" tests

# The full crash matrix: every sampler x lookahead/staleness x partial rollouts.
soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak tests

# Logits of the HF loader vs. transformers' own Llama/Qwen2 on CPU torch (too heavy for CI,
# which compares against a NumPy reference instead). Installs torch + transformers into .venv.
TORCH_WHEEL ?= $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl)
parity: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt $(or $(TORCH_WHEEL),torch==2.13.0) "transformers==5.24.0"
	ASYNC_RL_PARITY=1 $(BIN)/python -m pytest -q -m parity -s tests

bench: $(STAMP)
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/learner.py
	$(BIN)/python bench/async.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/load.py

clean:
	rm -rf $(VENV) runs .pytest_cache
