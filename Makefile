# minitrain: make train | make test (each installs what is missing into .venv first; make install alone)
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
# Written after a complete install; pyproject.toml or this file newer than it means install again.
INSTALLED := $(VENV)/.minitrain-installed

# Which torch: TORCH (pip arguments, e.g. TORCH='torch==2.13.0 --index-url URL') wins. Else the default
# build, CUDA on Linux, where nvidia-smi answers; else the CPU build, which is not on PyPI: from pip's own
# configured sources when they hold it (a local wheel or mirror), otherwise from PyTorch's CPU index.
ifdef TORCH
INSTALL_TORCH = $(PIP) install $(TORCH)
else ifeq ($(shell nvidia-smi >/dev/null 2>&1 && echo gpu),gpu)
INSTALL_TORCH = $(PIP) install "torch==$(TORCH_VERSION)"
else
INSTALL_TORCH = $(PIP) install "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
	|| $(PIP) install "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX)
endif

.PHONY: install train test mutants clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml Makefile
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV)
	$(INSTALL_TORCH)
	$(PIP) install -e ".[test,plots]"
	touch $@

train: $(INSTALLED)
	$(VENV_PYTHON) scripts/train.py $(ARGS)

test: $(INSTALLED)
	$(VENV_PYTHON) -m pytest -q tests

# Not in CI: injects each bug of scripts/mutants.toml into a copy of the repo; every one must fail its tests.
mutants: $(INSTALLED)
	$(VENV_PYTHON) scripts/mutants.py $(ARGS)

clean:
	rm -rf runs outputs multirun .pytest_cache
