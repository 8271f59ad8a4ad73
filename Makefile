# The two commands: `make train` (demo on built-in data) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FACENET_PYTORCH := 2.6.0

.PHONY: install train test test-slow lint bench clean

install: $(STAMP)

# Rebuilt only when pyproject.toml or this Makefile changes. torch/torchvision are pinned to the
# pair on local disk. facenet-pytorch gives facenet-align its MTCNN (the wheel holds the
# detector weights); its metadata pins torch<2.3, torchvision<0.18, numpy<2 and Pillow<10.3,
# which would replace the torch above, so it is installed with --no-deps; what it imports at
# run time (requests, numpy, Pillow, torch, torchvision, tqdm) comes from the [align] extra.
$(STAMP): pyproject.toml Makefile
	@echo "installing the environment (once, about 3-4 minutes)..."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps facenet-pytorch==$(FACENET_PYTORCH)
	touch $(STAMP)

train: install
	$(VENV)/bin/facenet-train --config configs/demo.yaml --overwrite

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

lint: install
	$(PY) -m ruff check facenet scripts tests benchmarks tools
	$(PY) -m ruff format --check facenet scripts tests benchmarks tools

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) runs .pytest_cache
