# `make demo` and `make test` each create .venv on first use, install the project, and run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,lint,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/elastic demo

test: lint docs
	$(BIN)/python ../shared/tools/check_layers.py . || test ! -f ../shared/tools/check_layers.py
	# two workers, whole files each, longest first (tests/conftest.py); three saturate 2 cores and run slower. A worker
	# process that dies ends the run at once: pytest-xdist 3.8 requeues the dead worker's file and then waited forever.
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 --durations=15

lint: $(STAMP)  # ruff's lint rules and mypy, as configured in pyproject.toml
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs: $(STAMP)  # the docs site into site/; --strict: a broken link or a public name without a docstring fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python benchmarks/snapshot.py --json
	$(BIN)/python benchmarks/recovery.py --json
	$(BIN)/python benchmarks/goodput.py --json
	$(BIN)/python benchmarks/supervisor_scale.py --slices 1024 --json
	$(BIN)/python benchmarks/overhead.py --json
	$(BIN)/python benchmarks/idle_cpu.py --json

clean:
	rm -rf $(VENV) *.egg-info site .mypy_cache .ruff_cache
