# The two set-up commands of the README:  `make demo` (the embedded tiny-model run)  and  `make test`.
# Both create .venv on first use with the CPU build of torch (pinned: other versions pull multi-GB CUDA builds).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,math]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sapo-megatron train --output-dir runs/demo --resume auto

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest -q -p no:cacheprovider --durations=15

bench: $(STAMP)
	for script in bench/bench_*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
