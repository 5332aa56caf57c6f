# Two commands on a fresh machine: `make run` (the gateway) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install bench-overhead bench render check clean

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

clean:
	rm -rf $(VENV) .run
