# The two set-up commands (README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
# a local wheel folder (torch's CPU build) is used where a machine has one
PIP_FLAGS ?= -c constraints.txt $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
BIN := $(VENV)/bin
PROMPT ?= Once upon a time

.PHONY: demo test lint venv

# NOTE: the first install fetches about 2.3 GB (torch, triton, transformers); pip's own
# progress is shown so it does not look hung (1.5-3 min on a fast link, longer on a slow one).
$(BIN)/expertmesh: pyproject.toml constraints.txt
	@echo ">>> creating $(VENV) and installing expertmesh with its dependencies (first time: ~2.3 GB, typically 1.5-3 min)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install $(PIP_FLAGS) -e '.[test]'
	@echo ">>> $(VENV) is ready"
	touch $@

venv: $(BIN)/expertmesh

# the Kubernetes policy scanner for tests/test_k8s_manifests.py, in an environment of its own:
# it pins networkx and packaging below what torch and transformers use
CHECKOV ?= checkov==3.3.30
$(VENV)/tools/bin/checkov: | $(BIN)/expertmesh
	@echo ">>> installing $(CHECKOV) into $(VENV)/tools (first time: ~1 min)"
	$(PY) -m venv $(VENV)/tools
	$(VENV)/tools/bin/pip install -q $(CHECKOV)

# Brings up coordinator + GPU expert server + CPU expert server on the demo model, prints one
# completion, shuts the cluster down.
demo: venv
	$(BIN)/expertmesh up --demo --prompt "$(PROMPT)" --max-new-tokens 96

lint: venv
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy expertmesh coordinator gpu_server cpu_expert_server

test: lint $(VENV)/tools/bin/checkov
	$(BIN)/python -m pytest -q
