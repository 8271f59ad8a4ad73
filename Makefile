# The two commands: `make train` (demo on built-in data) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install train test test-slow lint bench clean

install: $(STAMP)

# Rebuilt only when pyproject.toml changes. torch/torchvision are pinned to the pair on local disk.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# One intra-op thread: on a busy 2-core machine two threads spin-wait and run several times slower.
train: install
	OMP_NUM_THREADS=1 $(PY) scripts/train.py --config configs/demo.yaml --overwrite

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

lint: install
	$(PY) -m ruff check facenet scripts tests benchmarks

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
