# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned, so that no other package pulls a different (CUDA) build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torchkeel-installed

.PHONY: setup demo test test-slow bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-runs only when the project's dependencies change.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[all,dev]' '$(TORCH_SPEC)'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/keel demo

# The layers of docs/architecture.md, ruff's checks and its formatting come first: they take seconds.
# The suite runs on two workers (pytest-xdist), each test file on one of them (module fixtures
# are made once); TEST_WORKERS=0 runs it in one process. The slowest tests are listed at the end.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) bench/trainer_overhead.py
	$(PY) bench/checkpoint.py
	$(PY) bench/serve.py
	$(PY) bench/data.py
	$(PY) bench/lm.py
	$(PY) bench/ddp.py
	$(PY) bench/diagnose.py
	$(PY) bench/leaks.py

clean:
	rm -rf $(VENV) runs .pytest_cache
