# pebbling: `make serve` installs everything and serves the demo models; `make test` runs the tests.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
NVCC        ?= nvcc
CXX         ?= g++
HOST        ?= 127.0.0.1
PORT        ?= 11435
MODELS      ?= models

# Hopper machine code plus PTX, so newer GPUs can JIT it.
CUDA_ARCH   ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
# The store and the ABI at the top of native/, then the operations under cuda/ (kernels and their launchers,
# compiled by nvcc for the GPU and as C++ for the host library) and cpu/ (the host library's CPU kernels).
NATIVE_SRC  := native/pebble.cu native/store.cu native/store_tiers.cu \
               native/cuda/common.cu native/cuda/quants.cu native/cuda/dequantize.cu native/cuda/matvec.cu \
               native/cuda/norm.cu native/cuda/rope.cu native/cuda/attention.cu native/cuda/activations.cu \
               native/cuda/experts.cu native/cuda/decode_step.cu native/cuda/graph.cu native/cuda/decoder.cu
# The host library adds the CPU kernels (SIMD chosen at run time, so no -march: it runs on any x86-64).
HOST_SRC    := $(NATIVE_SRC) native/cpu/pool.cc native/cpu/quantize.cc native/cpu/matvec_32.cc native/cpu/matvec_k.cc \
               native/cpu/matvec_low.cc native/cpu/matvec_float.cc native/cpu/matmul.cc native/cpu/attend.cc native/cpu/attend_prompt.cc \
               native/cpu/activations.cc
