# Set-up and the two commands. `make demo` and `make test` work from a fresh clone.
#
# TORCH_SPEC picks the torch build installed into the venv. The default pins the
# CPU wheel this project's machines keep on disk; elsewhere override it, e.g.
#   make test TORCH_SPEC=torch
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: all venv browser demo test test-trio lint typecheck bench clean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/eventbus-debug demo --log-dir debug_logs

# The HTML report test opens report.html in headless Chromium. Install Debian's package when
# it is missing and we may (root with apt-get); otherwise that one test skips and says why.
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium for the report test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

test: $(STAMP) browser
	$(BIN)/python -m pytest

# The whole suite on trio, anyio's other backend (the tests that drive asyncio itself or need
# uvicorn are marked asyncio_only and skip, saying why). `make test` runs the docs on both.
test-trio: $(STAMP)
	EVENTBUS_DEBUG_TEST_BACKEND=trio $(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check eventbus_debug tests examples benchmarks
	$(BIN)/ruff format --check eventbus_debug tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy tests

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) debug_logs .pytest_cache .mypy_cache .ruff_cache
