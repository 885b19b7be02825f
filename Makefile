# The two commands of the README: `make train` and `make test`. Both set up .venv first.
VENV   := .venv
PYTHON := $(VENV)/bin/python
PRESET ?= cartpole-ppo

.PHONY: setup train test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e ".[test]"
	touch $@

train: setup
	$(VENV)/bin/gymflow run $(PRESET) $(ARGS)

# pytest's exit code 5 (no tests collected) counts as a failure.
test: setup
	$(PYTHON) -m pytest --durations=25 $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status
