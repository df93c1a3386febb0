# Two commands users need: `make test` and `pdserve serve` / `pdserve generate` (see README).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: venv install test lint bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Install torch only when none is importable, so a CUDA build already there is never replaced.
venv: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)

install: venv
	$(PY) -m pip install -q -e '.[dev]'

test: install
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
