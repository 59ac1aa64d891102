# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
RECIPE ?= recipes/tiny_gpt_cpu.yaml

.PHONY: demo lint test test-fast bench clean prometheus-server

# torch==2.13.0 first: it is the CPU build lying on this disk; a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lightning-accel fit --config $(RECIPE)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# tests/monitor/test_prometheus.py scrapes our exporter with a real Prometheus server: Debian's package.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
prometheus-server:
	@command -v prometheus >/dev/null || { \
		echo "installing Debian's prometheus (tests read our metrics back through it)"; \
		$(SUDO) apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q --no-install-recommends prometheus; }; }

# Two workers, whole files each (a file's shared reference runs are computed once), longest first in the order of
# tests/conftest.py's LONGEST_FIRST (xdist's own reorder, by number of tests, is turned off so that order holds).
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# tests/checkpoint/test_bucket.py's Azure case runs against Azurite, Microsoft's Azure Storage emulator (npm registry)
AZURITE := .azurite/node_modules/.bin/azurite-blob
$(AZURITE):
	npm install --prefix .azurite --no-audit --no-fund --silent azurite@3.37.0

test: lint prometheus-server $(AZURITE)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not multiprocess"

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .azurite lightning_logs runs checkpoints
