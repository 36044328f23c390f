# One-command set-up on a fresh machine: each target creates the virtual
# environment, installs torch 2.13.0 (CPU) when no torch is present, installs
# the Python dependencies and builds the extension against that torch.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
FMNIST := /usr/share/datasets/fashion-mnist
export MAX_JOBS ?= 2

.PHONY: setup test demo bench dataset clean

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q setuptools wheel ninja numpy tqdm matplotlib tabulate pytest hypothesis scipy scikit-learn
	$(PIP) install -q --no-build-isolation --no-deps -e .
	$(PY) -m slimcomm.info

# Fashion-MNIST from Debian's package when we can install it (root, apt);
# otherwise the training command falls back to scikit-learn's digits.
dataset:
	@if [ ! -d $(FMNIST) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 \
	  || echo "could not install dataset-fashion-mnist; using the fallback data set"; fi

test: setup dataset
	$(PY) -m pytest -q tests

demo: setup dataset
	$(PY) -m slimcomm.train --compare ddp,slimdp,ist --world-size 2 --epochs 2

bench: setup
	$(PY) bench/kernels.py --device cpu

clean:
	rm -rf build *.egg-info slimcomm/_C*.so
