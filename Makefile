# dspec developer entry points.  `make test` is the README's (and CI's) test command.
PY ?= python3
PIP = $(PY) -m pip
# the clang-format of the pinned wheel (requirements-dev.txt), run through the interpreter
CLANG_FORMAT = $(PY) -c "import clang_format, sys; sys.argv[0] = 'clang-format'; clang_format.clang_format()"

.PHONY: install demo lint test test-fast bench-cpu clean

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-build-isolation -e .

# README's first command: install, then decode with the embedded default model (SmolLM2-135M)
demo: install
	$(PY) -m dspec generate --prompt "What is the capital of France?" --max-new-tokens 32

# ruff check and ruff format --check (pyproject.toml [tool.ruff]), clang-format --dry-run of
# the C++ / CUDA sources (.clang-format); .ci/run runs it after the install, before the tests
lint:
	$(PY) -m ruff check dspec tests bench examples
	$(PY) -m ruff format --check dspec tests bench examples
	$(CLANG_FORMAT) --dry-run --Werror csrc/*.cpp csrc/*.h csrc/*.cu tests/cuda_sim/*.h tests/cuda_sim/*.cpp

# the C++ kernels' tests again at each instruction-set level below the CPU's own
# (DSPEC_CPU_ISA caps the code every kernel may run; the Triton cases do not depend on it)
KERNEL_TESTS = tests/test_linear.py tests/test_cascade_attention.py tests/test_layer_ops.py \
	tests/test_token_stats.py tests/test_topk.py tests/test_verify.py tests/test_lora.py \
	tests/test_selfspec_native.py tests/test_s2d2_native.py tests/test_stack.py tests/test_cpu.py

# exits 0 when the CPU's own level (no cap) is above level $(1): at or above it, the cap
# runs the code the first pass tested
BELOW_NATIVE = DSPEC_CPU_ISA=auto $(PY) -c "import sys, dspec.cpu as c; from dspec._backend import \
	CPU_ISA_LEVELS as L; sys.exit(L.index(c.isa() or 'generic') <= L.index('$(1)'))"

test: install
	$(PY) -m pytest -q tests
	for level in avx2 generic; do \
	  if $(call BELOW_NATIVE,$$level); then \
	    DSPEC_CPU_ISA=$$level $(PY) -m pytest -q -k "not triton" $(KERNEL_TESTS) || exit 1; \
	  else echo "DSPEC_CPU_ISA=$$level: this CPU's own level, tested above"; fi; \
	done

test-fast:
	$(PY) -m pytest -q -x tests

bench-cpu:
	for b in bench/bench_*.py; do $(PY) $$b --device cpu --quick || exit 1; done

clean:
	rm -rf build dist *.egg-info dspec/_C*.so
