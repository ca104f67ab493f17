# alpamayo-worker developer entry points.
#
#   make venv         Python venv outside the clone, keyed by pyproject.toml + requirements.lock
#   make venv-path    print the venv's directory (source "$(make -s venv-path)/bin/activate")
#   make kafka-jars   Apache Kafka jars from Maven Central into the cache (deploy/local/pom.xml)
#   make test         venv + jars + pytest (the tests start and stop their own local Kafka)
#   make demo         venv + jars + python -m producer_tools.demo
#   make kafka-start  local Kafka "dev" (KAFKA_ARGS="--nodes 3 --security sasl_ssl" ...)
#   make kafka-stop
#   make clean-cache  stop local clusters, delete $(ALPAMAYO_CACHE)
#
# Everything heavy lives in ALPAMAYO_CACHE (default ~/.cache/alpamayo-worker), so a fresh clone
# (CI) reuses the venv and the jars of an earlier one.

SHELL := /bin/bash
.DEFAULT_GOAL := test

ALPAMAYO_CACHE ?= $(HOME)/.cache/alpamayo-worker
export ALPAMAYO_CACHE

PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	  if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
	    command -v $$p; break; fi; done)
VENV_KEY := $(shell cat pyproject.toml requirements.lock | sha256sum | cut -c1-12)
VENV := $(ALPAMAYO_CACHE)/venv-$(VENV_KEY)
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check --no-input
# top-level packages present now: the editable install is redone when this list or the clone changes
PKGS := $(sort $(patsubst %/__init__.py,%,$(wildcard */__init__.py)))

PYTEST_ARGS ?=
KAFKA_ARGS ?= --name dev

.PHONY: venv venv-path kafka-jars test demo kafka-start kafka-stop kafka-status clean-cache check-python

check-python:
	@if [ -z "$(PYTHON)" ]; then echo "error: Python 3.11+ not found (set PYTHON=...)" >&2; exit 1; fi

venv: check-python
	@mkdir -p "$(ALPAMAYO_CACHE)"
	@exec 9>"$(ALPAMAYO_CACHE)/.venv.lock"; flock 9; \
	if [ -f "$(VENV)/.complete" ]; then \
	  echo "venv: $(VENV) (installed, skipping pip install -r requirements.lock)"; \
	else \
	  echo "venv: creating $(VENV) with $(PYTHON)"; \
	  rm -rf "$(VENV)" && \
	  "$(PYTHON)" -m venv "$(VENV)" && \
	  $(PIP) install -q -r requirements.lock && \
	  touch "$(VENV)/.complete" || { echo "error: building $(VENV) failed" >&2; exit 1; }; \
	fi; \
	stamp="$(CURDIR) $(PKGS)"; \
	if [ "$$(cat "$(VENV)/.editable" 2>/dev/null)" != "$$stamp" ]; then \
	  echo "venv: editable install of $(CURDIR)"; \
	  if $(PIP) install -q --no-deps --no-build-isolation -e .; then echo "$$stamp" > "$(VENV)/.editable"; \
	  else echo "warning: editable install of $(CURDIR) failed (see above): tests still import it through PYTHONPATH, console scripts are missing" >&2; fi; \
	fi

venv-path:
	@echo "$(VENV)"

kafka-jars: check-python
	@"$(PYTHON)" -m deploy.local.cluster jars

test: venv kafka-jars
	@PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" "$(VPY)" -m pytest -q -ra --durations=20 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests (exit 5): failing" >&2; fi; \
	exit $$rc

demo: venv kafka-jars
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" "$(VPY)" -m producer_tools.demo $(DEMO_ARGS)

kafka-start: kafka-jars
	@"$(PYTHON)" -m deploy.local.cluster start $(KAFKA_ARGS)

kafka-stop: check-python
	@"$(PYTHON)" -m deploy.local.cluster stop $(KAFKA_ARGS)

kafka-status: check-python
	@"$(PYTHON)" -m deploy.local.cluster status $(KAFKA_ARGS)

clean-cache: check-python
	@case "$(ALPAMAYO_CACHE)" in ""|"/"|"$(HOME)"|"$(HOME)/") echo "refusing to delete '$(ALPAMAYO_CACHE)'" >&2; exit 1;; esac
	@if [ -d "$(ALPAMAYO_CACHE)/kafka-run" ]; then \
	  for d in "$(ALPAMAYO_CACHE)"/kafka-run/*/; do \
	    [ -d "$$d" ] && "$(PYTHON)" -m deploy.local.cluster stop --name "$$(basename "$$d")" || true; \
	  done; \
	fi
	rm -rf "$(ALPAMAYO_CACHE)"
