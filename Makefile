# The Quick start's two commands (README.md), each doing all the set-up it needs on a machine with python3 and make:
#   make run     the main job: step35 fit --config configs/tiny.yaml
#   make test    the tests: python -m pytest; TESTS="..." passes pytest its arguments (a file, -m quick, -k NAME)
# The set-up runs once and again only when what it installs from changes. step35 is installed into .venv
# (pip install -e ".[dev]") while the stamp .venv/installed-pyproject.toml differs from pyproject.toml; the tests'
# outside references go into .oracle (tests/oracles.txt says why) while .oracle/installed-oracles.txt differs from
# tests/oracles.txt. A stamp is a copy of the file it is keyed on, written after pip succeeds: a failed install is
# retried by the next command, a skipped one prints nothing.
# STEP35_VENV=/path/of/a/venv (an argument or the environment): run in that environment as it is; nothing is
# installed, .oracle included (README, Quick start, gives the install lines for such an environment).

PYTHON ?= python3
TESTS ?=

ifeq ($(STEP35_VENV),)
BIN := .venv/bin
else
BIN := $(STEP35_VENV)/bin
endif

.PHONY: run test install oracles

run: install
	$(BIN)/step35 fit --config configs/tiny.yaml

test: install oracles
	$(BIN)/python -m pytest $(TESTS)

install:
ifeq ($(STEP35_VENV),)
	@test -x .venv/bin/python || $(PYTHON) -m venv .venv
	@if ! cmp -s pyproject.toml .venv/installed-pyproject.toml; then \
		echo "make: installing step35 into .venv (pyproject.toml is new or changed)"; \
		.venv/bin/python -m pip install -e ".[dev]" && cp pyproject.toml .venv/installed-pyproject.toml; \
	fi
endif

oracles: install
ifeq ($(STEP35_VENV),)
	@if ! cmp -s tests/oracles.txt .oracle/installed-oracles.txt; then \
		echo "make: installing the tests' outside references into .oracle (tests/oracles.txt is new or changed)"; \
		.venv/bin/python -m pip install --no-deps --upgrade --target .oracle -r tests/oracles.txt \
			&& .venv/bin/python -m pip install --no-deps --upgrade --target .oracle/_torchvision \
				$$(sed -n 's/^# apart: //p' tests/oracles.txt) \
			&& cp tests/oracles.txt .oracle/installed-oracles.txt; \
	fi
endif
