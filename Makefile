# ppqa: `make demo` runs the main job on the sample document; `make test` runs the test suite.
# `make setup` (run by both) builds .venv once: the CPU build of torch first, so that pip never
# pulls a multi-GB CUDA build on a CPU machine, then ppqa itself in editable mode with its test
# extras. A stamp file marks a complete environment; it is rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ppqa-setup-complete
DEMO_DB := .demo/demo.db
# Test processes (pytest-xdist): one per core, at most 4; `make test TEST_JOBS=0` runs the suite
# in one process. Tests are grouped by module, so a module's fixtures load once.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
# The demo keeps its store in .demo/, never in the user's real one.
PPQA := $(VENV)/bin/ppqa --db $(DEMO_DB)

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ppqa needs Python >= 3.11; set PYTHON=...")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: setup
	@mkdir -p .demo && rm -f $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm
	$(PPQA) ingest examples/harrowmere.txt examples/questions.txt --name harrowmere
	$(PPQA) status
	$(PPQA) run --once --device cpu
	$(PPQA) show 1
	$(PPQA) report
	$(PPQA) export answers.csv

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadscope

clean:
	rm -rf .demo answers.csv
