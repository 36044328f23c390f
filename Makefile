# One-command set-up on a fresh machine: each target creates the virtual
# environment, installs torch 2.13.0 (CPU) when no torch is present, installs
# the Python dependencies and builds the extension against that torch.
#
# Every step leaves a stamp file in the virtual environment and is redone only
# when the stamp is stale: the dependencies when their list (below) or
# pyproject.toml changed, the C++ extension when csrc/, setup.py,
# pyproject.toml, slimcomm/_version.py or the installed torch changed (or the
# compiled module is missing). A second `make test` starts pytest within
# seconds. `make rebuild` forces a build; `make clean` removes it.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
FMNIST := /usr/share/datasets/fashion-mnist
FORTUNES := /usr/share/games/fortunes
TESTS  ?= tests
export MAX_JOBS ?= 2

# Python packages the targets need besides torch (runtime, build and test).
DEPS := setuptools wheel ninja numpy tqdm matplotlib tabulate pytest hypothesis scipy scikit-learn
DEPS_HASH := $(shell echo '$(DEPS)' | cksum | cut -d' ' -f1)

STAMP_TORCH := $(VENV)/.stamp-torch
STAMP_DEPS  := $(VENV)/.stamp-deps-$(DEPS_HASH)
STAMP_EXT   := $(VENV)/.stamp-extension
BUILD_LOG   := build/extension-build.log
EXT_SOURCES := $(shell find csrc -type f 2>/dev/null) setup.py pyproject.toml slimcomm/_version.py
TORCH_FILE  := $(wildcard $(VENV)/lib/python*/site-packages/torch/version.py)
EXT_MODULE  := $(wildcard slimcomm/_C*.so)

.PHONY: setup test demo bench dataset rebuild clean FORCE

$(PY):
	@echo "== creating the virtual environment $(VENV) (a few seconds)"
	python3 -m venv $(VENV)

$(STAMP_TORCH): | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "== torch $$($(PY) -c 'import torch; print(torch.__version__)') is already installed in $(VENV)"; \
	else \
	  echo "== installing torch 2.13.0, CPU build (about 200 MB; 1-3 minutes)"; \
	  $(PIP) install -q torch==2.13.0 || exit 1; \
	fi
	@touch $@

$(STAMP_DEPS): $(STAMP_TORCH) pyproject.toml
	@echo "== installing the Python dependencies (about a minute the first time)"
	$(PIP) install -q $(DEPS)
	@rm -f $(VENV)/.stamp-deps-*
	@touch $@

# The module is built in place (slimcomm/_C.abi3.so) by an editable install.
$(STAMP_EXT): $(EXT_SOURCES) $(TORCH_FILE) $(if $(EXT_MODULE),,FORCE) | $(STAMP_DEPS)
	@mkdir -p build
	@echo "== building the C++ extension (about 2.5-7 minutes on 2 cores, MAX_JOBS=$(MAX_JOBS)); log: $(BUILD_LOG)"
	@start=$$(date +%s); \
	if $(PIP) install -v --no-build-isolation --no-deps -e . >$(BUILD_LOG) 2>&1; then \
	  echo "== built in $$(( $$(date +%s) - start )) s"; \
	else \
	  tail -n 40 $(BUILD_LOG); echo "== the build failed; the whole log is $(BUILD_LOG)"; exit 1; \
	fi
	@$(PY) -m slimcomm.info
	@touch $@

setup: $(STAMP_EXT)
	@echo "== slimcomm is built and up to date in $(VENV) (activate it with: . $(VENV)/bin/activate)"

rebuild:
	@rm -f $(STAMP_EXT)
	@$(MAKE) --no-print-directory setup

# Fashion-MNIST and the fortunes text from Debian's packages when we can install
# them (root, apt); otherwise the training command falls back to scikit-learn's
# digits (and the GPT workload to its bundled text).
dataset:
	@missing=""; \
	[ -d $(FMNIST) ] || missing="$$missing dataset-fashion-mnist"; \
	[ -d $(FORTUNES) ] || missing="$$missing fortunes"; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "== installing$$missing with apt-get (about a minute)"; \
	    (apt-get update -qq && apt-get install -y -qq $$missing) >/dev/null 2>&1 \
	    || echo "could not install$$missing; using the fallback data sets"; \
	  else \
	    echo "== not installed:$$missing (needs root and apt-get); using the fallback data sets"; \
	  fi; \
	fi

test: setup dataset
	@echo "== running the test suite: pytest $(TESTS) (about 11 minutes for the whole suite on 2 idle cores)"
	$(PY) -m pytest -q $(TESTS)

# The demo's settings: 360 steps (1.5 epochs of 234), an evaluation every 30 steps on the first 2000
# test images (12 per method); the training part takes 3-5 minutes on 2 cores. LINK=emulated (needs
# root, ip and tc) measures the same runs on tbf-emulated 1 Gbit/s and 100 Mbit/s links with
# bench/netbench.py instead of projecting them (1 Gbit/s in full, 100 Mbit/s for 60 timed steps, ddp 20).
DEMO_ARGS := --steps 360 --eval-every 30 --test-subset 2000
LINK ?= projected

demo: setup dataset
ifeq ($(LINK),emulated)
	@echo "== training an MLP with ddp, slimdp and ist on 2 ranks over emulated 1 Gbit/s and 100 Mbit/s links"
	@echo "   (root; about 6-8 minutes on 2 cores); results and plots go to runs/netbench/"
	$(PY) bench/netbench.py --rates 1gbit,100mbit --timed-rates 100mbit --timed-steps 60,ddp=20 \
	  --methods ddp,slimdp,ist --results-dir runs/netbench --name demo -- $(DEMO_ARGS)
else
	@echo "== training an MLP with ddp, slimdp and ist on 2 ranks (3-5 minutes on 2 cores), then projecting"
	@echo "   each run onto 1 Gbit/s and 100 Mbit/s links; the results JSONs and plot.png go to a new run"
	@echo "   directory runs/<date>-<time>-<pid>/"
	$(PY) -m slimcomm.train --compare ddp,slimdp,ist --world-size 2 $(DEMO_ARGS) --plot
endif

bench: setup
	$(PY) bench/kernels.py --device cpu

clean:
	rm -rf build *.egg-info slimcomm/_C*.so $(STAMP_EXT)

FORCE:
