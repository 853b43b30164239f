# Fresh machine: `make serve` (set up + run the gateway on the embedded cluster), `make test`.
# `make test` = lint (ruff, mypy) + the whole suite (what CI runs); `make test-fast` skips tests marked slow.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup serve lint test test-fast bench

$(STAMP): pyproject.toml
	@# the real Mooncake store (test extra) links libibverbs even without RDMA hardware (docs/store.md)
	@ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	    && (apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) \
	    || echo "note: libibverbs1 missing: the real-Mooncake tests will be skipped"; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/conductor serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

test-fast: lint
	$(BIN)/python -m pytest -m "not slow"
