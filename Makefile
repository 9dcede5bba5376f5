# Two commands a new user needs: `make demo` and `make test`. Both install first if needed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean

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

# Main demo job: DLRM on 2 local gloo ranks, synthetic Criteo-shaped data.
demo: $(STAMP)
	$(BIN)/python -m recsys.train

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
