# The README's two commands are `make demo` and `make test`; both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser compose demo worker test test-fast lint format clean

# Debian packages the tests need, as root or through sudo
APT_INSTALL = S=$$([ "$$(id -u)" = 0 ] || echo sudo); $$S apt-get update -qq \
	&& DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch; a plain `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[server,dev,clip]'
	touch $(STAMP)

# Debian's chromium for the browser tests (tests/e2e drive it with Playwright; never
# `playwright install`). Checked on every `make setup` / `make test`, installed if missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { $(APT_INSTALL) chromium; } \
	  || echo "warning: chromium not installed: the browser tests will be skipped"

# `docker compose config` validates docker-compose.yml in the tests: where the docker CLI is
# installed without the compose plugin, Debian's docker-compose is installed.
compose:
	@! command -v docker >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
	  || command -v docker-compose >/dev/null 2>&1 || { $(APT_INSTALL) docker-compose; } \
	  || echo "warning: docker-compose not installed: the compose test will fail"

setup: $(STAMP) browser compose

# migrations, the shapes dataset, an admin token (printed once), a worker and the server;
# Ctrl-C stops all of it (app/serve.py)
demo: $(STAMP)
	$(BIN)/python -m app serve

# one more worker on this machine's DATA_DIR / BROKER_URL / DATABASE_URL (see README: Workers)
worker: setup
	$(BIN)/celery -A worker.celery_app worker -Q gpu,cpu --pool solo -l INFO

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
