# The two set-up commands (README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
PIP_FLAGS ?= -c constraints.txt --find-links /opt/wheels
BIN := $(VENV)/bin
PROMPT ?= Once upon a time

.PHONY: demo test lint venv

$(BIN)/expertmesh: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_FLAGS) -e '.[test]'
	touch $@

venv: $(BIN)/expertmesh

# Brings up coordinator + GPU expert server + CPU expert server on the demo model, prints one
# completion, shuts the cluster down.
demo: venv
	$(BIN)/expertmesh up --demo --prompt "$(PROMPT)" --max-new-tokens 96

lint: venv
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy expertmesh coordinator gpu_server cpu_expert_server

test: lint
	$(BIN)/python -m pytest -q
