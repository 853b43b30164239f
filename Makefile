# Fresh machine: `make serve` (set up + run the gateway on the embedded cluster), `make test`.
# `make test` = lint (ruff, mypy) + the whole suite (what CI runs); `make test-fast` skips tests marked slow.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the suite runs on this many worker processes (pytest-xdist), a test file's tests on one worker so a
# module's fixtures start once; most end-to-end tests wait on real-time engines, so 2 workers halve the
# wall time on a 2-core machine. TEST_WORKERS=0 runs it in this process, serially.
# Tests marked `serial` (a live run compared figure by figure with a simulation) then run alone: on 2
# cores a neighbouring worker's load shifts the live run's timing and so its placements.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile
SERIAL := $(BIN)/python -m pytest -p no:xdist

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
	$(PYTEST) -m "not serial"
	$(SERIAL) -m serial

test-fast: lint
	$(PYTEST) -m "not slow and not serial"
	$(SERIAL) -m "serial and not slow" || [ $$? = 5 ]  # none of them may be fast: not an error here
