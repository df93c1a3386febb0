# Two commands users need: `make test` and `pdserve serve` / `pdserve generate` (see README).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: venv install test lint bench clean gpu-wheels gpu-check gpu-check-long

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

# --- a GPU host without a package registry (README: "On a host without internet") ---------------
# The GPU check's interpreter: the venv's where there is one, else the host's python3 (with torch).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
# Where the report goes; the device tool's $(OUT) when it sets one.
OUT ?= gpu-report

# On a connected machine: the pinned wheels (deploy/gpu-wheels.txt) into .whl/, checked complete.
gpu-wheels: install
	$(PY) -m bench.gpu_check.wheels download
	$(PY) -m bench.gpu_check.wheels check

# On the GPU host: install .whl/ with pip alone, run every CUDA path and the headline benchmarks
# inside 10 minutes, write $(OUT)/report.md, results.json and logs.tar.gz.
gpu-check:
	$(GPU_PY) -m bench.gpu_check --out $(OUT)

# The full benchmark sweeps for docs/benchmarks.md: a second 10-minute run.
gpu-check-long:
	$(GPU_PY) -m bench.gpu_check --out $(OUT) --long
