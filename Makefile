# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export RAY_AUTH_MODE ?= disabled
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/dspark-torch-extensions
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast bench clean

# One pip command resolves everything (torch pinned to the CPU build on the same line; a later,
# separate moto install would break the s3fs/botocore pin).
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0 -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m pipeline.run +stage=all conf/tiny.yaml

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not integration"

bench: install
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
