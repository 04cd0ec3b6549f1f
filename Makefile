# Two entry points for a fresh machine: `make demo` and `make test`.
# Each builds .venv from nothing on first use (CPU torch first and pinned, then the
# package and its test tools) and reuses it while pyproject.toml is unchanged.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint typecheck docs pytest clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test,docs]"
	touch $(STAMP)

demo: venv
	$(BIN)/speedkit demo $(ARGS)

lint: venv
	$(BIN)/ruff check lightning_speedkit examples tests benchmarks
	$(BIN)/ruff format --check lightning_speedkit examples tests benchmarks

# mypy cannot follow setuptools' editable-install finder, so it sees the example
# package (examples/ installed as speedkit_examples) through a link in the venv.
typecheck: venv
	mkdir -p $(VENV)/typing && ln -sfn "$(CURDIR)/examples" $(VENV)/typing/speedkit_examples
	MYPYPATH=$(VENV)/typing $(BIN)/mypy

docs: venv
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

# Two test processes, a test file each at a time (tests in a file share fixtures and
# some time against each other); PYTEST_WORKERS= runs them in this process. A worker
# that dies fails the run at once (-v names the file it had): xdist's replacement
# worker once left the run waiting until CI's limit.
PYTEST_WORKERS ?= -n 2 --dist loadfile --max-worker-restart=0
# The slowest tests are listed at the end of every run: the suite has a 20-minute budget.
PYTEST_DURATIONS ?= --durations=20

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
pytest: venv
	$(BIN)/python -m pytest $(PYTEST_WORKERS) $(PYTEST_DURATIONS) $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status

# mypy (about 40 s from a cold cache, on one core) runs beside pytest: both must pass.
test: lint docs
	$(MAKE) --no-print-directory -j2 typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache speedkit_runs
