# minitrain: make install | make train | make test
PYTHON ?= python3
# A CPU-only machine takes the small CPU build of torch; on a GPU machine pass TORCH=torch (or keep
# the torch you have: pip leaves an installed torch that satisfies the requirement alone).
TORCH ?= torch==2.13.0

.PHONY: install train test bench-gpu clean

install:
	$(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install -e ".[test]"

train:
	$(PYTHON) scripts/train.py $(ARGS)

test:
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf runs outputs multirun .pytest_cache