NATIVE_HDR  := $(wildcard native/*.h native/cpu/*.h native/cuda/*.cuh)
NATIVE_DEPS := $(HOST_SRC) $(NATIVE_HDR)
HOST_OBJ    := $(HOST_SRC:%=build/obj/host/%.o)
ASAN_OBJ    := $(HOST_SRC:%=build/obj/asan/%.o)
JOBS        ?= $(shell nproc 2>/dev/null || echo 2)
# pytest on every core, a test file to a worker: a file's module-wide servers and clusters start once, and its
# tests run in their order (the Ray Serve tests read what the ones before them loaded)
XDIST        = -n $(JOBS) --dist loadfile
# -j for a library's compilers, unless this make already shares its parent's jobs (`make test`'s)
PARALLEL     = $(if $(findstring jobserver,$(MAKEFLAGS)),,-j$(JOBS))
# Includes are written from native/ ("cuda/ops.cuh", "cpu/cpu.h", "pebble_internal.h").
NATIVE_INC  := -Inative
HOST_FLAGS  := -x c++ -std=c++17 -DPEBBLE_HOST_BUILD -fPIC -shared -pthread -fvisibility=hidden -Wall -Wextra
COMPILE_FLAGS := $(filter-out -shared,$(HOST_FLAGS))
SAN_FLAGS   := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined

.PHONY: all cuda cuda-variants host host-asan venv test test-ci test-native test-sanitized fuzz serve demo-model native-best native-gpu native-stub gpu-wheels gpu-check clean

all: host

cuda: build/libpebble_cuda.so
host:
	@$(MAKE) --no-print-directory -q build/libpebble_host.so 2>/dev/null || \
		echo "make: building the host library, build/libpebble_host.so, on $(JOBS) cores (about half a minute on 2)"
	@$(MAKE) --no-print-directory $(PARALLEL) build/libpebble_host.so
host-asan:
	@$(MAKE) --no-print-directory -q build/libpebble_host_asan.so 2>/dev/null || \
		echo "make: building the host library with AddressSanitizer and UBSan, build/libpebble_host_asan.so, on $(JOBS) cores (about a minute on 2)"
	@$(MAKE) --no-print-directory $(PARALLEL) build/libpebble_host_asan.so

build/libpebble_cuda.so: $(NATIVE_DEPS)
	@command -v $(NVCC) >/dev/null 2>&1 || { echo "make cuda: nvcc was not found on PATH, so the CUDA library cannot be built here; install the CUDA toolkit or set NVCC=/path/to/nvcc." >&2; exit 1; }
	@mkdir -p build
	@echo "make: building the CUDA library, $@ (about 6 minutes on 2 cores)"
	$(NVCC) -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden $(CUDA_ARCH) --compress-mode=size $(NATIVE_INC) -o $@ $(NATIVE_SRC)

# Builds of the integer matrix-vector kernel to time beside the library (gpu-check's matvec stage, which also
# checks their products equal the library's): Hopper machine code only, compressed, to travel light.
# (Three: with the library, the wheels and the peers they fill the 64 MiB a device call carries.)
VARIANTS    := warprows2:-DPEBBLE_MATVEC_WARP_ROWS=2 loads2:-DPEBBLE_MATVEC_LOADS=2 wideloads:-DPEBBLE_MATVEC_WIDE_LOADS=1
cuda-variants: $(foreach v,$(VARIANTS),build/variants/libpebble_cuda_$(word 1,$(subst :, ,$(v))).so)

build/variants/libpebble_cuda_%.so: $(NATIVE_DEPS)
	@mkdir -p build/variants
	$(NVCC) -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden -gencode arch=compute_90,code=sm_90 \
		--compress-mode=size $(word 2,$(subst :, ,$(filter $*:%,$(VARIANTS)))) $(NATIVE_INC) -o $@ $(NATIVE_SRC)

# The host libraries a source file an object, so that `make host` compiles on every core (JOBS): a minute of
# one core's work for the optimized library, two for the sanitized one, most of it in the SIMD kernels.
build/libpebble_host.so: $(HOST_OBJ)
	$(CXX) -shared -pthread -o $@ $(HOST_OBJ)

build/obj/host/%.o: % $(NATIVE_HDR)
	@mkdir -p $(@D)
	$(CXX) -O3 $(COMPILE_FLAGS) $(NATIVE_INC) -c -o $@ $<

build/obj/asan/%.o: % $(NATIVE_HDR)
	@mkdir -p $(@D)
	$(CXX) $(SAN_FLAGS) $(COMPILE_FLAGS) $(NATIVE_INC) -c -o $@ $<

build/libpebble_host_asan.so: $(ASAN_OBJ)
	$(CXX) $(SAN_FLAGS) -shared -pthread -o $@ $(ASAN_OBJ)

# The virtual environment, with the package installed editable: what `serve` needs (.serving), and
# the test extra on top for `test` (.installed). An editable install compiles nothing (CMakeLists.txt):
# the libraries come from build/, built by the targets above.
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.serving: pyproject.toml CMakeLists.txt | $(PY)
	$(PY) -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed: pyproject.toml CMakeLists.txt | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@ $(VENV)/.serving

venv: $(VENV)/.installed

# The CUDA library where nvcc and a GPU are present, else the host build (the stub needs nothing). Chosen by
# make itself, not inside a recipe, so that `make -n serve` only prints what it would do.
HAVE_GPU    = $(shell command -v $(NVCC) >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
HAVE_CXX    = $(shell command -v $(CXX) >/dev/null 2>&1 && echo yes)
native-best: $(if $(HAVE_GPU),native-gpu,$(if $(HAVE_CXX),host,native-stub))

native-gpu: cuda $(VENV)/.serving
	$(PY) -m pip install --quiet -e '.[gpu]'

native-stub:
	@echo "no C++ compiler found: pebbling will use its pure-Python stub backend"

# The suite on every core (pytest-xdist), but for the tests marked `ci`: those, the C ABI under the sanitizers and
# the sanitized conformance suite are `test-ci`'s, which CI (.ci/run) runs after `test`.
# (The environment's install and the library's compilers at once: pip waits on the network as much as it computes.)
test:
	@$(MAKE) --no-print-directory -j$(JOBS) venv host
	$(PY) -m pytest -q $(XDIST) -m "not ci"

test-ci: venv host host-asan
	$(PY) -m pytest -q $(XDIST) -m ci
	$(MAKE) --no-print-directory test-native test-sanitized

# The C ABI driven from C against the sanitized library, with leak checking on.
build/test_pebble: tests/native/test_pebble.c build/libpebble_host_asan.so
	$(CC) $(SAN_FLAGS) -Inative -o $@ $< -Lbuild -lpebble_host_asan -Wl,-rpath,'$$ORIGIN' -lm

test-native: build/test_pebble
	ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 build/test_pebble

# The conformance suite on the host library built with AddressSanitizer and UBSan. Python itself is
# not instrumented, so the sanitizer runtime is preloaded and leak checking (which would report the
# interpreter's own allocations) is left to the native C test.
test-sanitized: venv host-asan
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	PEBBLING_LIB=build/libpebble_host_asan.so PEBBLING_TEST_BACKENDS=host \
	$(PY) -m pytest -q $(XDIST) -p no:cacheprovider tests/test_store_conformance.py tests/test_store_views.py tests/test_store_borrowed.py \
		tests/test_abi.py tests/test_quant_kernels.py \
		tests/test_quantized_residency.py tests/test_decode_step.py tests/test_attend.py tests/test_kv_types.py \
		tests/test_moe.py tests/test_moe_experts.py

# 10,000 generated requests at a live server (half of them generations on a loaded model): no 5xx, every
# status documented, still serving after; then 5,000 model-management operations against a hostile registry
# and a store with links in it: no 5xx but the registry's, /api/tags within 1 s throughout, nothing outside
# the store touched, every blob its digest's bytes. `make test` runs the same tests with 300 and 150.
fuzz: venv host
	PEBBLING_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q -s -p no:cacheprovider tests/test_fuzz.py tests/test_fuzz_store.py

# For a GPU machine with no package registry: the wheels it lacks (benchmarks/gpu_requirements.txt) into .whl/,
# with their size beside everything that travels. Then, there, with build/ (make cuda) and .whl carried:
# `make gpu-check DIR=out`: every GPU test (a skipped one fails), the benchmark, one JSON and a summary in DIR.
gpu-wheels:
	$(PYTHON) benchmarks/gpu_check.py wheels

DIR         ?= gpu-check-out
BACKEND     ?= cuda
BENCH_ARGS  ?=
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --dir $(DIR) --backend $(BACKEND) $(if $(BENCH_ARGS),--bench-args "$(BENCH_ARGS)")

# A real model beside the random demo: SmolLM2-135M-Instruct, fetched once into $(MODELS) (git-ignored)
# and checked (pebbling fetch-demo). Where it cannot be fetched, serve says so and serves the demo.
demo-model: $(VENV)/.serving
	@mkdir -p $(MODELS)
	@$(VENV)/bin/pebbling fetch-demo --models $(MODELS) || \
		echo "make serve: smollm2:135m could not be fetched (see above), so only pebbling-demo is served" >&2

serve: $(VENV)/.serving native-best demo-model
	$(VENV)/bin/pebbling serve --host $(HOST) --port $(PORT) --models $(MODELS)

clean:
	rm -rf build
