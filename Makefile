# Two commands a new user needs: `make demo` and `make test`. Both install first if needed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install data demo test test-fast lint bench-data clean

# fbgemm-gpu-cpu by default; `make install KERNELS=cuda` takes the CUDA fbgemm-gpu instead.
KERNELS ?= cpu
# torchrec goes in with --no-deps: its metadata asks for the CUDA fbgemm-gpu.
TORCHREC := torchrec==1.8.0

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.2
	$(BIN)/pip install --quiet -e ".[$(KERNELS),dev]"
	$(BIN)/pip install --quiet --no-deps $(TORCHREC)
	$(BIN)/python -c "import torchrec, fbgemm_gpu, hydra; print('install ok: torch', __import__('torch').__version__)"
	touch $(STAMP)

install: $(STAMP)

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

# The whole suite (slow tests included); CI runs this.
test: $(STAMP)
	$(BIN)/python -m pytest

# Everything but the tests marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) outputs multirun
