# The README's two commands are `make demo` and `make test`; both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser compose demo worker test check test-fast lint format clean

# Debian packages the tests need, as root or through sudo
APT_INSTALL = S=$$([ "$$(id -u)" = 0 ] || echo sudo); $$S apt-get update -qq \
	&& DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch; a plain `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# not the `rewards` extra: open-clip-torch pulls PyPI's torchvision, which imports only
	# beside its own torch release ($(REWARDS_STAMP) below installs the pair for the tests)
	$(BIN)/pip install -q -e '.[server,dev,clip,tracking]'
	touch $(STAMP)

# The tests (and the workers that score with hpsv2 or aesthetic) need the `rewards` extra:
# open-clip-torch imports torchvision, and PyPI's torchvision imports only beside the torch it
# was built for, so the two are installed as a pair over the CPU torch above. On x86_64 that
# pair is a CUDA build (runs on the CPU too; 5.5 GB, about 2 minutes from this machine's disk);
# on aarch64 a CPU build. `make demo` does not need it and stays on the small install.
REWARDS_STAMP := $(VENV)/.installed-rewards
TORCH_VISION_PAIR = $$(case "$$(uname -m)" in aarch64) echo torch==2.9.1 torchvision==0.24.1;; \
	*) echo torch==2.14.1 torchvision==0.29.1;; esac)

$(REWARDS_STAMP): $(STAMP)
	$(BIN)/pip install -q $(TORCH_VISION_PAIR)
	$(BIN)/pip install -q -e '.[server,dev,clip,tracking,rewards]'
	$(BIN)/python -c "import open_clip, torchvision"
	touch $(REWARDS_STAMP)

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
worker: $(STAMP)
	$(BIN)/celery -A worker.celery_app worker -Q gpu,cpu --pool solo -l INFO --without-gossip --without-mingle --without-heartbeat

# the whole suite, as CI runs it (.ci/run); needs PostgreSQL, Redis and chromium
# REQUIRE_OPEN_CLIP: the open_clip rewards' tests fail, rather than skip, if it does not import
#
# In two runs: everything but the browser tests in TEST_WORKERS pytest-xdist processes (one
# torch thread each, as `make check`; the longest tests first, tests/conftest.py), then the
# browser tests in one process, with nothing else loading the box: they wait on a served page,
# and beside three busy processes the arena's double-click test waited out its minute for the
# vote's count (2026-12-07).
# Both always run; it fails if either failed. In one process the suite took 34-88 minutes on
# this 2-core box (CI's limit is 90); in three processes 28, then the browser tests 5 (2026-12-07,
# README).
TEST_WORKERS ?= 3
test: setup $(REWARDS_STAMP)
	$(BIN)/ruff check .
	@status=0; \
	PYTHONDONTWRITEBYTECODE= REQUIRE_OPEN_CLIP=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	  $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist load -m "not e2e" --durations=25 \
	  || status=$$?; \
	REQUIRE_OPEN_CLIP=1 $(BIN)/python -m pytest -m e2e --durations=10 || status=$$?; \
	exit $$status

# the fast inner loop (under 2 minutes on 2 cores): ruff, the unit tests and the SQLite variants
# of the app tests; no PostgreSQL, Redis, chromium, worker processes or subprocesses. The markers
# are applied in tests/conftest.py; everything deselected here still runs in `make test`.
CHECK_MARKERS = not slow and not postgres and not redis and not worker and not e2e \
	and not subprocess

# One torch thread per process: on a loaded 2-core box two OpenMP threads spin against the other
# processes and the trainer tests take 5-10x longer (85 s instead of 8 s). The cores are used
# instead by pytest-xdist, one test process each (CHECK_WORKERS, default one per core and one
# more: a share of the tests waits on a served app or a reward server, and a third process keeps
# two cores busy meanwhile: 108-123 s against 114-130 s with two, 2026-12-06, 1,167 tests):
# 91 s on 2 cores against 127 s in one process (2026-11-27, 699 tests; 94 s for 713, then 106 s for 739, 2026-11-29;
# 149 s for 820 on 2026-12-03, then 95 s for 817 with worksteal, the plugins below left out and three fits marked slow).
#
# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it (this box does), every run
# compiled the project and pytest rewrote every test file's asserts again, in each process:
# 18 s of collection against 11 s from the caches of the run before (2026-12-06).
check: $(REWARDS_STAMP)
	$(BIN)/ruff check .
	PYTHONDONTWRITEBYTECODE= REQUIRE_OPEN_CLIP=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	  $(BIN)/python -m pytest -q \
	  -n $${CHECK_WORKERS:-$$(( $$(nproc) + 1 ))} --dist worksteal -m "$(CHECK_MARKERS)" $(CHECK_SKIP_PLUGINS)

# schemathesis (and the hypothesis it imports) serve only tests/app/test_fuzz.py, which is slow;
# not loading them saves each test process a second or two of start-up
CHECK_SKIP_PLUGINS = -p no:schemathesis -p no:hypothesispytest --ignore=tests/app/test_fuzz.py

# the old name of `check`
test-fast: check

# The code is formatted by hand (hanging indents at 100 columns), not by `ruff format`, which
# would rewrite most files; `ruff check` (pyproject.toml's rules, import order included) is the
# standard CI holds it to, and `format` applies its safe fixes.
lint: setup
	$(BIN)/ruff check .

format: setup
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
