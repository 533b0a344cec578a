# The two commands: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
export PORT

.PHONY: run test test-postgres install migrate clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

migrate: install
	$(PY) manage.py migrate --noinput

## Start everything on SQLite: web on 127.0.0.1:$(PORT), workers, sweeper. Ctrl-C stops all.
run: migrate
	$(PY) manage.py runstack

## Run the test suite (DATABASE_URL selects PostgreSQL; REDIS_URL the Redis channel layer).
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf var/ .pytest_cache
