# The two commands of the README: `make train` and `make test`. Both set up .venv first: `train` with
# gymflow and the extras EXTRAS names (none: what the main job needs; `make setup EXTRAS=atari,mujoco`),
# `test` with every extra and the test bench. `make ui` serves MLflow's UI on ./mlflow.db (the ui extra).
VENV   := .venv
PYTHON := $(VENV)/bin/python
PRESET ?= cartpole-ppo
EXTRAS ?=

.PHONY: setup system-packages train ui test test-all
setup: $(VENV)/.installed-$(or $(EXTRAS),core)

$(PYTHON):
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip

# one stamp an install: .installed-core (gymflow alone), .installed-test, .installed-<extras>
$(VENV)/.installed-%: pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install --quiet -e ".$(if $(filter-out core,$*),[$*])"
	touch $@

train: setup
	$(VENV)/bin/gymflow run $(PRESET) $(ARGS)

ui: $(VENV)/.installed-ui
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db

# The suite in two pytest runs (tests/suite.py): the tests not marked `alone` in PYTEST_WORKERS
# processes (pytest-xdist, a file's tests in one), then the stop-within-10-s tests (`alone`) in one
# process, where no other test's load slows them (collected beside the first run, set up late in it, begun after it).
# PYTEST_ARGS go to both; its `-m` selects in both.
# pytest's exit code 5 (no tests collected) counts as a failure where neither run collected one.
# `test` is the default tier (CI's); `test-all` adds the long tier (`slow`): tests/README.md.
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed-test system-packages
	$(PYTHON) tests/suite.py --workers $(PYTEST_WORKERS) --durations=25 $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test system-packages
	$(PYTHON) tests/suite.py --workers $(PYTEST_WORKERS) -m "slow or not slow" --durations=25 $(PYTEST_ARGS)

# The queue the SLURM tests start (tests/slurm.py): Debian's slurm-wlm and munge; the team's stack
# (`gymflow stack up`, tests/test_team_stack.py): Debian's PostgreSQL, without the cluster its package
# would make and start; the browser test (tests/test_browser.py): Debian's chromium. Installed where
# missing; where they cannot be (not root, no apt-get) those tests skip and say why.
system-packages:
	@missing=""; \
	command -v slurmctld >/dev/null && command -v munged >/dev/null || missing="slurm-wlm munge"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        mkdir -p /etc/postgresql-common; \
	        [ -e /etc/postgresql-common/createcluster.conf ] || echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o Dpkg::Options::=--force-confold $$missing >/dev/null; \
	    else \
	        echo "$$missing not installed (it needs root and apt-get): the tests that start them skip"; \
	    fi; \
	fi
