# pd-dflash: the two commands of the README, plus lint helpers.
# Both commands create or refresh the local virtual environment idempotently (a stamp keyed on pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/install_torch.sh | sha1sum | cut -c1-12)
# Set VENV_SYSTEM_SITE=1 on a GPU box to let the venv see the system's CUDA torch (and a MoE-Infinity build).
VENV_FLAGS := $(if $(filter 1,$(VENV_SYSTEM_SITE)),--system-site-packages,)
RUN_SPEC ?= jobs/cpu_reference.yaml
RUN_OUT ?= results/cpu_reference

.PHONY: run test lint format venv clean dflash-official-env mutate

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

$(STAMP): pyproject.toml scripts/install_torch.sh | $(BIN)/python
	scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[engine,sweep,dev]"
	rm -f $(VENV)/.installed-*
	touch $@

# README command 1: the main job on its embedded default (CPU sweep, reference engine, local Ray cluster).
run: $(STAMP)
	$(BIN)/pd-dflash run $(RUN_SPEC) --out $(RUN_OUT) --resume

# README command 2: lint, format check, the type check (mypy: the reference engine's seams and their consumers,
# [tool.mypy] in pyproject.toml) and the whole test suite (CI runs exactly this through .ci/run).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Mutation testing of the pure core and the metric code (docs/testing.md). Not part of `make test` or CI: it takes
# tens of minutes. A fresh run each time (mutants/ is git-ignored); the score per module is printed at the end.
MUTATE_JOBS ?= 2
mutate: $(STAMP)
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[mutate]"
	rm -rf mutants
	PD_DFLASH_CACHE="$${PD_DFLASH_CACHE:-$(CURDIR)/.cache/pd-dflash}" $(BIN)/mutmut run --max-children $(MUTATE_JOBS)
	$(BIN)/python scripts/mutation_score.py

# The official DFlash package in its own environment (it cannot share .venv: docs/reference-engine.md); the
# drafter parity test runs it live when present, and `scripts/dflash_parity.py fixture` regenerates its fixture.
dflash-official-env:
	scripts/dflash_official_env.sh .cache/dflash-official

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants
