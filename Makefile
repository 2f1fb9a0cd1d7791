# Shortcuts for the README's commands. `make setup` once, then `make train`, `make test` or `make bench`.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# A stamp file, newer than requirements.txt once those are installed: setup runs pip only when they change.
INSTALLED := $(VENV)/.installed

.PHONY: setup train test test-quick bench
setup: $(INSTALLED)  ## create the virtual environment, install the pinned requirements and build DeepSpeed's CPU Adam (again only if they changed)

$(INSTALLED): requirements.txt
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -r requirements.txt
	$(PYTHON) scripts/build_cpu_adam.py
	touch $(INSTALLED)

train: setup  ## the default job: one process, default model and corpus
	$(VENV)/bin/accelerate launch train.py

test: setup  ## the test suite: real 2-process CPU runs of every config
	$(PYTHON) -m pytest

test-quick: setup  ## the quick tier for the edit loop (about half a minute, at most 3): unit tests and a few real runs
	$(PYTHON) -m pytest -m quick

bench: setup  ## every strategy side by side, train.py against a raw PyTorch DDP loop, then full fine-tuning against LoRA (about 15 minutes on 2 CPU cores)
	$(PYTHON) scripts/benchmark.py
	$(PYTHON) scripts/benchmark.py --fine_tuning
