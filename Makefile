# The two commands: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
export PORT

.PHONY: run test test-postgres install migrate bench bench-events bench-agent bench-memory clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

migrate: export DEBUG ?= true
migrate: install
	$(PY) manage.py migrate --noinput

## Start everything on SQLite: web on 127.0.0.1:$(PORT), workers, sweeper. Ctrl-C stops all.
## DEBUG is on here (its default elsewhere is off): the zero-config development stack.
run: export DEBUG ?= true
run: migrate
	$(PY) manage.py runstack

## Run the test suite (DATABASE_URL selects PostgreSQL; REDIS_URL the Redis channel layer) on TEST_PROCESSES
## pytest processes (pytest-xdist; a module's tests stay in one process; 0 runs them all in this one).
TEST_PROCESSES ?= 2
MCP_NPM := var/mcp-npm
MCP_NPM_PACKAGES := @modelcontextprotocol/server-everything@2026.8.31
test: install $(MCP_NPM)/.installed
	$(PY) -m pytest $(if $(filter 0,$(TEST_PROCESSES)),,-n $(TEST_PROCESSES) --dist loadfile) $(PYTEST_ARGS)

## An MCP server from the npm registry for tests/mcp (its tests skip, saying so, without npm).
$(MCP_NPM)/.installed:
	@if command -v npm >/dev/null 2>&1; then \
	  npm install --silent --no-audit --no-fund --prefix $(MCP_NPM) $(MCP_NPM_PACKAGES) && touch $@; \
	else echo "npm not found: tests/mcp's npm server test will skip (install Node.js and npm, then make test)"; fi

## Side-by-side benchmark on PostgreSQL (DATABASE_URL, default .../bench_compare; created if missing):
## ours vs DBOS vs LangGraph, our engine at 100/1,000/10,000 steps, many tasks on real workers.
## BENCH_ARGS="--only ours,scale" (or --skip latency) picks sections; BENCH_MAX_STEPS caps step counts.
$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) bench/compare.py $(BENCH_ARGS)

## Events into tasks on PostgreSQL (DATABASE_URL, default .../bench_events; created if missing), real
## web server and workers: accepted events/s (one task, 100 tasks), event -> consumed per priority, P0 -> ack.
bench-events: install
	$(PY) bench/events.py

## The agent's harness overhead per LLM turn and tool call, against the stand-in model (DATABASE_URL or SQLite):
bench-agent: install
	$(PY) bench/agent.py $(BENCH_ARGS)

## Memory over a long life on PostgreSQL + Redis (DATABASE_URL, default .../bench_memory; BENCH_REDIS_URL, default
## db 6, emptied first): daphne's RSS under BENCH_WEB_MINUTES (10) of websocket churn, and a worker's RSS over
## BENCH_WORKER_STEPS (100,000) steps, isolated and in-process. Figures only.
bench-memory: install
	$(PY) bench/memory.py $(BENCH_ARGS)

clean:
	rm -rf var/ .pytest_cache
